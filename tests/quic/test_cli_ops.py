"""What operators see from ``kvcs`` processes over real QUIC on 127.0.0.1.

``kvcs relay --json --metrics 127.0.0.1:<free port>``, ``kvcs publish --json`` and
``kvcs fetch --json`` each in its own process: the relay's ``/metrics`` is
scraped while the cache is being produced and after both clients left, and
checked against what the clients reported; the relay's ``stats`` and
``connection_ended`` lines, the clients' streamed ``progress`` lines (layers,
bytes, rate, time left) and their final lines; qlog files from the CLI; a
malformed ``--metrics`` (status 2) and one that cannot listen (status 3).
Every process is stopped by its PID (:class:`Procs`), every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from test_cli_processes import (
    BLOCKS,
    CACHE,
    RUN_TIMEOUT,
    START_TIMEOUT,
    Procs,
    assert_bit_identical,
    fetch_args,
    json_lines,
    kvcs,
    one_error_line,
    procs,  # noqa: F401  (the fixture)
    read_event,
    read_line,
)

LAYERS = 6
LAYER_BYTES = 2 * BLOCKS * 2 * 16 * 64 * 2  # K and V sections of one layer (bfloat16)


def _free_tcp_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _scrape_until(url: str, cond: Any, what: str, timeout: float = RUN_TIMEOUT) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    last: dict[str, float] = {}
    while time.monotonic() < deadline:
        try:
            last = _scrape(url)
        except (urllib.error.URLError, ConnectionError):
            last = {}
        if last and cond(last):
            return last
        time.sleep(0.1)
    raise AssertionError(f"no scrape showed {what} within {timeout} s: {last}")


def _check_progress(lines: list[dict[str, Any]], final: str) -> list[dict[str, Any]]:
    """The ``progress`` lines before the ``final`` event: layers and bytes never go
    back, the last one is complete, every key is there."""
    events = [line["event"] for line in lines]
    assert final in events, events
    progress = [line for line in lines[: events.index(final)] if line["event"] == "progress"]
    assert progress, lines
    keys = {"layers_done", "layers_total", "bytes", "bytes_total", "mb_per_s", "seconds", "eta_s"}
    for line in progress:
        assert keys <= set(line), line
        assert line["layers_total"] == LAYERS
    done = [line["layers_done"] for line in progress]
    got = [line["bytes"] for line in progress]
    assert done == sorted(done) and got == sorted(got), progress
    last = progress[-1]
    assert last["layers_done"] == LAYERS, progress
    assert last["bytes"] == last["bytes_total"] == LAYERS * LAYER_BYTES, last
    assert last["eta_s"] == 0.0 and last["mb_per_s"] > 0, last
    # at least one line per layer (each layer count is reported when it is reached)
    assert set(range(1, LAYERS + 1)) <= set(done), done
    return progress


def test_relay_metrics_stats_and_client_progress(procs: Procs, tmp_path: Path) -> None:  # noqa: F811
    mport = _free_tcp_port()
    relay, url, _ = procs.relay(
        "relay", "--metrics", f"127.0.0.1:{mport}", "--stats-interval", "0.5",
        "--qlog-dir", str(tmp_path / "qlog-relay"), verbose=True,
    )  # fmt: skip
    metrics = f"http://127.0.0.1:{mport}/metrics"
    idle = _scrape(metrics)
    assert idle["kvcs_relay_connections"] == 0
    pub = procs.start(
        "publisher", "publish", url, "-k", *CACHE, "--layer-interval", "0.25",
        "--wait-for-subscriber", "30", "--serve-for", "2", "--json",
        "--qlog-dir", str(tmp_path / "qlog-pub"),
    )  # fmt: skip
    fetch = procs.start("fetch", *fetch_args(url, "-k", "--qlog-dir", str(tmp_path / "qlog-fetch")))
    during = _scrape_until(
        metrics,
        lambda m: m["kvcs_relay_objects_received_total"] > 0 and m["kvcs_relay_connections"] == 2,
        "objects arriving with both clients connected",
    )
    assert fetch.poll() is None, "the scrape came after the transfer"  # mid-transfer
    assert during["kvcs_relay_sessions"] == 2
    assert during["kvcs_relay_subscriptions"] >= 1
    fetch_out = procs.finish(fetch)
    assert_bit_identical("fetch", fetch, fetch_out, procs)
    pub_out = procs.finish(pub)
    assert pub.returncode == 0, procs.stderr("publisher")
    fetched = json_lines(fetch_out)
    published = json_lines(pub_out)
    done = fetched[-1]
    assert done["event"] == "done"
    _check_progress(fetched, "done")
    pub_progress = _check_progress(published, "published")
    assert pub_progress[-1]["sent"] > LAYERS * LAYER_BYTES  # objects with their headers

    after = _scrape_until(
        metrics, lambda m: m["kvcs_relay_connections"] == 0, "both clients gone", 30
    )
    assert after["kvcs_relay_connections_accepted_total"] == 2
    assert after["kvcs_relay_connections_ended_total"] == 2
    assert after["kvcs_relay_sessions_total"] == 2
    assert after["kvcs_relay_sessions"] == 0
    assert after["kvcs_relay_bytes_received_total"] >= LAYERS * LAYER_BYTES
    assert after["kvcs_relay_objects_received_total"] >= 2 * LAYERS * BLOCKS
    assert after["kvcs_relay_bytes_sent_total"] >= done["bytes"] == LAYERS * LAYER_BYTES
    assert after["kvcs_relay_objects_sent_total"] >= 2 * LAYERS * BLOCKS
    assert after["kvcs_relay_cache_bytes"] >= LAYERS * LAYER_BYTES

    # the relay's lines so far, up to a 'stats' line written after both clients left
    relay_lines: list[dict[str, Any]] = []
    while not any(
        line["event"] == "stats" and line["connections"] == 0 and line["sessions_added"] == 2
        for line in relay_lines
    ):
        relay_lines.append(json.loads(read_line(relay, 10, "a 'stats' line")))
    # the -v count is logged once a second, apart from the 'stats' lines: wait for one
    # taken after both clients left before stopping the relay
    zero = re.compile(r"relay: 0 connections, \d+ tracks, cache \d+ bytes")
    deadline = time.monotonic() + 10
    while not zero.search(procs.stderr("relay")):
        assert time.monotonic() < deadline, procs.stderr("relay")
        time.sleep(0.1)
    os.kill(relay.pid, signal.SIGTERM)
    relay_lines += json_lines(procs.finish(relay, 30))
    assert relay.returncode == 0, procs.stderr("relay")
    stats = [line for line in relay_lines if line["event"] == "stats"]
    assert stats[-1]["bytes_in"] == after["kvcs_relay_bytes_received_total"]
    assert stats[-1]["objects_out"] == after["kvcs_relay_objects_sent_total"]
    assert [line["seconds"] for line in stats] == sorted(line["seconds"] for line in stats)
    ended = [line for line in relay_lines if line["event"] == "connection_ended"]
    assert len(ended) == 2, relay_lines
    for line in ended:
        assert line["connection"].startswith("server#") and line["upstream"] is False
        assert line["peer"].startswith("127.0.0.1:")
        assert line["ended_by"] and line["reason"], line  # who, and why
        # and at -v, the same in the log (stderr), once per connection
        logged = f"{line['connection']}: connection with {line['peer']} ended, {line['ended_by']}"
        assert procs.stderr("relay").count(logged) == 1, procs.stderr("relay")
    assert zero.search(procs.stderr("relay"))

    for name in ("qlog-relay", "qlog-pub", "qlog-fetch"):
        files = sorted((tmp_path / name).glob("*.qlog"))
        assert files, name
        for f in files:
            assert json.loads(f.read_text())["traces"][0]["events"], f


def test_a_malformed_metrics_address_is_a_usage_error() -> None:
    r = kvcs("relay", "--listen", "127.0.0.1:0", "--self-signed", "--metrics", "9464")
    assert r.returncode == 2, r.stderr
    assert "--metrics: not host:port" in one_error_line(r.stderr)


def test_a_metrics_address_in_use_is_a_network_error() -> None:
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = kvcs(
            "relay", "--listen", "127.0.0.1:0", "--self-signed", "--run-for", "5",
            "--metrics", f"127.0.0.1:{port}",
        )  # fmt: skip
    finally:
        busy.close()
    assert r.returncode == 3, r.stderr
    assert f"--metrics: cannot listen on 127.0.0.1:{port}" in one_error_line(r.stderr)


def test_relay_json_first_line_is_still_listening_with_the_metrics_url(procs: Procs) -> None:  # noqa: F811
    proc = procs.start(
        "relay", "relay", "--listen", "127.0.0.1:0", "--self-signed", "--json",
        "--metrics", "127.0.0.1:0", "--stats-interval", "0.2",
    )  # fmt: skip
    listening = read_event(proc, "listening", START_TIMEOUT)
    assert listening["metrics_url"].startswith("http://127.0.0.1:")
    assert _scrape(listening["metrics_url"])["kvcs_relay_tracks"] == 0
    stats = read_event(proc, "stats", START_TIMEOUT)
    assert stats["connections"] == 0 and stats["refused"] == {} and stats["upstream"] is None
