"""Building endpoints for relays and clients: shared by the asyncio and trio bindings.

``qlog_dir`` (relays and clients): every QUIC connection of the endpoint writes a qlog
file there when it ends (:mod:`.qlog`); the per-connection configurations of clients
(and of a relay's upstream link) take the endpoint's logger.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from kvcs_core.auth.cat import CAT_TOKEN_TYPE, token_from_text
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.relay.config import RelayConfig
from kvcs_core.relay.relay import Relay

from .apps import ClientApp, RelayApp
from .config import (
    DEFAULT_IDLE_TIMEOUT,
    MAX_DATA,
    RELAY_MAX_DATA,
    MoqtUrl,
    parse_url,
    quic_configuration,
)
from .endpoint import DEFAULT_MAX_PER_ADDRESS, QuicEndpoint
from .qlog import qlog_logger
from .stack import load_stack
from .tls import TlsConfig


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_session_config(url: MoqtUrl, token: bytes | None = None) -> SessionConfig:
    """A client session naming the server's authority and path (wire reference 3.1);
    over WebTransport neither (they travel in the CONNECT request instead). ``token``:
    a CAT sent in CLIENT_SETUP (USE_VALUE, Token Type 0x01; README "Authorization")."""
    tokens = () if token is None else ((CAT_TOKEN_TYPE, token),)
    if url.webtransport:
        return SessionConfig(role=Role.CLIENT, webtransport=True, setup_tokens=tokens)
    return SessionConfig(
        role=Role.CLIENT,
        authority=url.authority.encode(),
        path=url.path.encode() if url.path else None,
        setup_tokens=tokens,
    )


def token_bytes(token: bytes | str | None) -> bytes | None:
    """A token given as octets or as its base64url text (``kvcs token issue`` prints it);
    ``ValueError`` for text that is not base64url or an empty token."""
    if token is None:
        return None
    if isinstance(token, str):
        return token_from_text(token)
    if not token:
        raise ValueError("empty token")
    return bytes(token)


def relay_endpoint(
    *,
    tls: TlsConfig,
    stack: str,
    relay_config: RelayConfig | None,
    max_datagram_size: int | None,
    max_connections: int,
    webtransport: bool = True,
    max_connections_per_address: int = DEFAULT_MAX_PER_ADDRESS,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    qlog_dir: str | os.PathLike[str] | None = None,
) -> QuicEndpoint:
    logger = None if qlog_dir is None else qlog_logger(stack, qlog_dir)
    st = load_stack(stack)
    webtransport = webtransport and st.h3_connection is not None
    cfg = quic_configuration(
        st,
        is_client=False,
        tls=tls,
        max_datagram_size=max_datagram_size,
        webtransport=webtransport,
        idle_timeout=idle_timeout,
        max_data=RELAY_MAX_DATA if st.hold_input is not None else MAX_DATA,
    )
    if logger is not None:
        cfg.quic_logger = logger
    return (st.endpoint or QuicEndpoint)(
        st,
        cfg,
        RelayApp(Relay(relay_config)),
        max_connections=max_connections,
        max_connections_per_address=max_connections_per_address,
        webtransport=webtransport,
    )


def client_endpoint(
    *,
    stack: str,
    app: ClientApp | None = None,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    qlog_dir: str | os.PathLike[str] | None = None,
) -> QuicEndpoint:
    logger = None if qlog_dir is None else qlog_logger(stack, qlog_dir)
    st = load_stack(stack)
    cfg = quic_configuration(
        st, is_client=True, tls=TlsConfig(verify=False), idle_timeout=idle_timeout
    )
    if logger is not None:
        cfg.quic_logger = logger
    endpoint: QuicEndpoint = (st.endpoint or QuicEndpoint)(st, cfg, app or ClientApp())
    return endpoint


def client_configuration(
    endpoint: QuicEndpoint,
    url: MoqtUrl,
    tls: TlsConfig | None,
    max_datagram_size: int | None,
    *,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
) -> Any:
    cfg = quic_configuration(
        endpoint.stack,
        is_client=True,
        tls=tls or TlsConfig(),
        server_name=url.host,
        max_datagram_size=max_datagram_size,
        webtransport=url.webtransport,
        idle_timeout=idle_timeout,
        # a relay's upstream connections get its window too (config.RELAY_MAX_DATA)
        max_data=int(getattr(endpoint.configuration, "max_data", MAX_DATA)),
    )
    logger = getattr(endpoint.configuration, "quic_logger", None)
    if logger is not None:  # the endpoint's qlog directory (module docstring)
        cfg.quic_logger = logger
    return cfg


__all__ = [
    "client_configuration",
    "client_endpoint",
    "client_session_config",
    "is_loopback",
    "parse_url",
    "relay_endpoint",
    "token_bytes",
]
