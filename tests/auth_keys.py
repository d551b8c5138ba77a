"""Issuer keys and tokens for the authorization tests (made fresh, never fixed bytes)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from kvcs_core.auth import IssuerKey, MoqtAction, MoqtClaim, TokenAlg, issue_token
from kvcs_core.auth.scope import prefix_scope

ALL_ACTIONS = tuple(MoqtAction)
SCOPE_A = bytes(range(16))
SCOPE_B = bytes(range(16, 32))


def ed25519_key(kid: bytes = b"issuer-1", issuer: str | None = None) -> IssuerKey:
    sk = ed25519.Ed25519PrivateKey.generate()
    return IssuerKey(
        kid=kid,
        alg=TokenAlg.EDDSA,
        x=sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
        d=sk.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
        issuer=issuer,
    )


def es256_key(kid: bytes = b"issuer-es") -> IssuerKey:
    n = ec.generate_private_key(ec.SECP256R1()).private_numbers()
    return IssuerKey(
        kid=kid,
        alg=TokenAlg.ES256,
        x=n.public_numbers.x.to_bytes(32, "big"),
        y=n.public_numbers.y.to_bytes(32, "big"),
        d=n.private_value.to_bytes(32, "big"),
    )


def hmac_key(kid: bytes = b"issuer-mac", secret: bytes = bytes(range(32))) -> IssuerKey:
    return IssuerKey(kid=kid, alg=TokenAlg.HMAC256, k=secret)


def claim(
    namespace: Sequence[bytes] | None, actions: Iterable[MoqtAction] = ALL_ACTIONS
) -> MoqtClaim:
    return MoqtClaim((prefix_scope(actions, namespace),))


def scope_token(
    key: IssuerKey,
    scope_id: bytes,
    *,
    now: float,
    expires_in: float = 3600.0,
    actions: Iterable[MoqtAction] = ALL_ACTIONS,
) -> bytes:
    """A token for every action under ``("kvcs-1", scope_id)``."""
    return issue_token(key, claim((b"kvcs-1", scope_id), actions), now=now, expires_in=expires_in)
