"""aiomoqt's interop client (``python -m aiomoqt.tools.moq_interop_client``), every one
of its 14 test cases against our relay, one case per test and one fresh relay each:

    moq_interop_client -r moqt://127.0.0.1:PORT --tls-disable-verify --draft 22 -t CASE

A case passes when the client exits 0 with a TAP ``ok 1 - CASE`` line. The
results are recorded in tests/interop/README.md. A case our relay cannot pass
because of a documented unsupported feature is a strict xfail naming it.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from interop_harness import ROOT
from peerlib import PEERS_PY

CASES = [
    "setup-only",
    "announce-only",
    "publish-namespace-done",
    "subscribe-error",
    "rendezvous-timeout",
    "announce-subscribe",
    "subscribe-before-announce",
    "data-subgroup-basic",
    "namespace-discovery",
    "fetch",
    "join",
    "subscribe-namespace-lifecycle",
    "publish-track-only",
    "publish-track-subscribe",
]

UNSUPPORTED: dict[str, str] = {}
"""Cases our relay cannot pass because of a documented unsupported feature (none now:
RENDEZVOUS_TIMEOUT is supported, kvcs_core/relay/relay.py)."""


def test_the_client_lists_these_cases(peers: Any) -> None:
    """The installed client has exactly the 14 cases parametrized below."""
    r = subprocess.run(
        [str(PEERS_PY), "-m", "aiomoqt.tools.moq_interop_client", "-l"],
        capture_output=True, text=True, timeout=30, cwd=ROOT, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-500:]
    assert r.stdout.split() == CASES


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(reason=UNSUPPORTED[c], strict=True))
        if c in UNSUPPORTED
        else c
        for c in CASES
    ],
)
def test_aiomoqt_interop_client_case(peers: Any, our_relay: Any, case: str) -> None:
    argv = [
        str(PEERS_PY), "-m", "aiomoqt.tools.moq_interop_client", "-r", our_relay.url,
        "--tls-disable-verify", "--draft", "22", "-t", case,
    ]  # fmt: skip
    try:
        r = subprocess.run(
            argv, capture_output=True, text=True, timeout=40, cwd=ROOT, check=False
        )
    except subprocess.TimeoutExpired as exc:  # run() killed it (by PID)
        pytest.fail(f"{case}: no verdict within 40 s: {exc.stdout!r}")
    lines = r.stdout.splitlines()
    verdict = [ln for ln in lines if ln.startswith(("ok ", "not ok "))]
    detail = [ln.strip() for ln in lines if ln.strip().startswith(("message:", "expected:"))]
    assert r.returncode == 0 and verdict == [f"ok 1 - {case}"], (
        f"{case}: exit {r.returncode}, {verdict} {detail} {r.stderr[-400:]}"
    )
    our_relay.check()
