"""Fuzz KVCS Track Names and Track Namespaces (profile 3.1, 3.2; binding 4).

Invariant: any input yields a parsed value or the typed rejection/error; any
other exception is a bug. Here: ``TrackNameSpec.parse`` returns a value or
raises ``KvcsNameError``; the namespace parsers return a value or ``None``
(``KvcsNamespace.try_parse``, ``kvsp.namespace.parse_namespace``) or raise
``KvcsNameError`` (``KvcsNamespace.from_track_namespace``).

Input format (plain slicing, the same with and without atheris)::

    byte 0   mode: bit 0 makes namespace field 0 ``kvcs-1`` whatever the input
             says; bit 1 makes fields 1..4 the KVCS lengths (16, 16, 32, 16),
             filled from the input (so the fuzzer reaches valid namespaces)
    rest     the body: parsed whole as a Track Name (bytes, and as text when
             it is UTF-8), and read as up to five namespace fields, each a
             length octet (mod 48) and that many octets

Checked beyond "no other exception":

* an accepted name builds back to the exact input octets (the grammar is a
  bijection), and the ``str`` parse agrees with the ``bytes`` parse;
* ``parse_namespace`` (kvsp) and ``KvcsNamespace.try_parse`` (kvcs) agree on
  which field tuples are KVCS namespaces and on their content;
  ``from_track_namespace`` raises ``KvcsNameError`` exactly where ``try_parse``
  gives ``None``; an accepted namespace rebuilds to the same fields and its
  prefixes are prefixes of it; a full track name of it and an accepted name
  stays within the MOQT limits or is refused with the wire's EncodeError.
"""

from __future__ import annotations

from fuzzlib import fuzz_main

from kvcs_core.kvcs.names import (
    DataTrackName,
    KvcsNameError,
    KvcsNamespace,
    ManifestTrackName,
    TrackNameSpec,
)
from kvcs_core.kvsp.namespace import FIELD_LENGTHS, NAMESPACE_TAG, parse_namespace
from kvcs_core.wire.errors import EncodeError
from kvcs_core.wire.names import TrackNamespace

FIELD_LEN_MOD = 48


def namespace_fields(mode: int, body: bytes) -> list[bytes]:
    """Up to five fields read from ``body`` (see the module docstring)."""
    fields: list[bytes] = []
    pos = 0
    for i in range(5):
        if mode & 2 and i > 0:
            n = FIELD_LENGTHS[i]
        else:
            if pos >= len(body):
                break
            n = body[pos] % FIELD_LEN_MOD
            pos += 1
        fields.append(body[pos : pos + n])
        pos += n
    if mode & 1:
        if fields:
            fields[0] = NAMESPACE_TAG
        else:
            fields.append(NAMESPACE_TAG)
    return fields


def parse_name(name: bytes | str) -> TrackNameSpec | KvcsNameError:
    try:
        spec = TrackNameSpec.parse(name)
    except KvcsNameError as e:
        return e
    assert isinstance(spec, ManifestTrackName | DataTrackName), type(spec)
    return spec


def check_name(body: bytes) -> TrackNameSpec | None:
    got = parse_name(body)
    if isinstance(body, bytes):
        for other in (bytearray(body), memoryview(body)):
            again = parse_name(other)
            assert type(again) is type(got), f"{type(other).__name__} parse differs"
            if not isinstance(got, KvcsNameError):
                assert again == got
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None:
        from_text = parse_name(text)
        if isinstance(got, KvcsNameError):
            assert isinstance(from_text, KvcsNameError), f"text {text!r} accepted, bytes not"
        else:
            assert from_text == got, f"text parse {from_text!r} != bytes parse {got!r}"
    if isinstance(got, KvcsNameError):
        assert got.reason, "KvcsNameError without a reason"
        return None
    assert got.build() == body, f"{got!r} builds {got.build()!r}, not the input"
    assert str(got).encode("ascii") == body
    assert TrackNameSpec.parse(got.build()) == got
    if isinstance(got, DataTrackName):
        assert DataTrackName(got.component, got.codec, got.segment) == got
        assert not got.is_manifest
    else:
        assert got.is_manifest
    return got


def check_namespace(fields: list[bytes], spec: TrackNameSpec | None) -> None:
    kvsp = parse_namespace(fields)
    try:
        wire = TrackNamespace(fields)
    except EncodeError:
        # not a legal MOQT namespace (an empty field); kvsp must not accept it
        assert kvsp is None, f"kvsp accepted fields that MOQT refuses: {fields!r}"
        return
    kvcs = KvcsNamespace.try_parse(wire)
    try:
        strict: KvcsNamespace | None = KvcsNamespace.from_track_namespace(wire)
    except KvcsNameError as e:
        assert e.reason
        strict = None
    assert strict == kvcs, "from_track_namespace and try_parse disagree"
    assert (kvsp is None) == (kvcs is None), (
        f"kvsp says {kvsp!r}, kvcs says {kvcs!r} for {fields!r}"
    )
    if kvcs is None or kvsp is None:
        return
    assert kvsp.fields == tuple(fields)
    assert kvcs.to_track_namespace() == wire
    assert (kvcs.scope_id, kvcs.compat_id, kvcs.anchor_key, kvcs.publication_id) == (
        kvsp.scope_id,
        kvsp.compat_id,
        kvsp.anchor_key,
        kvsp.publication_id,
    )
    assert kvcs.scope_prefix().is_prefix_of(wire)
    assert kvcs.content_prefix().is_prefix_of(wire)
    assert kvcs.content_prefix().fields == kvsp.content_prefix
    if spec is not None:
        try:
            full = kvcs.full_track_name(spec)
        except EncodeError:
            return  # over the 4096-octet full-name limit
        assert full.namespace == wire
        assert full.name == spec.build()


def check(data: bytes) -> None:
    mode = data[0] if data else 0
    body = data[1:]
    spec = check_name(body)
    check_namespace(namespace_fields(mode, body), spec)


def main() -> None:
    fuzz_main(check)


if __name__ == "__main__":
    main()
