"""Control messages captured from the independent peers decode with our codec, and re-encode.

``tests/peers/captured_d22_control.json`` holds 36 draft-22 control messages that
aiomoqt 0.13.3 and moq-rs 0.5.1 sent over raw QUIC on loopback (how they were
captured: ``tests/peers/README.md``). They are bytes nobody here wrote: each must
decode to exactly its length and encode back to the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcs_core.wire.messages import decode_message, encode_message

CAPTURED = Path(__file__).resolve().parent / "peers" / "captured_d22_control.json"
VECTORS: list[dict[str, Any]] = json.loads(CAPTURED.read_text())["vectors"]


def test_capture_covers_both_peers() -> None:
    senders = {v["sender"].split()[0] for v in VECTORS}
    assert {"aiomoqt", "moq-rs"} <= senders
    assert len(VECTORS) >= 30


@pytest.mark.parametrize(
    "vector", VECTORS, ids=[f"{i}-{v['message']}" for i, v in enumerate(VECTORS)]
)
def test_peer_message_decodes_and_reencodes(vector: dict[str, Any]) -> None:
    raw = bytes.fromhex(vector["hex"])
    msg, used = decode_message(raw)
    assert used == len(raw)
    assert type(msg).__name__ == vector["message"]
    assert encode_message(msg) == raw
