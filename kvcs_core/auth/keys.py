"""Issuer keys for CAT tokens, and their JSON key-file format.

Theory of operation
-------------------
A relay trusts a set of *issuer keys*; a token names its key with the COSE
``kid`` header and is accepted only if that key verifies it (:mod:`.cat`).
Three algorithms (RFC 9053 identifiers), the ones CAT (CTA-5007) and the
CAT-4-MOQT test vectors use:

* ``EdDSA`` (-8) with Ed25519, COSE_Sign1;
* ``ES256`` (-7) with P-256, COSE_Sign1;
* ``HMAC256`` (5, "HMAC 256/256"), COSE_Mac0, a shared secret of 32 octets.

Key file (JSON, UTF-8), read by ``kvcs token`` and ``kvcs relay --auth-keys``;
written by ``kvcs token keygen``::

    {"keys": [{"kid": "issuer-1", "alg": "EdDSA", "x": "<hex>", "d": "<hex>",
               "iss": "https://issuer.example"}]}

``kid`` (text, the COSE kid is its UTF-8 octets) and ``alg`` are required.
EdDSA: ``x`` = 32-octet public key; ES256: ``x`` and ``y`` = 32-octet
coordinates; HMAC256: ``k`` = the 32-octet secret. ``d`` (the private scalar /
seed, 32 octets) only in a *private* key file, for issuing. ``iss``, optional:
a token verified by this key must carry exactly this issuer. A single key
object without the ``keys`` list is accepted too. Parsing is pure: the
transports read the file and pass the text (:func:`parse_key_file`).
"""

from __future__ import annotations

import enum
import json
from typing import Any, Final

import attrs
from pycose.keys.curves import P256, Ed25519
from pycose.keys.ec2 import EC2Key
from pycose.keys.okp import OKPKey
from pycose.keys.symmetric import SymmetricKey

MAX_KEYS: Final = 1024
"""Keys in one key file at most."""
HMAC_KEY_LEN: Final = 32


class KeyFileError(ValueError):
    """A key file that does not follow the format of the module docstring."""


class TokenAlg(enum.IntEnum):
    """COSE algorithms accepted for tokens (RFC 9053 identifiers)."""

    ES256 = -7
    EDDSA = -8
    HMAC256 = 5


_ALG_NAMES: Final = {"ES256": TokenAlg.ES256, "EdDSA": TokenAlg.EDDSA, "HMAC256": TokenAlg.HMAC256}
ALG_NAME: Final = {v: k for k, v in _ALG_NAMES.items()}


@attrs.frozen
class IssuerKey:
    """One issuer key: what verifies (and, with the private part, issues) tokens."""

    kid: bytes
    alg: TokenAlg
    x: bytes = b""
    """EdDSA public key, or ES256 x coordinate."""
    y: bytes = b""
    """ES256 y coordinate."""
    d: bytes = attrs.field(default=b"", repr=False)
    """Private part (EdDSA seed, ES256 scalar); empty for a public key."""
    k: bytes = attrs.field(default=b"", repr=False)
    """HMAC256 secret."""
    issuer: str | None = None
    """Tokens verified by this key must carry exactly this ``iss`` (``None``: any)."""

    def __attrs_post_init__(self) -> None:
        if not self.kid:
            raise KeyFileError("kid must not be empty")
        sizes: dict[TokenAlg, tuple[str, ...]] = {
            TokenAlg.EDDSA: ("x",),
            TokenAlg.ES256: ("x", "y"),
            TokenAlg.HMAC256: ("k",),
        }
        for name in sizes[self.alg]:
            if len(getattr(self, name)) != 32:
                raise KeyFileError(f"{ALG_NAME[self.alg]} key {name!r} must be 32 octets")
        if self.d and len(self.d) != 32:
            raise KeyFileError("'d' must be 32 octets")

    @property
    def can_issue(self) -> bool:
        return self.alg is TokenAlg.HMAC256 or bool(self.d)

    def public(self) -> IssuerKey:
        """The key without its private part (HMAC keys are secrets either way)."""
        return attrs.evolve(self, d=b"")

    def cose_key(self) -> EC2Key | OKPKey | SymmetricKey:
        """The pycose form of this key."""
        if self.alg is TokenAlg.HMAC256:
            return SymmetricKey(k=self.k)
        if self.alg is TokenAlg.EDDSA:
            return (
                OKPKey(crv=Ed25519, x=self.x, d=self.d) if self.d else OKPKey(crv=Ed25519, x=self.x)
            )
        if self.d:
            return EC2Key(crv=P256, x=self.x, y=self.y, d=self.d)
        return EC2Key(crv=P256, x=self.x, y=self.y)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kid": self.kid.decode("utf-8", "replace"),
            "alg": ALG_NAME[self.alg],
        }
        for name in ("x", "y", "d", "k"):
            v = getattr(self, name)
            if v:
                out[name] = v.hex()
        if self.issuer is not None:
            out["iss"] = self.issuer
        return out


def _hex(obj: dict[str, Any], name: str) -> bytes:
    v = obj.get(name)
    if v is None:
        return b""
    if not isinstance(v, str):
        raise KeyFileError(f"{name!r} must be a hex string")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise KeyFileError(f"{name!r} is not hex") from None


def _key(obj: Any) -> IssuerKey:
    if not isinstance(obj, dict):
        raise KeyFileError("a key is a JSON object")
    kid, alg, iss = obj.get("kid"), obj.get("alg"), obj.get("iss")
    if not isinstance(kid, str) or not kid:
        raise KeyFileError("'kid' must be non-empty text")
    if alg not in _ALG_NAMES:
        raise KeyFileError(f"'alg' must be one of {', '.join(_ALG_NAMES)}")
    if iss is not None and not isinstance(iss, str):
        raise KeyFileError("'iss' must be text")
    return IssuerKey(
        kid=kid.encode(),
        alg=_ALG_NAMES[alg],
        x=_hex(obj, "x"),
        y=_hex(obj, "y"),
        d=_hex(obj, "d"),
        k=_hex(obj, "k"),
        issuer=iss,
    )


def parse_key_file(text: str) -> tuple[IssuerKey, ...]:
    """The keys of a key file (module docstring); :class:`KeyFileError` if malformed."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise KeyFileError(f"not JSON: {e}") from None
    items = doc.get("keys") if isinstance(doc, dict) and "keys" in doc else [doc]
    if not isinstance(items, list) or not items:
        raise KeyFileError("'keys' must be a non-empty list")
    if len(items) > MAX_KEYS:
        raise KeyFileError(f"more than {MAX_KEYS} keys")
    keys = tuple(_key(o) for o in items)
    kids = [k.kid for k in keys]
    if len(set(kids)) != len(kids):
        raise KeyFileError("two keys share a kid")
    return keys


def key_file_text(keys: tuple[IssuerKey, ...]) -> str:
    """The key-file JSON for ``keys`` (what :func:`parse_key_file` reads)."""
    return json.dumps({"keys": [k.to_json() for k in keys]}, indent=2) + "\n"


__all__ = [
    "ALG_NAME",
    "IssuerKey",
    "KeyFileError",
    "TokenAlg",
    "key_file_text",
    "parse_key_file",
]
