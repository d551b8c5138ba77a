"""Over WebTransport, AUTHORITY and PATH must not be used (wire reference 3.1, setup options)."""

from __future__ import annotations

import pytest
from session_pair import Pair

from kvcs.transports.loopback import Network
from kvcs_core.moqt import events as ev
from kvcs_core.moqt.config import Role, SessionConfig
from kvcs_core.moqt.session import MoqtSession
from kvcs_core.wire.codes import SessionErrorCode


@pytest.mark.parametrize(
    ("option", "code"),
    [
        ({"path": b"/moq"}, SessionErrorCode.INVALID_PATH),
        ({"authority": b"relay.example:443"}, SessionErrorCode.INVALID_AUTHORITY),
    ],
)
def test_server_over_webtransport_refuses_path_and_authority(
    option: dict[str, bytes], code: SessionErrorCode
) -> None:
    net = Network()
    cli = MoqtSession(SessionConfig(role=Role.CLIENT, **option))  # a native-QUIC client
    srv = MoqtSession(SessionConfig(role=Role.SERVER, webtransport=True))
    net.connect(cli, srv, latency=0.01)
    cli.start(now=0.0)
    srv.start(now=0.0)
    net.run_for(0.5)
    closed = [e for e in net.events(srv) if isinstance(e, ev.SessionClosed)]
    assert [c.code for c in closed] == [code]
    assert [e.code for e in net.events(cli) if isinstance(e, ev.SessionClosed)] == [code]


def test_client_over_webtransport_sends_neither() -> None:
    pair = Pair(
        client_config=SessionConfig(
            role=Role.CLIENT, path=b"/moq", authority=b"h:1", webtransport=True
        ),
        server_config=SessionConfig(role=Role.SERVER, webtransport=True),
    )
    setup = pair.srv.peer_setup
    assert setup is not None and setup.path is None and setup.authority is None
    assert pair.events(pair.srv, ev.SetupCompleted)
