"""Scope ID, Block Keys, Anchor Key and ``block_keys_sha256``.

Theory of operation
-------------------
Implements ``KVSP-BINDING.md`` sections 2 and 3 (v0). The scope key (32
octets, shared by the parties of a scope) is passed in; nothing here makes
entropy or keeps keys beyond a call.

* ``scope_id = HMAC-SHA256(scope_key, "KVSP-scope-v0")[0:16]``.
* Tokens are u32 token IDs. With ``B = block_tokens``, a prompt of ``n``
  tokens has ``n // B`` full blocks; a partial tail block has no key.
  ``T_i`` is the ``u32le`` encoding of the tokens of block ``i``.
* ``K_0 = HMAC(scope_key, "KVSP-block-v0" || compat_id || T_0)`` and
  ``K_i = HMAC(scope_key, K_(i-1) || T_i)``: 32 octets each, chained.
* The Anchor Key of the prefix of ``m`` blocks is ``K_(m-1)``.
* ``block_keys_sha256`` of a segment is the lowercase hex of
  ``SHA-256(K_first || ... || K_(first+blocks-1))``.

Cost: the tokens are packed once (one ``struct.pack``) and each block costs one
copy of a precomputed HMAC state (the key schedule is done once per call) and
one SHA-256 compression pair over ``32 + 4*B`` octets: a 128k-token prompt with
``B = 16`` (8192 blocks) takes about 15 ms, and ``B = 1`` about 0.2 s.

:func:`chain_block_keys` is the primitive: it takes tokens already packed as
``u32le`` (what an adapter gets from ``array.astype("<u4").tobytes()``) and,
optionally, the key of the block before the first one, so that the keys of an
appended segment continue the chain without recomputing the earlier ones.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Final

from kvcs_core.kvsp.descriptor import COMPAT_ID_LEN, CompatibilityDescriptor
from kvcs_core.kvsp.dtypes import Buffer
from kvcs_core.kvsp.errors import KvspError

SCOPE_KEY_LEN: Final = 32
"""Octets in a scope key (section 2)."""
SCOPE_ID_LEN: Final = 16
"""Octets in a Scope ID (section 2)."""
BLOCK_KEY_LEN: Final = 32
"""Octets in a Block Key and an Anchor Key (section 3)."""
SCOPE_LABEL: Final = b"KVSP-scope-v0"
BLOCK_LABEL: Final = b"KVSP-block-v0"
MAX_TOKEN: Final = 2**32 - 1
"""Largest token ID (tokens are u32)."""
TOKEN_SIZE: Final = 4
"""Octets per packed token (u32le)."""


def _check_len(value: Buffer, length: int, what: str) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise KvspError(f"{what} must be bytes, not {type(value).__name__}")
    if len(value) != length:
        raise KvspError(f"{what} must be {length} octets, not {len(value)}")
    return bytes(value)


def check_scope_key(scope_key: Buffer) -> bytes:
    """Return ``scope_key`` as ``bytes`` after checking that it is 32 octets.

    Raises:
        KvspError: not bytes-like, or not 32 octets.
    """
    return _check_len(scope_key, SCOPE_KEY_LEN, "scope key")


def scope_id(scope_key: Buffer) -> bytes:
    """``HMAC-SHA256(scope_key, "KVSP-scope-v0")[0:16]`` (section 2)."""
    key = check_scope_key(scope_key)
    return hmac.digest(key, SCOPE_LABEL, "sha256")[:SCOPE_ID_LEN]


def full_blocks(token_count: int, block_tokens: int) -> int:
    """``token_count // block_tokens``: the blocks that have keys (a partial tail has none)."""
    if token_count < 0 or block_tokens < 1:
        raise KvspError(f"bad token count {token_count} or block size {block_tokens}")
    return token_count // block_tokens


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """The ``u32le`` encoding of every token (section 3).

    Raises:
        KvspError: a token is not an integer in 0..2**32-1 (the message gives
            its index).
    """
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        pass
    for index, token in enumerate(tokens):
        if not isinstance(token, int) or not 0 <= token <= MAX_TOKEN:
            raise KvspError(f"token {index} ({token!r}) is not a u32 token ID") from None
    raise KvspError("tokens cannot be packed as u32")  # pragma: no cover - unreachable


def chain_block_keys(
    scope_key: Buffer,
    compat_id: Buffer,
    block_tokens: int,
    packed_tokens: Buffer,
    *,
    previous_key: Buffer | None = None,
) -> tuple[bytes, ...]:
    """The Block Keys of the full blocks of ``u32le``-packed tokens (section 3).

    Args:
        scope_key: the 32-octet scope key.
        compat_id: the 16-octet Compatibility ID.
        block_tokens: B, tokens per block (>= 1).
        packed_tokens: the tokens as ``u32le``; a trailing partial block (fewer
            than B tokens) is ignored. Its length must be a multiple of 4.
        previous_key: ``None`` when the first packed token is token 0 of the
            prompt; otherwise the Block Key ``K_(i-1)`` of the block just before
            the first packed one (which must start on a block boundary), and
            the result is ``K_i, K_(i+1), ...``.

    Returns:
        One 32-octet key per full block, in order.
    """
    key = check_scope_key(scope_key)
    cid = _check_len(compat_id, COMPAT_ID_LEN, "Compatibility ID")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise KvspError(f"block_tokens must be an integer >= 1, not {block_tokens!r}")
    view = memoryview(packed_tokens).cast("B")
    if len(view) % TOKEN_SIZE:
        raise KvspError(f"{len(view)} octets are not a whole number of u32 tokens")
    step = block_tokens * TOKEN_SIZE
    count = len(view) // step
    base = hmac.new(key, digestmod=hashlib.sha256)
    if previous_key is None:
        prev = BLOCK_LABEL + cid
    else:
        prev = _check_len(previous_key, BLOCK_KEY_LEN, "previous Block Key")
    keys: list[bytes] = []
    append = keys.append
    for offset in range(0, count * step, step):
        mac = base.copy()
        mac.update(prev)
        mac.update(view[offset : offset + step])
        prev = mac.digest()
        append(prev)
    return tuple(keys)


def block_keys(
    scope_key: Buffer, descriptor: CompatibilityDescriptor, tokens: Sequence[int]
) -> tuple[bytes, ...]:
    """The Block Keys ``K_0 .. K_(n//B - 1)`` of a prompt (section 3).

    ``descriptor`` gives the Compatibility ID and B; a partial tail block has
    no key.

    Raises:
        KvspError: bad scope key or a token outside u32.
    """
    block_tokens = descriptor.block_tokens
    usable = full_blocks(len(tokens), block_tokens) * block_tokens
    return chain_block_keys(
        scope_key, descriptor.compat_id, block_tokens, pack_tokens(tokens[:usable])
    )


def anchor_key(keys: Sequence[bytes], blocks: int) -> bytes:
    """The Anchor Key of the prefix of ``blocks`` blocks: ``K_(blocks-1)`` (section 3).

    Raises:
        KvspError: ``blocks`` is not in 1..len(keys) (an empty prefix has no
            Anchor Key).
    """
    if not 1 <= blocks <= len(keys):
        raise KvspError(f"no Anchor Key for a prefix of {blocks} blocks (have {len(keys)} keys)")
    return keys[blocks - 1]


def block_keys_sha256(keys: Sequence[bytes], first: int = 0, blocks: int | None = None) -> str:
    """Lowercase hex of ``SHA-256(K_first || ... || K_(first+blocks-1))`` (section 3).

    ``keys`` are the keys of the whole prompt (``keys[i]`` is ``K_i``); the
    segment is ``blocks`` keys from ``first`` (default: to the end). A segment
    of zero blocks gives the SHA-256 of the empty string.

    Raises:
        KvspError: the segment is not within ``keys``, or a key is not 32 octets.
    """
    end = len(keys) if blocks is None else first + blocks
    if not 0 <= first <= end <= len(keys):
        raise KvspError(f"segment {first}..{end} is outside the {len(keys)} Block Keys")
    digest = hashlib.sha256()
    for index in range(first, end):
        key = keys[index]
        if len(key) != BLOCK_KEY_LEN:
            raise KvspError(f"Block Key {index} is {len(key)} octets, not {BLOCK_KEY_LEN}")
        digest.update(key)
    return digest.hexdigest()
