"""qlog files written by the QUIC stacks' own loggers (``qlog_dir``, ``--qlog-dir``).

In one process, for qh3 and aioquic: a relay (``serve_relay(qlog_dir=...)``) and a
client (``connect(qlog_dir=...)``) on 127.0.0.1; once the connection has ended,
each side's directory holds one file that parses as a JSON qlog whose single
trace has the right vantage point and events of the connection (packets sent
and received). The pquic stack and unusable directories are refused, the CLI
with its documented exit statuses (checked before any connection is made).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcs.transports.quic import asyncio_binding as b
from kvcs.transports.quic.config import quic_configuration
from kvcs.transports.quic.qlog import QLOG_SUFFIX, QlogUnsupported, qlog_logger
from kvcs.transports.quic.stack import load_stack
from kvcs.transports.quic.tls import TlsConfig, self_signed

ROOT = Path(__file__).resolve().parents[2]
WAIT = 20.0


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return self_signed(tmp_path_factory.mktemp("tls"))


def _qlogs(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{QLOG_SUFFIX}"))


async def _one_connection(stack: str, tls: TlsConfig, relay_dir: Path, client_dir: Path) -> None:
    async with b.serve_relay("127.0.0.1:0", tls=tls, stack=stack, qlog_dir=relay_dir) as server:
        async with b.connect(
            server.url,
            tls=TlsConfig(cafile=tls.cafile),
            stack=stack,
            timeout=WAIT,
            qlog_dir=client_dir,
        ) as client:
            assert client.connected
        # the client closed; the files come when each side's connection has ended
        # (after the closing and draining periods)
        deadline = time.monotonic() + WAIT
        while not (_qlogs(relay_dir) and _qlogs(client_dir)):
            assert time.monotonic() < deadline, "no qlog file within the deadline"
            await asyncio.sleep(0.05)


def _check_qlog(path: Path, vantage: str) -> dict[str, Any]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc["qlog_format"] == "JSON"
    assert doc["qlog_version"]
    (trace,) = doc["traces"]
    assert trace["vantage_point"]["type"] == vantage
    assert path.name == f"{trace['common_fields']['ODCID']}-{vantage}{QLOG_SUFFIX}"
    names = {e["name"] for e in trace["events"]}
    assert "transport:packet_sent" in names, sorted(names)
    assert "transport:packet_received" in names, sorted(names)
    return trace


@pytest.mark.parametrize("stack", ["qh3", "aioquic"])
def test_each_connection_writes_a_qlog_on_both_sides(
    stack: str, tls: TlsConfig, tmp_path: Path
) -> None:
    relay_dir, client_dir = tmp_path / "relay", tmp_path / "client" / "nested"
    asyncio.run(asyncio.wait_for(_one_connection(stack, tls, relay_dir, client_dir), 60))
    (server_file,) = _qlogs(relay_dir)
    (client_file,) = _qlogs(client_dir)
    server = _check_qlog(server_file, "server")
    client = _check_qlog(client_file, "client")
    # one connection seen from both ends: the same Original Destination Connection ID
    assert server["common_fields"]["ODCID"] == client["common_fields"]["ODCID"]
    assert not list(relay_dir.glob(".*"))  # no partial file left behind


def test_pquic_is_refused(tmp_path: Path) -> None:
    with pytest.raises(QlogUnsupported, match="pquic"):
        qlog_logger("pquic", tmp_path)


def test_a_file_in_place_of_the_directory_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        qlog_logger("qh3", blocker)


def _kvcs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcs", *args],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _one_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("kvcs: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("command", ["fetch", "publish"])
def test_cli_qlog_dir_on_pquic_is_a_usage_error(command: str, tmp_path: Path) -> None:
    # nothing listens on this port: the refusal comes before any connection
    got = _kvcs(
        command, "moqt://127.0.0.1:9", "--layers", "2", "--tokens", "16", "-k",
        "--stack", "pquic", "--qlog-dir", str(tmp_path / "q"),
    )  # fmt: skip
    assert got.returncode == 2, got.stderr
    assert "--qlog-dir is not supported on the pquic stack" in _one_error(got.stderr)


def test_cli_unusable_qlog_dir_is_a_file_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    got = _kvcs(
        "relay", "--listen", "127.0.0.1:0", "--self-signed", "--run-for", "1",
        "--qlog-dir", str(blocker / "sub"),
    )  # fmt: skip
    assert got.returncode == 5, got.stderr
    assert "--qlog-dir" in _one_error(got.stderr)


async def _refused_handshake(stack: str, tls: TlsConfig, relay_dir: Path) -> None:
    async with b.serve_relay(
        "127.0.0.1:0",
        tls=tls,
        stack=stack,
        max_connections=8,
        max_connections_per_address=1,
        qlog_dir=relay_dir,
    ) as server:
        trust = TlsConfig(cafile=tls.cafile)
        async with b.connect(server.url, tls=trust, stack=stack, timeout=WAIT):
            with pytest.raises(b.ConnectError, match="too many connections"):
                async with b.connect(server.url, tls=trust, stack=stack, timeout=WAIT):
                    pass
            # the refused attempt's trace is written at once, not held in memory; the
            # open connection's trace is the only one held
            (refused,) = _qlogs(relay_dir)
            trace = _check_qlog_events(refused, "server")
            assert any(e["name"] == "transport:packet_sent" for e in trace["events"])
            logger = server.driver.endpoint.configuration.quic_logger
            assert len(logger._traces) == 1


def _check_qlog_events(path: Path, vantage: str) -> dict[str, Any]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    (trace,) = doc["traces"]
    assert trace["vantage_point"]["type"] == vantage
    return dict(trace)


@pytest.mark.parametrize("stack", ["qh3", "aioquic"])
def test_a_refused_handshake_writes_its_qlog_at_once(
    stack: str, tls: TlsConfig, tmp_path: Path
) -> None:
    asyncio.run(asyncio.wait_for(_refused_handshake(stack, tls, tmp_path / "q"), 60))


@pytest.mark.parametrize("stack", ["qh3", "aioquic"])
def test_a_connection_that_has_not_ended_is_written_when_flushed(
    stack: str, tmp_path: Path
) -> None:
    """A process that stops while a connection is still closing (or was given up on)
    leaves its trace too: the endpoint's close flushes every trace that has not ended
    (``QuicEndpoint.flush_qlog``, called by the drivers' ``aclose``). Here a real client
    connection of the stack sends its Initial to a peer that never answers, so it never
    ends; nothing is written until the flush, which writes its packets."""
    st = load_stack(stack)
    logger = qlog_logger(stack, tmp_path)
    cfg = quic_configuration(st, is_client=True, tls=TlsConfig(verify=False), server_name="x")
    cfg.quic_logger = logger
    conn = st.connection(configuration=cfg)
    conn.connect(("127.0.0.1", 9), now=0.0)
    assert st.datagrams_to_send(conn, 0.0)  # the Initial, logged as packet_sent
    assert _qlogs(tmp_path) == []  # the connection has not ended: its trace is held
    assert logger.flush() == 1
    (path,) = _qlogs(tmp_path)
    trace = json.loads(path.read_text(encoding="utf-8"))["traces"][0]
    assert trace["vantage_point"]["type"] == "client"
    assert "transport:packet_sent" in {e["name"] for e in trace["events"]}
    assert logger.flush() == 0  # written once
