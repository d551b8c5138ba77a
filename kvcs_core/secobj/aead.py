"""The AEAD of each Secure Objects cipher suite (seal and open of one message).

Theory of operation
-------------------
* AES-GCM suites (0x0004, 0x0005): ``cryptography``'s AESGCM with the 16-octet
  tag appended to the ciphertext (RFC 5116 convention, as the draft says).
* AES-CTR-HMAC suites (0x0001; RFC 9605 section 4.5.1, the compound AEAD the
  draft points to): the ``Nk = 48`` octet key is the AES-128 key (``Nka`` = 16
  octets) followed by the HMAC-SHA256 key; the keystream is AES-CTR from the
  counter block ``nonce || 00000000``; the tag is HMAC-SHA256 over
  ``aad || nonce || ct``, truncated to ``Nt`` octets and appended. Open checks
  the tag in constant time before decrypting anything.

  The tag input is what the draft's test vectors give (checked in
  ``tests/test_secure_objects_vectors.py``, suites 0x0001 and 0x0002): RFC 9605
  additionally prefixes three u64 lengths, which the draft's reference
  implementation does not; kvcs follows the draft's vectors.

:class:`Aead` is built once per derived key (the cipher's key schedule is
done once) and is stateless afterwards; counting uses against the limits is
the keyring's job (``objects.py``).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvcs_core.secobj.suites import SuiteParams

__all__ = ["Aead", "AuthenticationFailed"]

Chunk = bytes | bytearray | memoryview


class AuthenticationFailed(Exception):
    """The tag did not verify (tampered ciphertext or AAD, wrong key or nonce)."""


class Aead:
    """Seal and open with one key of one suite."""

    __slots__ = ("_auth_key", "_enc_key", "_gcm", "_nt")

    def __init__(self, params: SuiteParams, key: bytes) -> None:
        if len(key) != params.nk:
            raise ValueError(f"a {params.suite.name} key is {params.nk} octets, not {len(key)}")
        self._nt = params.nt
        self._gcm: AESGCM | None = None
        self._enc_key = b""
        self._auth_key = b""
        if params.nka is None:
            self._gcm = AESGCM(key)
        else:
            self._enc_key = key[: params.nka]
            self._auth_key = key[params.nka :]

    def seal(self, nonce: bytes, aad: bytes, parts: Sequence[Chunk]) -> bytes:
        """Encrypt the concatenation of ``parts``; returns ``ciphertext || tag``."""
        if self._gcm is not None:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            return self._gcm.encrypt(nonce, data, aad)
        enc = Cipher(algorithms.AES(self._enc_key), modes.CTR(nonce + b"\0\0\0\0")).encryptor()
        size = sum(len(memoryview(p).cast("B")) for p in parts)
        out = bytearray(size + self._nt)
        view = memoryview(out)
        pos = 0
        for p in parts:
            chunk = enc.update(p)
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        enc.finalize()  # CTR keeps no partial block: nothing is left
        view[size:] = self._tag(nonce, aad, view[:size])
        return bytes(out)

    def open(self, nonce: bytes, aad: bytes, sealed: Chunk) -> bytes:
        """Decrypt ``ciphertext || tag``.

        Raises:
            AuthenticationFailed: the tag does not verify (or the input is shorter
                than a tag).
        """
        if len(sealed) < self._nt:
            raise AuthenticationFailed("shorter than the tag")
        if self._gcm is not None:
            try:
                return self._gcm.decrypt(nonce, sealed, aad)
            except InvalidTag:
                raise AuthenticationFailed("AES-GCM tag mismatch") from None
        view = memoryview(sealed).cast("B")
        ct, tag = view[: len(view) - self._nt], view[len(view) - self._nt :]
        if not hmac.compare_digest(self._tag(nonce, aad, ct), tag):
            raise AuthenticationFailed("HMAC tag mismatch")
        dec = Cipher(algorithms.AES(self._enc_key), modes.CTR(nonce + b"\0\0\0\0")).decryptor()
        return dec.update(ct) + dec.finalize()

    def _tag(self, nonce: bytes, aad: bytes, ct: Chunk) -> bytes:
        mac = hmac.new(self._auth_key, digestmod="sha256")
        mac.update(aad)
        mac.update(nonce)
        mac.update(ct)
        return mac.digest()[: self._nt]
