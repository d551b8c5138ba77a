"""Compatibility Descriptor, its deterministic CBOR and the Compatibility ID.

Theory of operation
-------------------
Implements ``KVSP-BINDING.md`` section 1 (v0). A Compatibility Descriptor (CD)
is a JSON object, as the manifest carries it under ``"compat"`` (profile
section 3.6). :class:`CompatibilityDescriptor` is built from the decoded JSON
value (``dict``/``list``/``str``/``int``/``bool``/``None``) and validates it
completely, or raises :class:`~kvcs_core.kvsp.errors.DescriptorError` naming
the member at fault; an instance therefore always holds a valid CD.

Rules checked (every one has a negative test):

* the CD is an object; every object key anywhere is a string;
* required members and types: ``kvsp`` (integer, exactly 0), ``model``
  (string), ``layers``, ``kv_heads``, ``head_dim``, ``block_tokens`` (integers
  >= 1), ``dtype`` (one of the five names of :class:`Dtype`); ``true``/``false``
  are not integers;
* optional ``tokenizer`` is a string and optional ``extra`` is an object;
* other members are allowed (and count towards the ID);
* no floating-point number anywhere (NaN and infinities included);
* only JSON values anywhere: objects, arrays (``list`` or ``tuple``), strings,
  integers, ``true``, ``false``, ``null``;
* strings (keys included) are sequences of Unicode scalar values, so that they
  have a UTF-8 encoding (a JSON ``"\\ud800"`` escape decodes to a lone
  surrogate, which has none);
* integers fit the CBOR major types 0 and 1 (-2**64 .. 2**64-1): beyond that the
  deterministic encoding needs a bignum tag, which the binding's JSON-to-CBOR
  mapping does not provide;
* nesting is at most :data:`MAX_DEPTH` levels deep (a resource bound of this
  implementation, not a binding rule).

The validated value is normalised to plain built-in types (subclasses such as
``IntEnum`` or ``StrEnum`` members become ``int``/``str``) and encoded with
``cbor2.dumps(value, canonical=True)``, the core deterministic encoding of RFC
8949 section 4.2.1. For maps whose keys are all text strings, RFC 8949's
bytewise key order and the length-first order of RFC 7049 coincide, so the
result does not depend on which of the two a cbor2 version implements.

``compat_id = SHA-256("KVSP-compat-v0" || cd_bytes)[0:16]``.

:meth:`CompatibilityDescriptor.from_cd_bytes` is the inverse: it accepts only
bytes that are exactly the deterministic encoding of a valid CD.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final

import attrs
import cbor2

from kvcs_core.kvsp.dtypes import ITEMSIZE, Dtype
from kvcs_core.kvsp.errors import DescriptorError, json_pointer

KVSP_VERSION: Final = 0
"""Value of the ``kvsp`` member: the version of the binding (section 1)."""
COMPAT_ID_LEN: Final = 16
"""Octets in a Compatibility ID."""
COMPAT_ID_LABEL: Final = b"KVSP-compat-v0"
MAX_DEPTH: Final = 64
"""Deepest nesting of objects and arrays accepted (the CD itself is depth 1)."""

_INT_MIN: Final = -(2**64)
_INT_MAX: Final = 2**64 - 1

_POSITIVE_INT_MEMBERS: Final = ("layers", "kv_heads", "head_dim", "block_tokens")
REQUIRED_MEMBERS: Final = (
    "kvsp",
    "model",
    "layers",
    "kv_heads",
    "head_dim",
    "dtype",
    "block_tokens",
)
"""The members every CD has (section 1)."""
OPTIONAL_MEMBERS: Final = ("tokenizer", "extra")
"""The optional members with a defined type (section 1)."""

JsonValue = dict[str, "JsonValue"] | list["JsonValue"] | str | int | bool | None
"""A JSON value without numbers other than integers, as a CD holds."""


def compatibility_id(cd_bytes: bytes) -> bytes:
    """``SHA-256("KVSP-compat-v0" || cd_bytes)[0:16]`` (section 1)."""
    return hashlib.sha256(COMPAT_ID_LABEL + cd_bytes).digest()[:COMPAT_ID_LEN]


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a floating-point number"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    return f"a {type(value).__name__} (not a JSON value)"


def _check_text(text: str, path: tuple[str | int, ...], *, key: bool = False) -> str:
    """``text`` as a plain ``str``; it must have a UTF-8 encoding.

    For an object key, the error names the enclosing object (``path``) and
    gives the key escaped, so that the message itself is printable.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        what = f"object key {text!a}" if key else "string"
        raise DescriptorError(
            json_pointer(path), f"{what} contains a lone surrogate (not a Unicode scalar value)"
        ) from None
    return str.__str__(text)


def _normalise(value: object, path: tuple[str | int, ...], depth: int) -> JsonValue:
    """Validate a JSON value anywhere in a CD and return it with built-in types only."""
    where = json_pointer(path)
    if value is None or isinstance(value, bool):
        return bool(value) if value is not None else None
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise DescriptorError(
                where,
                f"integer of {value.bit_length()} bits is outside -2**64..2**64-1 "
                "(it would need a CBOR bignum tag)",
            )
        return int.__index__(value)
    if isinstance(value, float):
        raise DescriptorError(
            where, f"floating-point number {value!r} is not allowed (write it as a decimal string)"
        )
    if isinstance(value, str):
        return _check_text(value, path)
    if isinstance(value, Mapping):
        return _normalise_object(value, path, depth)
    if isinstance(value, list | tuple):
        if depth >= MAX_DEPTH:
            raise DescriptorError(where, f"nested more than {MAX_DEPTH} levels deep")
        return [_normalise(item, (*path, i), depth + 1) for i, item in enumerate(value)]
    raise DescriptorError(where, f"is {_type_name(value)}")


def _normalise_object(
    value: Mapping[object, object], path: tuple[str | int, ...], depth: int
) -> dict[str, JsonValue]:
    if depth >= MAX_DEPTH:
        raise DescriptorError(json_pointer(path), f"nested more than {MAX_DEPTH} levels deep")
    out: dict[str, JsonValue] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise DescriptorError(
                json_pointer(path), f"object key {key!r} is {_type_name(key)}, not a string"
            )
        key = _check_text(key, path, key=True)
        out[key] = _normalise(item, (*path, key), depth + 1)
    return out


def _require_int(cd: Mapping[str, JsonValue], name: str) -> int:
    value = cd[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise DescriptorError(f"/{name}", f"must be an integer, not {_type_name(value)}")
    return value


def _require_str(cd: Mapping[str, JsonValue], name: str) -> str:
    value = cd[name]
    if not isinstance(value, str):
        raise DescriptorError(f"/{name}", f"must be a string, not {_type_name(value)}")
    return value


@attrs.frozen(init=False)
class CompatibilityDescriptor:
    """A validated Compatibility Descriptor (binding section 1).

    Build it with ``CompatibilityDescriptor(json_value)`` (the decoded JSON
    object, e.g. the manifest's ``"compat"``), :meth:`create` or
    :meth:`from_cd_bytes`; each validates. Two descriptors are equal exactly
    when their ``cd_bytes`` are.

    Attributes:
        model: ``model``.
        layers: ``layers`` (L; Group IDs 0..L-1).
        kv_heads: ``kv_heads``.
        head_dim: ``head_dim``.
        dtype: ``dtype``.
        block_tokens: ``block_tokens`` (B; tokens per block).
        tokenizer: ``tokenizer``, or ``None`` when absent.
        cd_bytes: the deterministic CBOR encoding of the whole CD.
        compat_id: the 16-octet Compatibility ID.
    """

    model: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: Dtype
    block_tokens: int
    tokenizer: str | None
    cd_bytes: bytes = attrs.field(repr=False)
    compat_id: bytes

    def __init__(self, compat: object) -> None:
        """Validate ``compat`` (a decoded JSON object) and encode it.

        Raises:
            DescriptorError: ``compat`` breaks a rule of binding section 1.
        """
        if not isinstance(compat, Mapping):
            raise DescriptorError("", f"must be a JSON object, not {_type_name(compat)}")
        cd = _normalise_object(compat, (), 0)
        for name in REQUIRED_MEMBERS:
            if name not in cd:
                raise DescriptorError(f"/{name}", "required member is missing")
        kvsp = _require_int(cd, "kvsp")
        if kvsp != KVSP_VERSION:
            raise DescriptorError("/kvsp", f"version {kvsp} is not supported (only {KVSP_VERSION})")
        model = _require_str(cd, "model")
        sizes = {}
        for name in _POSITIVE_INT_MEMBERS:
            value = _require_int(cd, name)
            if value < 1:
                raise DescriptorError(f"/{name}", f"must be >= 1, not {value}")
            sizes[name] = value
        dtype_name = _require_str(cd, "dtype")
        try:
            dtype = Dtype(dtype_name)
        except ValueError:
            allowed = ", ".join(d.value for d in Dtype)
            raise DescriptorError("/dtype", f"{dtype_name!r} is not one of {allowed}") from None
        tokenizer = _require_str(cd, "tokenizer") if "tokenizer" in cd else None
        if "extra" in cd and not isinstance(cd["extra"], dict):
            raise DescriptorError("/extra", f"must be an object, not {_type_name(cd['extra'])}")
        cd_bytes = cbor2.dumps(cd, canonical=True)
        self.__attrs_init__(
            model=model,
            layers=sizes["layers"],
            kv_heads=sizes["kv_heads"],
            head_dim=sizes["head_dim"],
            dtype=dtype,
            block_tokens=sizes["block_tokens"],
            tokenizer=tokenizer,
            cd_bytes=cd_bytes,
            compat_id=compatibility_id(cd_bytes),
        )

    @classmethod
    def create(
        cls,
        *,
        model: str,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: Dtype | str,
        block_tokens: int,
        tokenizer: str | None = None,
        extra: Mapping[str, Any] | None = None,
        **others: Any,
    ) -> CompatibilityDescriptor:
        """Build and validate a CD from its members (``kvsp`` is set to 0).

        ``tokenizer`` and ``extra`` are left out when ``None``; ``others`` are
        further members, which count towards the ID.
        """
        cd: dict[str, Any] = {
            **others,
            "kvsp": KVSP_VERSION,
            "model": model,
            "layers": layers,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "dtype": dtype,
            "block_tokens": block_tokens,
        }
        if tokenizer is not None:
            cd["tokenizer"] = tokenizer
        if extra is not None:
            cd["extra"] = extra
        return cls(cd)

    @classmethod
    def from_cd_bytes(cls, data: bytes) -> CompatibilityDescriptor:
        """Decode ``cd_bytes``; only the deterministic encoding of a valid CD is accepted.

        Raises:
            DescriptorError: not CBOR, not a valid CD, or not deterministically
                encoded (re-encoding gives other bytes).
        """
        try:
            value = cbor2.loads(data)
        except (cbor2.CBORDecodeError, ValueError, TypeError, RecursionError) as exc:
            raise DescriptorError("", f"is not valid CBOR ({exc})") from None
        cd = cls(value)
        if cd.cd_bytes != bytes(data):
            raise DescriptorError("", "is not in the deterministic CBOR encoding")
        return cd

    def to_json(self) -> dict[str, JsonValue]:
        """A fresh copy of the whole CD as a JSON-ready ``dict`` (all members)."""
        value: dict[str, JsonValue] = cbor2.loads(self.cd_bytes)
        return value

    @property
    def itemsize(self) -> int:
        """Octets per element of ``dtype``."""
        return ITEMSIZE[self.dtype]

    @property
    def section_shape(self) -> tuple[int, int, int]:
        """``(kv_heads, block_tokens, head_dim)``: the shape of a K or V section (section 5)."""
        return (self.kv_heads, self.block_tokens, self.head_dim)

    @property
    def section_size(self) -> int:
        """Octets in a K or V section: ``kv_heads * block_tokens * head_dim * itemsize``."""
        return self.kv_heads * self.block_tokens * self.head_dim * self.itemsize
