"""Cipher suites of MOQT Secure Objects, and their AEAD usage limits.

Theory of operation
-------------------
draft-ietf-moq-secure-objects section "Cipher Suites" names each suite by a
2-octet value and gives, per suite, the hash of the key derivation (``Nh``)
and the AEAD's key, nonce and tag sizes (``Nk``, ``Nn``, ``Nt``; ``Nka`` is the
AES key inside the 48-octet key of an AES-CTR-HMAC suite). kvcs supports:

* ``AES_128_GCM_SHA256_128`` (0x0004): the default (KVSP binding 8, and the
  draft's MUST);
* ``AES_256_GCM_SHA512_128`` (0x0005);
* ``AES_128_CTR_HMAC_SHA256_80`` (0x0001): the draft's SHOULD; an 80-bit tag.

*Limits.* The draft makes implementations count, per derived key, the
operations against the limits of draft-irtf-cfrg-aead-limits. kvcs targets an
attacker advantage of at most 2**-57 per key and counts *AES blocks*
(16 octets, plus one per message for the tag/counter block), so the limit
holds whatever the object sizes are:

* confidentiality: ``(q + v) * l`` blocks at most ``2**36`` for every suite
  (AES-GCM and AES-CTR both have an advantage of about ``(blocks)**2 / 2**129``
  for ``p = 2**-57``: ``sqrt(2**-57 * 2**129) = 2**36``). For the AES-GCM suites
  only encryptions count; for AES-CTR-HMAC every encryption and decryption
  counts (the draft's text for those suites);
* integrity (failed decryptions, i.e. forgery attempts): ``2**36`` for AES-GCM
  (``v * l <= 2**70`` with objects of at most ``2**34`` blocks), and
  ``2**23`` for the 80-bit tag of AES-CTR-HMAC (``v <= 2**-57 * 2**80``).

The numbers are the defaults of :class:`AeadLimits`; tests pass small ones.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

__all__ = [
    "DEFAULT_SUITE",
    "SUITE_NAMES",
    "AeadLimits",
    "CipherSuite",
    "SuiteParams",
    "suite_from_name",
    "suite_params",
]


class CipherSuite(enum.IntEnum):
    """The Secure Objects cipher suites kvcs implements (2-octet registry values)."""

    AES_128_CTR_HMAC_SHA256_80 = 0x0001
    AES_128_GCM_SHA256_128 = 0x0004
    AES_256_GCM_SHA512_128 = 0x0005


DEFAULT_SUITE: Final = CipherSuite.AES_128_GCM_SHA256_128
"""KVSP binding 8: the suite of a protected publication unless another is asked for."""

SUITE_NAMES: Final[dict[str, CipherSuite]] = {
    "aes128gcm": CipherSuite.AES_128_GCM_SHA256_128,
    "aes256gcm": CipherSuite.AES_256_GCM_SHA512_128,
    "aes128ctr-hmac": CipherSuite.AES_128_CTR_HMAC_SHA256_80,
}
"""The short names the command line uses (``--cipher-suite``)."""


@attrs.frozen
class AeadLimits:
    """Per-key usage limits (module docstring): AES blocks processed and failed decryptions."""

    confidentiality_blocks: int = 2**36
    integrity_failures: int = 2**36

    def __attrs_post_init__(self) -> None:
        if self.confidentiality_blocks < 1 or self.integrity_failures < 1:
            raise ValueError("AEAD limits must be positive")


@attrs.frozen
class SuiteParams:
    """The sizes and algorithms of one suite (the draft's registry table)."""

    suite: CipherSuite
    hash_name: str
    """``hashlib`` name of the HKDF hash (and of the HMAC of a CTR suite)."""
    nh: int
    nk: int
    nn: int
    nt: int
    nka: int | None
    """AES key octets inside the ``nk`` octets of a CTR-HMAC key; ``None`` for GCM."""
    limits: AeadLimits
    """The default limits of the suite."""
    decryptions_count: bool
    """Whether successful decryptions count against the confidentiality limit."""

    @property
    def base_key_len(self) -> int:
        """Octets of the ``track_base_key`` KVSP binding 8 derives for this suite."""
        return 32 if self.nh == 64 else 16


_PARAMS: Final[dict[CipherSuite, SuiteParams]] = {
    CipherSuite.AES_128_CTR_HMAC_SHA256_80: SuiteParams(
        CipherSuite.AES_128_CTR_HMAC_SHA256_80,
        "sha256",
        32,
        48,
        12,
        10,
        16,
        AeadLimits(confidentiality_blocks=2**36, integrity_failures=2**23),
        True,
    ),
    CipherSuite.AES_128_GCM_SHA256_128: SuiteParams(
        CipherSuite.AES_128_GCM_SHA256_128, "sha256", 32, 16, 12, 16, None, AeadLimits(), False
    ),
    CipherSuite.AES_256_GCM_SHA512_128: SuiteParams(
        CipherSuite.AES_256_GCM_SHA512_128, "sha512", 64, 32, 12, 16, None, AeadLimits(), False
    ),
}


def suite_params(suite: CipherSuite | int) -> SuiteParams:
    """The parameters of ``suite``.

    Raises:
        ValueError: a suite kvcs does not implement.
    """
    try:
        return _PARAMS[CipherSuite(suite)]
    except ValueError:
        raise ValueError(f"unsupported Secure Objects cipher suite {suite!r}") from None


def suite_from_name(name: str) -> CipherSuite:
    """``aes128gcm`` / ``aes256gcm`` / ``aes128ctr-hmac`` (or a registry name) to a suite.

    Raises:
        ValueError: an unknown name.
    """
    if name in SUITE_NAMES:
        return SUITE_NAMES[name]
    try:
        return CipherSuite[name]
    except KeyError:
        known = ", ".join(SUITE_NAMES)
        raise ValueError(f"unknown cipher suite {name!r} (one of {known})") from None
