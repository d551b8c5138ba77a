"""Small random Hugging Face models built locally (no hub): a Llama and a word-level tokenizer
saved with ``save_pretrained`` into a directory, for the transformers tests and benchmark."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ("<unk>", "<s>", "</s>")


def words(vocab: int) -> list[str]:
    """The tokenizer's vocabulary: the special tokens, then ``w3``, ``w4``, ..."""
    return [*SPECIALS, *(f"w{i}" for i in range(len(SPECIALS), vocab))]


def prompt_text(count: int, seed: int = 7, vocab: int = 1000) -> str:
    """A prompt of ``count`` words (one token each), reproducible."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIALS), vocab, (count,), generator=g)
    return " ".join(f"w{int(i)}" for i in ids)


def build_model_dir(
    directory: Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1000,
    intermediate: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """A randomly initialised Llama and its tokenizer, saved into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words(vocab))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)
    kwargs: dict[str, Any] = {}
    if rope_scaling is not None:
        kwargs["rope_parameters"] = rope_scaling
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    # random init is small: scale the weights so that logits are far apart (greedy
    # decoding then does not hinge on rounding)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(directory)
    return directory
