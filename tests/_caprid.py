"""In-process access to caprid-moq-core (``moq_core``), an independent MOQT draft-22 codec.

Used only by tests (see ../shared/peers/INTEROP.md): caprid is a third opinion
on the wire format that nobody on this project wrote.

Two adaptations, both on caprid's side of the fence and neither touching bytes:

* caprid models namespace fields, track names, reason phrases and URIs as
  ``str`` and decodes them as UTF-8 with ``errors="replace"``. KVCS namespaces
  are binary (keyed identifiers), so for the comparison we swap caprid's two
  UTF-8 helpers for Latin-1, which maps every byte string to a distinct str and
  back. This is the "bytes shim" INTEROP.md mentions.
* caprid's data-stream readers are coroutines over its ``ReceiveStream``
  protocol; ``_ChunkStream`` replays a list of chunks as such a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import pytest

moq_core = pytest.importorskip(
    "moq_core", reason="caprid-moq-core is not installed (pip install caprid-moq-core==0.1.0)"
)
from moq_core import bytes as caprid_bytes  # noqa: E402
from moq_core import control_messages as cm  # noqa: E402
from moq_core import object_stream as obs  # noqa: E402
from moq_core import subgroup_writer as sgw  # noqa: E402


def _latin1_encode(value: str) -> bytes:
    return value.encode("latin-1")


def _latin1_decode(data: bytes | bytearray | memoryview) -> str:
    return bytes(data).decode("latin-1")


for _module in (caprid_bytes, cm, obs, sgw):
    if hasattr(_module, "utf8_encode"):
        _module.utf8_encode = _latin1_encode  # type: ignore[attr-defined]
    if hasattr(_module, "utf8_decode"):
        _module.utf8_decode = _latin1_decode  # type: ignore[attr-defined]


def s(data: bytes) -> str:
    """A byte string as caprid's str (Latin-1 shim)."""
    return data.decode("latin-1")


def b(text: str) -> bytes:
    """caprid's str back to bytes (Latin-1 shim)."""
    return text.encode("latin-1")


class CapridError(Exception):
    """caprid refused the bytes."""


def decode_control(frame: bytes) -> Any:
    """Deframe and decode exactly one control message with caprid."""
    deframer = cm.ControlMessageDeframer()
    try:
        frames = deframer.push(frame)
        if len(frames) != 1 or deframer.pending_bytes:
            raise CapridError(f"caprid deframed {len(frames)} frames")
        return cm.decode_control_message(frames[0], "moqt-22")
    except CapridError:
        raise
    except Exception as e:  # caprid raises MoqtProtocolError, IncompleteInputError, ...
        raise CapridError(f"{type(e).__name__}: {e}") from e


def encode_control(message: Any) -> bytes:
    return bytes(cm.encode_control_message(message, "moqt-22"))


class _ChunkStream:
    """caprid ReceiveStream over fixed chunks, then end of stream."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = list(chunks)

    async def read(self) -> bytes | None:
        return self._chunks.pop(0) if self._chunks else None

    def cancel(self, reason: object = None) -> None:
        self._chunks.clear()


async def _collect(gen: AsyncGenerator[Any, None]) -> list[Any]:
    return [item async for item in gen]


def read_subgroup_stream(data: bytes, chunk: int = 0) -> tuple[Any, list[Any]]:
    """caprid's reading of a whole subgroup stream: (header, objects)."""
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)] if chunk else [data]

    async def run() -> tuple[Any, list[Any]]:
        reader = caprid_bytes.StreamReader(_ChunkStream(chunks))
        stream_type = await reader.read_varint()
        header = await obs.read_subgroup_header(reader, stream_type)
        return header, await _collect(obs.read_subgroup_objects(reader, header))

    try:
        return asyncio.run(run())
    except Exception as e:
        raise CapridError(f"{type(e).__name__}: {e}") from e


def read_fetch_stream(data: bytes, descending: bool = False) -> tuple[int, list[Any]]:
    """caprid's reading of a whole fetch stream: (request id, entries)."""

    async def run() -> tuple[int, list[Any]]:
        reader = caprid_bytes.StreamReader(_ChunkStream([data]))
        stream_type = await reader.read_varint()
        if stream_type != 0x05:
            raise CapridError(f"not a fetch stream: {stream_type:#x}")
        request_id = await obs.read_fetch_header(reader)
        order = "descending" if descending else "ascending"
        return request_id, await _collect(obs.read_fetch_entries(reader, order))

    try:
        return asyncio.run(run())
    except CapridError:
        raise
    except Exception as e:
        raise CapridError(f"{type(e).__name__}: {e}") from e


def encode_subgroup_stream(
    track_alias: int,
    group_id: int,
    priority: int | None,
    objects: list[tuple[int, bytes, list[Any] | None, str]],
    *,
    has_properties: bool,
    end_of_group: bool,
) -> bytes:
    """caprid's subgroup writer encoding (mode 0b00, FIRST_OBJECT always set).

    ``objects``: (object_id, payload, properties or None, status name).
    """
    out = bytearray(
        sgw._encode_subgroup_header(track_alias, group_id, priority, has_properties, end_of_group)
    )
    prev: int | None = None
    for object_id, payload, props, status in objects:
        out += sgw._encode_object(object_id, payload, props, status, prev, has_properties)  # type: ignore[arg-type]
        prev = object_id
    return bytes(out)
