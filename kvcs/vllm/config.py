"""``kv_connector_extra_config`` of the vLLM connector, parsed into typed settings.

Theory of operation
-------------------
vLLM hands every connector the JSON object of ``--kv-transfer-config``; its
``kv_role`` says what this engine does and its ``kv_connector_extra_config``
holds the connector's own keys. :func:`parse_settings` turns both into one
frozen :class:`ConnectorSettings` (or raises :class:`ConnectorConfigError` with a
one-line message naming the key), so every later step works on checked values:

* ``kv_role`` -> :class:`Role`: ``kv_producer`` publishes (prefill engines),
  ``kv_consumer`` loads (decode engines), ``kv_both`` does both;
* the relay URL, the scope key (hex or a file), TLS trust, the relay's CAT token,
  the manifest signing key (producer) and the trusted producer keys (consumer),
  Secure Objects encryption, the descriptor's model name and revision, the bounds
  of the lookup and of each layer's load, the QUIC stack, and an optional
  JSON-lines event log.

Files named here (keys, certificates, tokens) are read once, at parsing; a file
that cannot be read or parsed is a :class:`ConnectorConfigError` too. No vLLM
import: this module is tested on plain dictionaries.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs
from cryptography.hazmat.primitives import serialization

from kvcs.transports.quic.config import UrlError, parse_url
from kvcs.transports.quic.stack import DEFAULT_STACK, STACKS
from kvcs.transports.quic.tls import TlsConfig
from kvcs_core.kvcs.cose import VerificationKey
from kvcs_core.kvcs.publisher import ManifestSigner

__all__ = ["KEYS", "ConnectorConfigError", "ConnectorSettings", "Role", "parse_settings"]


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` (or ``kv_role``) the connector cannot use."""


class Role(enum.IntEnum):
    """What an engine does with caches (from vLLM's ``kv_role``)."""

    PRODUCER = 1
    """``kv_producer``: publish each prompt's full blocks as prefill computes them."""
    CONSUMER = 2
    """``kv_consumer``: load published prefixes instead of computing them."""
    BOTH = 3
    """``kv_both``: load what is published, publish what was computed."""

    @property
    def publishes(self) -> bool:
        return self in (Role.PRODUCER, Role.BOTH)

    @property
    def loads(self) -> bool:
        return self in (Role.CONSUMER, Role.BOTH)


_ROLES: Final = {"kv_producer": Role.PRODUCER, "kv_consumer": Role.CONSUMER, "kv_both": Role.BOTH}

KEYS: Final = (
    "relay",
    "scope_key",
    "scope_key_file",
    "ca",
    "insecure",
    "token",
    "token_file",
    "sign_key",
    "producer_key",
    "key_id",
    "encrypt",
    "model_id",
    "revision",
    "lookup_timeout",
    "lookup_quiet",
    "load_timeout",
    "recovery_time",
    "connect_timeout",
    "stack",
    "event_log",
)
"""Every key ``kv_connector_extra_config`` may hold; any other is refused (a typo
must not silently leave a default in force)."""


@attrs.frozen(kw_only=True)
class ConnectorSettings:
    """Checked connector settings (see the README section "vLLM connector")."""

    role: Role
    relay: str
    scope_key: bytes = attrs.field(repr=False)
    tls: TlsConfig
    token: str | None = attrs.field(default=None, repr=False)
    signer: ManifestSigner | None = attrs.field(default=None, repr=False)
    producer_keys: Mapping[bytes, VerificationKey] | None = attrs.field(default=None, repr=False)
    encrypt: bool = False
    model_id: str | None = None
    revision: str | None = None
    lookup_timeout: float = 5.0
    lookup_quiet: float = 0.25
    load_timeout: float = 30.0
    recovery_time: float = 1.0
    connect_timeout: float = 10.0
    stack: str = DEFAULT_STACK
    event_log: Path | None = None


def _read(path: Any, key: str) -> bytes:
    if not isinstance(path, str) or not path:
        raise ConnectorConfigError(f"{key}: a file path (string) is needed, not {path!r}")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConnectorConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None


def _scope_key(extra: Mapping[str, Any]) -> bytes:
    text, path = extra.get("scope_key"), extra.get("scope_key_file")
    if text is not None and path is not None:
        raise ConnectorConfigError("give scope_key or scope_key_file, not both")
    if text is None and path is None:
        raise ConnectorConfigError("scope_key (64 hex digits) or scope_key_file is required")
    if path is not None:
        raw = _read(path, "scope_key_file")
        try:
            key = bytes.fromhex(raw.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            key = raw
    else:
        if not isinstance(text, str):
            raise ConnectorConfigError("scope_key: a hex string is needed")
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ConnectorConfigError("scope_key: not hex") from None
    if len(key) != 32:
        raise ConnectorConfigError(f"the scope key must be 32 octets, not {len(key)}")
    return key


def _flag(extra: Mapping[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ConnectorConfigError(f"{key}: true or false, not {value!r}")
    return value


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConnectorConfigError(f"{key}: a number of seconds, not {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConnectorConfigError(f"{key}: must be a positive number of seconds, not {value}")
    return float(value)


def _text(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConnectorConfigError(f"{key}: a non-empty string, not {value!r}")
    return value


def _token(extra: Mapping[str, Any]) -> str | None:
    text, path = _text(extra, "token"), extra.get("token_file")
    if text is not None and path is not None:
        raise ConnectorConfigError("give token or token_file, not both")
    if path is not None:
        try:
            return _read(path, "token_file").decode("ascii").strip()
        except UnicodeDecodeError:
            raise ConnectorConfigError("token_file: not ASCII text") from None
    return text


def _keys(extra: Mapping[str, Any], role: Role) -> tuple[ManifestSigner | None, Any]:
    kid = (_text(extra, "key_id") or "producer").encode()
    signer = None
    if (path := extra.get("sign_key")) is not None:
        if not role.publishes:
            raise ConnectorConfigError("sign_key is for kv_producer and kv_both engines")
        try:
            key = serialization.load_pem_private_key(_read(path, "sign_key"), password=None)
            signer = ManifestSigner(key, kid)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise ConnectorConfigError(f"sign_key: not a usable private key ({exc})") from None
    keys = None
    if (path := extra.get("producer_key")) is not None:
        if not role.loads:
            raise ConnectorConfigError("producer_key is for kv_consumer and kv_both engines")
        try:
            public = serialization.load_pem_public_key(_read(path, "producer_key"))
        except ValueError as exc:
            raise ConnectorConfigError(f"producer_key: not a public key ({exc})") from None
        keys = {kid: public}
    return signer, keys


def parse_settings(kv_role: str | None, extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """The settings of ``kv_role`` and ``kv_connector_extra_config``.

    Raises:
        ConnectorConfigError: an unknown role or key, a missing relay or scope key, a
            value of the wrong type or range, a file that cannot be read or parsed.
    """
    if kv_role not in _ROLES:
        raise ConnectorConfigError(
            f"kv_role must be one of {', '.join(_ROLES)}, not {kv_role!r}"
        )
    role = _ROLES[kv_role]
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ConnectorConfigError(
            f"unknown kv_connector_extra_config key(s): {', '.join(unknown)} "
            f"(known: {', '.join(KEYS)})"
        )
    relay = _text(extra, "relay")
    if relay is None:
        raise ConnectorConfigError("relay (a moqt:// or https:// URL) is required")
    try:
        parse_url(relay)
    except UrlError as exc:
        raise ConnectorConfigError(f"relay: {exc}") from None
    ca = _text(extra, "ca")
    if ca is not None and not Path(ca).is_file():
        raise ConnectorConfigError(f"ca: file not found: {ca}")
    tls = TlsConfig(cafile=ca, verify=not _flag(extra, "insecure"))
    signer, keys = _keys(extra, role)
    stack = _text(extra, "stack") or DEFAULT_STACK
    if stack not in STACKS:
        raise ConnectorConfigError(f"stack: one of {', '.join(STACKS)}, not {stack!r}")
    log = _text(extra, "event_log")
    return ConnectorSettings(
        role=role,
        relay=relay,
        scope_key=_scope_key(extra),
        tls=tls,
        token=_token(extra),
        signer=signer,
        producer_keys=keys,
        encrypt=_flag(extra, "encrypt"),
        model_id=_text(extra, "model_id"),
        revision=_text(extra, "revision"),
        lookup_timeout=_seconds(extra, "lookup_timeout", 5.0),
        lookup_quiet=_seconds(extra, "lookup_quiet", 0.25),
        load_timeout=_seconds(extra, "load_timeout", 30.0),
        recovery_time=_seconds(extra, "recovery_time", 1.0),
        connect_timeout=_seconds(extra, "connect_timeout", 10.0),
        stack=stack,
        event_log=None if log is None else Path(log),
    )
