"""The KVCS manifest: JSON model, strict parse, deterministic encode (profile 3.6).

Theory of operation
-------------------
Each manifest version is Object 0 of a new Group of the manifest track
(``manifest`` carries the JSON below; ``manifest.cose`` a COSE_Sign1 around it,
see :mod:`kvcs_core.kvcs.cose`)::

    {"kvcs": 1, "compat": {...KVSP Compatibility Descriptor...},
     "layers": L, "block_tokens": B, "deterministic": false,
     "segments": [{"segment": 0, "first_block": 0, "blocks": 64,
                   "block_keys_sha256": "<hex32>",
                   "tracks": ["k.raw.s0", "v.raw.s0"], "complete": true,
                   "object_digests": {"k.raw.s0": [[<hex>, ...], ...], ...}}]}

*Parsing* (:func:`parse_manifest`) is strict about syntax and types: UTF-8 with
no BOM (RFC 8259 section 8.1), no duplicate member names, no floating-point
numbers, NaN or Infinity anywhere (the binding forbids floats in a descriptor
and every manifest number is an integer), JSON ``true``/``false`` only where a
boolean is meant and never as a number, hex in lowercase only, a size limit.
Members the profile does not define are ignored (forward compatibility; the
``"kvcs": 1`` version number gates incompatible change). Every failure is a
:class:`ManifestError` carrying a :class:`ManifestErrorReason` and the JSON path.

*Validation* runs in the constructors, so every :class:`Manifest` value is
valid: ``kvcs`` is 1; ``layers`` and ``block_tokens`` equal the members of the
same name in ``compat`` (the binding makes both required there); segments are
numbered 0, 1, 2, ... in order, segment 0 starts at block 0 and each next one at
``first_block + blocks`` of the previous (the absolute block index of an Object
is ``first_block + Object ID``, profile 3.4); every track name parses as a data
track (profile 3.2) naming its own segment, without duplicates;
``object_digests``, when present, lists exactly the segment's tracks, each with
at most ``layers`` Groups (exactly ``layers`` once the segment is complete), one
element per completed Group, each the list of the ``blocks`` hex Data Digests of
its Objects.

*Encoding* (:meth:`Manifest.encode`) is deterministic: sorted member names at
every depth, no insignificant whitespace, ASCII output, ``object_digests``
omitted when absent; ``parse_manifest(m.encode()) == m``.

*Compatibility ID* (profile 3.6, binding 1): "a consumer MUST compute the
Compatibility ID of "compat" and discard the publication if it differs" from
namespace field 2. :meth:`Manifest.check_compat_id` takes the KVSP computation
as ``compat_id_of``; without one it uses :func:`kvsp_compat_id`, which imports
``kvcs_core.kvsp`` on first use (so nothing else here depends on that package).

*Versions*: :class:`ManifestVersions` keeps the latest version a consumer has
accepted, refuses one whose Group ID is not newer, and refuses a newer one that
contradicts what an earlier version fixed (descriptor, segment bounds and
keys, completion, digests already listed): Objects are never modified
(profile 3.4), so neither is what the manifest said about them.
"""

from __future__ import annotations

import copy
import enum
import json
from collections.abc import Callable, Mapping
from typing import Any, Final, NoReturn

import attrs

from kvcs_core.kvcs.names import DataTrackName, KvcsNameError, KvcsNamespace, TrackNameSpec

MANIFEST_FORMAT_VERSION: Final = 1
"""The value of ``"kvcs"``."""
DEFAULT_MAX_MANIFEST_BYTES: Final = 64 * 1024 * 1024
"""Default parse limit. ``object_digests`` grows with layers x blocks x tracks
(67 octets per digest): 64 MiB holds about a million digests."""
MAX_JSON_DEPTH: Final = 32
"""Nesting limit for ``compat`` (the rest of the manifest is at most 4 deep)."""
HEX_DIGEST_LEN: Final = 64
_U32: Final = 0xFFFF_FFFF
_U64: Final = 0xFFFF_FFFF_FFFF_FFFF
_HEX: Final = frozenset("0123456789abcdef")

Hex = str
"""64 lowercase hex digits: a SHA-256 value."""
ObjectDigests = dict[str, tuple[tuple[Hex, ...], ...]]
"""``track -> (group 0 digests, group 1 digests, ...)``, each group in Object order."""
CompatIdOf = Callable[[dict[str, Any]], bytes]
"""Computes the 16-octet Compatibility ID of a descriptor (binding 1)."""


class ManifestErrorReason(enum.IntEnum):
    """Why a manifest was refused."""

    TOO_LARGE = 1
    NOT_UTF8 = 2
    BAD_JSON = 3
    """Not JSON, or nested too deeply to parse."""
    DUPLICATE_MEMBER = 4
    NOT_AN_INTEGER = 5
    """A floating-point number, NaN or Infinity."""
    BAD_TYPE = 6
    MISSING_MEMBER = 7
    BAD_VALUE = 8
    """Right type, value out of range (negative, zero blocks, too deep, ...)."""
    UNSUPPORTED_VERSION = 9
    """``"kvcs"`` is not 1."""
    LAYERS_MISMATCH = 10
    BLOCK_TOKENS_MISMATCH = 11
    SEGMENT_NUMBERING = 12
    FIRST_BLOCK_GAP = 13
    BAD_TRACK_NAME = 14
    TRACK_SEGMENT_MISMATCH = 15
    DUPLICATE_TRACK = 16
    BAD_HEX = 17
    DIGEST_TRACKS_MISMATCH = 18
    """``object_digests`` does not list exactly the segment's tracks."""
    DIGEST_SHAPE = 19
    """Wrong number of Groups, or of digests in a Group."""
    COMPAT_ID_MISMATCH = 20
    BAD_COMPAT = 21
    """The injected Compatibility ID computation refused the descriptor."""


class ManifestError(ValueError):
    """A manifest that is not valid JSON of the profile 3.6 shape, or inconsistent.

    Attributes:
        reason: a :class:`ManifestErrorReason`.
        detail: what was wrong, in words.
        path: where, as a JSON path (``segments[1].tracks[0]``), or ``""``.
    """

    def __init__(self, reason: ManifestErrorReason, detail: str, path: str = "") -> None:
        where = f" at {path}" if path else ""
        super().__init__(f"{reason.name}: {detail}{where}")
        self.reason: Final = reason
        self.detail: Final = detail
        self.path: Final = path

    def under(self, prefix: str) -> ManifestError:
        """The same error with ``prefix`` prepended to its path."""
        if not self.path:
            path = prefix
        elif self.path.startswith("["):
            path = prefix + self.path
        else:
            path = f"{prefix}.{self.path}"
        return ManifestError(self.reason, self.detail, path)


def _fail(reason: ManifestErrorReason, detail: str, path: str = "") -> NoReturn:
    raise ManifestError(reason, detail, path)


def _join(path: str, member: str) -> str:
    return f"{path}.{member}" if path else member


def _int(value: object, path: str, lo: int, hi: int) -> int:
    if type(value) is not int:
        _fail(ManifestErrorReason.BAD_TYPE, f"expected an integer, got {_json_type(value)}", path)
    if not lo <= value <= hi:
        _fail(ManifestErrorReason.BAD_VALUE, f"{value} is outside {lo}..{hi}", path)
    return value


def _bool(value: object, path: str) -> bool:
    if type(value) is not bool:
        _fail(ManifestErrorReason.BAD_TYPE, f"expected a boolean, got {_json_type(value)}", path)
    return value


def _hex_digest(value: object, path: str) -> Hex:
    if type(value) is not str:
        _fail(ManifestErrorReason.BAD_TYPE, f"expected a hex string, got {_json_type(value)}", path)
    if len(value) != HEX_DIGEST_LEN or not set(value) <= _HEX:
        _fail(
            ManifestErrorReason.BAD_HEX,
            f"expected {HEX_DIGEST_LEN} lowercase hex digits, got {value[:80]!r}",
            path,
        )
    return value


def _all_hex_digests(digests: tuple[Any, ...]) -> bool:
    """Whether every element is a ``str`` of 64 lowercase hex digits, in a few C-level
    passes per Group (a manifest lists one digest per Object, and every version repeats
    them): hex-decoding the joined digits and encoding them back gives the same text only
    if every character is a lowercase hex digit."""
    if set(map(type, digests)) != {str} or set(map(len, digests)) != {HEX_DIGEST_LEN}:
        return False
    joined = "".join(digests)
    try:
        return bytes.fromhex(joined).hex() == joined
    except ValueError:
        return False


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _check_json_value(value: object, path: str, depth: int = 0) -> None:
    """A JSON value with no floats, string keys, UTF-8-encodable strings, bounded depth."""
    if depth > MAX_JSON_DEPTH:
        _fail(ManifestErrorReason.BAD_VALUE, f"nested deeper than {MAX_JSON_DEPTH}", path)
    if value is None or type(value) in (bool, int):
        return
    if type(value) is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            _fail(ManifestErrorReason.BAD_VALUE, "string is not valid Unicode", path)
        return
    if isinstance(value, float):
        _fail(ManifestErrorReason.NOT_AN_INTEGER, "floating-point numbers are not allowed", path)
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_json_value(v, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if type(k) is not str:
                _fail(ManifestErrorReason.BAD_TYPE, f"object key {k!r} is not a string", path)
            _check_json_value(v, _join(path, k), depth + 1)
        return
    _fail(ManifestErrorReason.BAD_TYPE, f"{type(value).__name__} is not a JSON value", path)


def _tuple_if_list(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _freeze_digests(value: Any) -> Any:
    """``{track: [[hex, ...], ...]}`` -> ``{track: ((hex, ...), ...)}``; else unchanged."""
    if not isinstance(value, dict):
        return value
    return {
        k: tuple(tuple(g) if isinstance(g, list) else g for g in v)
        if isinstance(v, list | tuple)
        else v
        for k, v in value.items()
    }


def _copy_compat(value: Any) -> Any:
    return copy.deepcopy(value) if isinstance(value, dict) else value


# --- the model --------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Segment:
    """One ``segments`` entry. Validated on construction (raises :class:`ManifestError`)."""

    segment: int
    first_block: int
    blocks: int
    block_keys_sha256: Hex
    """SHA-256 of the segment's concatenated raw Block Keys, lowercase hex."""
    tracks: tuple[str, ...] = attrs.field(converter=_tuple_if_list)
    complete: bool
    object_digests: ObjectDigests | None = attrs.field(default=None, converter=_freeze_digests)

    def __attrs_post_init__(self) -> None:
        _int(self.segment, "segment", 0, _U64)
        _int(self.first_block, "first_block", 0, _U64)
        _int(self.blocks, "blocks", 1, _U32 + 1)
        _hex_digest(self.block_keys_sha256, "block_keys_sha256")
        _bool(self.complete, "complete")
        if type(self.tracks) is not tuple:
            _fail(ManifestErrorReason.BAD_TYPE, "expected an array of track names", "tracks")
        if not self.tracks:
            _fail(ManifestErrorReason.BAD_VALUE, "a segment needs at least one track", "tracks")
        seen: set[str] = set()
        for i, name in enumerate(self.tracks):
            path = f"tracks[{i}]"
            if type(name) is not str:
                _fail(ManifestErrorReason.BAD_TYPE, "a track name is a string", path)
            try:
                spec = TrackNameSpec.parse(name)
            except KvcsNameError as e:
                _fail(ManifestErrorReason.BAD_TRACK_NAME, e.reason, path)
            if not isinstance(spec, DataTrackName):
                _fail(ManifestErrorReason.BAD_TRACK_NAME, f"{name!r} is not a data track", path)
            if spec.segment != self.segment:
                _fail(
                    ManifestErrorReason.TRACK_SEGMENT_MISMATCH,
                    f"{name!r} names segment {spec.segment}, not {self.segment}",
                    path,
                )
            if name in seen:
                _fail(ManifestErrorReason.DUPLICATE_TRACK, f"{name!r} is listed twice", path)
            seen.add(name)
        if self.object_digests is not None:
            self._check_digests(seen)

    def _check_digests(self, tracks: set[str]) -> None:
        od = self.object_digests
        if type(od) is not dict:
            _fail(ManifestErrorReason.BAD_TYPE, "expected an object", "object_digests")
        if set(od) != tracks:
            extra = sorted(set(od) - tracks)
            missing = sorted(tracks - set(od))
            _fail(
                ManifestErrorReason.DIGEST_TRACKS_MISMATCH,
                f"lists {extra} not in tracks, lacks {missing}",
                "object_digests",
            )
        for track, groups in od.items():
            tpath = f"object_digests.{track}"
            if type(groups) is not tuple:
                _fail(ManifestErrorReason.BAD_TYPE, "expected an array of Groups", tpath)
            for g, digests in enumerate(groups):
                gpath = f"{tpath}[{g}]"
                if type(digests) is not tuple:
                    _fail(ManifestErrorReason.BAD_TYPE, "expected an array of digests", gpath)
                if len(digests) != self.blocks:
                    _fail(
                        ManifestErrorReason.DIGEST_SHAPE,
                        f"Group {g} lists {len(digests)} digests; the segment has "
                        f"{self.blocks} blocks",
                        gpath,
                    )
                if not _all_hex_digests(digests):
                    for o, d in enumerate(digests):  # find the first bad one, for its path
                        _hex_digest(d, f"{gpath}[{o}]")

    @property
    def data_tracks(self) -> tuple[DataTrackName, ...]:
        """The track names, parsed."""
        return tuple(_data_track(t) for t in self.tracks)

    @property
    def end_block(self) -> int:
        """One past the last absolute block index of the segment."""
        return self.first_block + self.blocks

    def selections(self) -> list[tuple[str, ...]]:
        """What a consumer may select (profile 3.2): a ``k``/``v`` pair of one codec
        or one ``kv`` track. In the order the tracks are listed."""
        by_name = {(t.component.token, t.codec): str(t) for t in self.data_tracks}
        out: list[tuple[str, ...]] = []
        for t in self.data_tracks:
            if t.component.token == "kv":
                out.append((str(t),))
            elif t.component.token == "k" and ("v", t.codec) in by_name:
                out.append((str(t), by_name[("v", t.codec)]))
        return out

    def matches_block_keys(self, block_keys_sha256: bytes) -> bool:
        """True when the segment lists this SHA-256 of the consumer's own Block Keys.

        The consumer computes it over its Block Keys of the segment's blocks
        (binding 3) to confirm that the segment covers its tokens (profile 3.6).
        """
        return self.block_keys_sha256 == bytes(block_keys_sha256).hex()

    def completed_groups(self, track: str) -> int | None:
        """How many Groups of ``track`` the digests list, or None without digests."""
        if self.object_digests is None or track not in self.object_digests:
            return None
        return len(self.object_digests[track])

    def to_json(self) -> dict[str, Any]:
        """The JSON object (``object_digests`` omitted when absent)."""
        obj: dict[str, Any] = {
            "segment": self.segment,
            "first_block": self.first_block,
            "blocks": self.blocks,
            "block_keys_sha256": self.block_keys_sha256,
            "tracks": list(self.tracks),
            "complete": self.complete,
        }
        if self.object_digests is not None:
            obj["object_digests"] = {
                t: [list(g) for g in groups] for t, groups in self.object_digests.items()
            }
        return obj


def _data_track(name: str) -> DataTrackName:
    spec = TrackNameSpec.parse(name)
    assert isinstance(spec, DataTrackName)  # validated on construction
    return spec


_FOUND_LIMIT: Final = 4096
"""Track names a :class:`Manifest` remembers the lookup of (any more are parsed each time)."""


@attrs.frozen(kw_only=True)
class Manifest:
    """One manifest version (profile 3.6). Validated on construction.

    ``compat`` is a private deep copy of the descriptor; treat it as read-only.
    Not hashable (it holds dicts).
    """

    kvcs: int = MANIFEST_FORMAT_VERSION
    compat: dict[str, Any] = attrs.field(converter=_copy_compat)
    layers: int
    block_tokens: int
    deterministic: bool
    segments: tuple[Segment, ...] = attrs.field(converter=_tuple_if_list)
    _found: dict[str | bytes, tuple[str, Segment] | None] = attrs.field(
        init=False, factory=dict, eq=False, repr=False
    )
    """:meth:`_find_track`'s answers so far (a consumer asks once per Object; at most
    :data:`_FOUND_LIMIT` names are kept)."""

    def __attrs_post_init__(self) -> None:
        if type(self.kvcs) is not int or self.kvcs != MANIFEST_FORMAT_VERSION:
            _fail(
                ManifestErrorReason.UNSUPPORTED_VERSION,
                f"kvcs is {self.kvcs!r}; this implementation reads version 1",
                "kvcs",
            )
        _int(self.layers, "layers", 1, _U32 + 1)
        _int(self.block_tokens, "block_tokens", 1, _U32)
        _bool(self.deterministic, "deterministic")
        if type(self.compat) is not dict:
            _fail(ManifestErrorReason.BAD_TYPE, "expected an object", "compat")
        _check_json_value(self.compat, "compat")
        for member, mine, reason in (
            ("layers", self.layers, ManifestErrorReason.LAYERS_MISMATCH),
            ("block_tokens", self.block_tokens, ManifestErrorReason.BLOCK_TOKENS_MISMATCH),
        ):
            if member not in self.compat:
                _fail(ManifestErrorReason.MISSING_MEMBER, "required member", f"compat.{member}")
            theirs = self.compat[member]
            if type(theirs) is not int or theirs != mine:
                _fail(reason, f"compat.{member} is {theirs!r} but {member} is {mine}", member)
        if type(self.segments) is not tuple:
            _fail(ManifestErrorReason.BAD_TYPE, "expected an array of segments", "segments")
        expected_first = 0
        for i, seg in enumerate(self.segments):
            path = f"segments[{i}]"
            if not isinstance(seg, Segment):
                _fail(ManifestErrorReason.BAD_TYPE, "expected a Segment", path)
            if seg.segment != i:
                _fail(
                    ManifestErrorReason.SEGMENT_NUMBERING,
                    f"segment {seg.segment} in position {i}; segments are numbered 0, 1, ...",
                    f"{path}.segment",
                )
            if seg.first_block != expected_first:
                _fail(
                    ManifestErrorReason.FIRST_BLOCK_GAP,
                    f"first_block is {seg.first_block}, expected {expected_first}",
                    f"{path}.first_block",
                )
            expected_first = seg.end_block
            if expected_first * self.block_tokens > _U64 + 1:
                _fail(
                    ManifestErrorReason.BAD_VALUE,
                    "token positions exceed the 64-bit Token Start",
                    f"{path}.blocks",
                )
            for track, groups in (seg.object_digests or {}).items():
                n = len(groups)
                if n > self.layers or (seg.complete and n != self.layers):
                    want = f"exactly {self.layers}" if seg.complete else f"at most {self.layers}"
                    _fail(
                        ManifestErrorReason.DIGEST_SHAPE,
                        f"{n} Groups listed; a {'complete' if seg.complete else 'partial'} "
                        f"segment lists {want}",
                        f"{path}.object_digests.{track}",
                    )

    # --- lookups ---------------------------------------------------------------

    @property
    def total_blocks(self) -> int:
        """Blocks covered by all segments."""
        return self.segments[-1].end_block if self.segments else 0

    @property
    def complete(self) -> bool:
        """True when there is a segment and every segment is complete."""
        return bool(self.segments) and all(s.complete for s in self.segments)

    def segment_of_track(self, track: str | bytes) -> Segment | None:
        """The segment that lists ``track``, or None (also for a malformed name)."""
        found = self._find_track(track)
        return None if found is None else found[1]

    def _find_track(self, track: str | bytes) -> tuple[str, Segment] | None:
        """``(canonical name, segment)`` of a listed data track, else ``None`` (a name
        asked before is answered from :attr:`_found`, not parsed again)."""
        found = self._found
        if track in found:
            return found[track]
        answer: tuple[str, Segment] | None = None
        try:
            spec = TrackNameSpec.parse(track)
        except KvcsNameError:
            spec = None
        if isinstance(spec, DataTrackName) and spec.segment < len(self.segments):
            seg = self.segments[spec.segment]
            name = str(spec)
            if name in seg.tracks:
                answer = (name, seg)
        if len(found) < _FOUND_LIMIT:
            found[track] = answer
        return answer

    def digest_of(self, track: str | bytes, layer: int, block: int) -> bytes | None:
        """The listed Data Digest of ``track``, Group ``layer``, Object ``block``.

        ``block`` is the Object ID (the block index within the segment). None
        when the manifest does not list it (no such track, no ``object_digests``,
        Group not completed yet, index out of range).
        """
        found = self._find_track(track)
        if found is None:
            return None
        name, seg = found
        if seg.object_digests is None:
            return None
        groups = seg.object_digests[name]
        if not (0 <= layer < len(groups) and 0 <= block < seg.blocks):
            return None
        return bytes.fromhex(groups[layer][block])

    def token_start(self, segment: int, object_id: int) -> int:
        """Token Start of an Object: ``(first_block + Object ID) * block_tokens``."""
        return (self.segments[segment].first_block + object_id) * self.block_tokens

    # --- Compatibility ID (profile 3.6, binding 1) ----------------------------------

    def compat_id(self, compat_id_of: CompatIdOf | None = None) -> bytes:
        """The Compatibility ID of ``compat``.

        ``compat_id_of`` computes it (binding 1); by default
        :func:`kvsp_compat_id`. Raises :class:`ManifestError` (``BAD_COMPAT``)
        when that function refuses the descriptor (``ValueError``/``TypeError``,
        which includes ``kvcs_core.kvsp``'s ``DescriptorError``).
        """
        fn = kvsp_compat_id if compat_id_of is None else compat_id_of
        try:
            cid = fn(copy.deepcopy(self.compat))
        except (ValueError, TypeError) as e:
            _fail(ManifestErrorReason.BAD_COMPAT, f"descriptor refused: {e}", "compat")
        return bytes(cid)

    def check_compat_id(
        self, expected: bytes | KvcsNamespace, compat_id_of: CompatIdOf | None = None
    ) -> None:
        """Raise :class:`ManifestError` unless ``compat`` has the namespace's Compatibility ID.

        ``expected`` is namespace field 2 or the whole namespace. Profile 3.6: a
        consumer MUST discard the publication on a mismatch (``COMPAT_ID_MISMATCH``)
        or when the descriptor is invalid (``BAD_COMPAT``).
        """
        want = expected.compat_id if isinstance(expected, KvcsNamespace) else bytes(expected)
        got = self.compat_id(compat_id_of)
        if got != want:
            _fail(
                ManifestErrorReason.COMPAT_ID_MISMATCH,
                f"compat has Compatibility ID {got.hex()}, the namespace {want.hex()}",
                "compat",
            )

    # --- encoding -------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The JSON object."""
        return {
            "kvcs": self.kvcs,
            "compat": copy.deepcopy(self.compat),
            "layers": self.layers,
            "block_tokens": self.block_tokens,
            "deterministic": self.deterministic,
            "segments": [s.to_json() for s in self.segments],
        }

    def encode(self) -> bytes:
        """Deterministic JSON: sorted keys at every depth, no whitespace, ASCII."""
        return encode_manifest(self)


def kvsp_compat_id(compat: dict[str, Any]) -> bytes:
    """Binding 1's Compatibility ID of ``compat``, computed by ``kvcs_core.kvsp``.

    Validates the descriptor completely (raises ``kvcs_core.kvsp``'s
    ``DescriptorError``, a ``ValueError``). ``kvcs_core.kvsp`` is imported on
    first use only, so this module loads without it.
    """
    from kvcs_core.kvsp.descriptor import CompatibilityDescriptor  # noqa: PLC0415 (lazy)

    return CompatibilityDescriptor(compat).compat_id


def encode_manifest(manifest: Manifest) -> bytes:
    """Deterministic JSON octets of ``manifest`` (same as :meth:`Manifest.encode`)."""
    return json.dumps(
        manifest.to_json(),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    ).encode("ascii")


# --- parsing ----------------------------------------------------------------------


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            _fail(ManifestErrorReason.DUPLICATE_MEMBER, f"member {k!r} appears twice")
        out[k] = v
    return out


def _no_float(text: str) -> NoReturn:
    _fail(ManifestErrorReason.NOT_AN_INTEGER, f"number {text[:40]} is not an integer")


def _no_constant(text: str) -> NoReturn:
    _fail(ManifestErrorReason.NOT_AN_INTEGER, f"{text} is not allowed")


def _member(obj: Mapping[str, Any], name: str, path: str) -> Any:
    if name not in obj:
        _fail(ManifestErrorReason.MISSING_MEMBER, "required member", _join(path, name))
    return obj[name]


def _array(value: object, path: str) -> list[Any]:
    if type(value) is not list:
        _fail(ManifestErrorReason.BAD_TYPE, f"expected an array, got {_json_type(value)}", path)
    return value


def _object(value: object, path: str) -> dict[str, Any]:
    if type(value) is not dict:
        _fail(ManifestErrorReason.BAD_TYPE, f"expected an object, got {_json_type(value)}", path)
    return value


def _segment_from_json(value: object, path: str) -> Segment:
    obj = _object(value, path)
    members = ("segment", "first_block", "blocks", "block_keys_sha256", "tracks", "complete")
    kw = {m: _member(obj, m, path) for m in members}
    _array(kw["tracks"], f"{path}.tracks")
    if "object_digests" in obj:
        od = _object(obj["object_digests"], f"{path}.object_digests")
        for track, groups in od.items():
            tpath = f"{path}.object_digests.{track}"
            for g, digests in enumerate(_array(groups, tpath)):
                _array(digests, f"{tpath}[{g}]")
        kw["object_digests"] = od
    try:
        return Segment(**kw)
    except ManifestError as e:
        raise e.under(path) from None


def manifest_from_json(value: object) -> Manifest:
    """Build and validate a :class:`Manifest` from a parsed JSON value."""
    obj = _object(value, "")
    version = _member(obj, "kvcs", "")
    if type(version) is not int or version != MANIFEST_FORMAT_VERSION:
        _fail(
            ManifestErrorReason.UNSUPPORTED_VERSION,
            f"kvcs is {version!r}; this implementation reads version 1",
            "kvcs",
        )
    compat = _object(_member(obj, "compat", ""), "compat")
    layers = _member(obj, "layers", "")
    block_tokens = _member(obj, "block_tokens", "")
    deterministic = _member(obj, "deterministic", "")
    segments = [
        _segment_from_json(s, f"segments[{i}]")
        for i, s in enumerate(_array(_member(obj, "segments", ""), "segments"))
    ]
    return Manifest(
        kvcs=version,
        compat=compat,
        layers=layers,
        block_tokens=block_tokens,
        deterministic=deterministic,
        segments=segments,
    )


def parse_manifest(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_MANIFEST_BYTES
) -> Manifest:
    """Strictly parse and validate manifest JSON octets (profile 3.6).

    Raises :class:`ManifestError` (and nothing else) for any bad input.
    """
    if len(data) > max_size:
        _fail(ManifestErrorReason.TOO_LARGE, f"{len(data)} octets exceed the limit {max_size}")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        _fail(ManifestErrorReason.NOT_UTF8, f"not UTF-8 at octet {e.start}")
    try:
        value = json.loads(
            text,
            object_pairs_hook=_object_pairs,
            parse_float=_no_float,
            parse_constant=_no_constant,
        )
    except ManifestError:
        raise
    except json.JSONDecodeError as e:
        _fail(ManifestErrorReason.BAD_JSON, f"{e.msg} (line {e.lineno}, column {e.colno})")
    except RecursionError:
        _fail(ManifestErrorReason.BAD_JSON, "nested too deeply")
    except ValueError as e:  # e.g. an integer with more digits than int() allows
        _fail(ManifestErrorReason.BAD_JSON, str(e)[:200])
    return manifest_from_json(value)


# --- versions -----------------------------------------------------------------------


class VersionRejectReason(enum.IntEnum):
    """Why :meth:`ManifestVersions.offer` refused a version."""

    STALE = 1
    """Its Group ID is older than the latest accepted version's."""
    DUPLICATE = 2
    """Its Group ID is the latest accepted version's (e.g. fill and live overlap)."""
    INCONSISTENT = 3
    """It contradicts the latest accepted version (see :func:`successor_conflict`)."""


@attrs.frozen
class VersionRejected:
    """A manifest version that :class:`ManifestVersions` did not accept."""

    reason: VersionRejectReason
    detail: str
    group_id: int


def successor_conflict(old: Manifest, new: Manifest) -> str | None:
    """Why ``new`` cannot follow ``old`` in one publication, or None if it can.

    Fixed once published: ``kvcs``, ``compat``, ``layers``, ``block_tokens``,
    ``deterministic``; every existing segment's ``first_block``, ``blocks`` and
    ``block_keys_sha256``; its tracks (more may be added); completion (a
    complete segment stays complete); the digests already listed (lists only
    grow, by whole Groups). Segments are only appended.
    """
    for field in ("kvcs", "compat", "layers", "block_tokens", "deterministic"):
        if getattr(old, field) != getattr(new, field):
            return f"{field} changed"
    if len(new.segments) < len(old.segments):
        return f"segments went from {len(old.segments)} to {len(new.segments)}"
    for o, n in zip(old.segments, new.segments, strict=False):
        where = f"segment {o.segment}"
        if (o.first_block, o.blocks, o.block_keys_sha256) != (
            n.first_block,
            n.blocks,
            n.block_keys_sha256,
        ):
            return f"{where}: first_block, blocks or block_keys_sha256 changed"
        missing = set(o.tracks) - set(n.tracks)
        if missing:
            return f"{where}: tracks {sorted(missing)} withdrawn"
        if o.complete and not n.complete:
            return f"{where}: complete went back to false"
        if o.object_digests is not None and n.object_digests is not None:
            for track, groups in o.object_digests.items():
                if n.object_digests[track][: len(groups)] != groups:
                    return f"{where}: listed digests of {track} changed or shrank"
    return None


class ManifestVersions:
    """The latest accepted manifest version of one publication (consumer side).

    Versions are Groups of the manifest track with increasing Group IDs
    (profile 3.6). Gaps are accepted (a consumer that joins late, or misses a
    version, sees only some), going back or repeating is not.
    """

    __slots__ = ("_group", "_manifest")

    def __init__(self) -> None:
        self._group: int | None = None
        self._manifest: Manifest | None = None

    @property
    def latest_group(self) -> int | None:
        """Group ID of the latest accepted version, or None before the first."""
        return self._group

    @property
    def latest(self) -> Manifest | None:
        """The latest accepted version, or None before the first."""
        return self._manifest

    def offer(self, group_id: int, manifest: Manifest) -> Manifest | VersionRejected:
        """Accept ``manifest`` (Group ``group_id``) as the latest version, or say why not.

        Returns the manifest when accepted. Never raises on peer data.
        """
        if self._group is not None and self._manifest is not None:
            if group_id == self._group:
                return VersionRejected(
                    VersionRejectReason.DUPLICATE, f"version {group_id} already seen", group_id
                )
            if group_id < self._group:
                return VersionRejected(
                    VersionRejectReason.STALE,
                    f"version {group_id} is older than {self._group}",
                    group_id,
                )
            conflict = successor_conflict(self._manifest, manifest)
            if conflict is not None:
                return VersionRejected(VersionRejectReason.INCONSISTENT, conflict, group_id)
        self._group = group_id
        self._manifest = manifest
        return manifest
