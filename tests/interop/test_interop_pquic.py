"""kvcs on the pquic stack (aiopquic) with aiomoqt (also aiopquic), both ways, draft 22.

* their clients, our relay: aiomoqt's publisher and subscriber through
  ``kvcs relay --stack pquic`` (SETUP, PUBLISH_NAMESPACE, SUBSCRIBE, 12 objects
  byte-exact, PUBLISH_DONE), and an aiomoqt FETCH served from that relay's cache;
* our clients, their relay: ``kvcs publish --stack pquic`` and ``kvcs fetch
  --stack pquic`` on either side of aiomoqt's interop relay, a whole KVCS
  publication (12 MiB) verified bit for bit (the late-consumer scenario of
  test_interop_kvcs_via_aiomoqt.py).

aiopquic has wheels for Python >= 3.12 only: on 3.11 these skip with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from interop_harness import ns_args, proc_event, proc_exit, run, shape_args, summary
from test_interop_kvcs_via_aiomoqt import CACHE, check_done

try:
    import aiopquic  # noqa: F401

    HAVE_PQUIC = True
except ImportError:
    HAVE_PQUIC = False

pytestmark = pytest.mark.skipif(
    not HAVE_PQUIC,
    reason="aiopquic is not importable (wheels for Python >= 3.12 only: pip install 'kvcs[pquic]')",
)

NS = ns_args(["kvcs", "hex:00ff10"])
SHAPE = shape_args()  # 3 groups x 4 objects x 300 bytes


def finish(proc: Any, timeout: float = 20) -> None:
    rc = proc.finish(timeout)
    assert rc == 0, f"{proc.name} exited {rc}: {summary(proc)}"


def test_aiomoqt_publish_subscribe_fetch_through_kvcs_relay_on_pquic(peers: Any) -> None:
    relay, url = peers.our_relay_cli("--stack", "pquic")
    pub = peers.run(
        "pub", "aiomoqt_pub.py", "--url", url, *NS, *SHAPE, "--linger", "4", "--timeout", "15"
    )
    assert pub.wait_event("publish_namespace_ok", 10), summary(pub)
    sub = peers.run("sub", "aiomoqt_sub.py", "--url", url, *NS, *SHAPE, "--timeout", "10")
    finish(sub)
    assert sub.wait_event("setup", 0)["alpn"] == "moqt-22"
    done = sub.last("publish_done")
    assert done is not None and done["status"] == 2 and done["stream_count"] == 3, done
    assert sub.last("summary")["unique"] == 12
    fetch = peers.run(
        "fetch", "aiomoqt_sub.py", "--url", url, *NS, *SHAPE, "--fetch", "0:0:2", "--timeout", "8"
    )
    finish(fetch)
    ok = fetch.last("fetch_ok")
    assert ok is not None and ok["end"] == [2, 3], ok
    assert fetch.last("summary")["unique"] == 12
    assert pub.last("fetch") is None, "served from the cache, not fetched upstream"
    finish(pub)
    assert relay.p.poll() is None, "our relay kept running"


def test_kvcs_on_pquic_through_aiomoqt_relay(peers: Any, tmp_path: Path) -> None:
    url = peers.aiomoqt_relay(big=True)
    out = tmp_path / "got.npz"
    pquic = ["--stack", "pquic"]

    async def scenario() -> None:
        pub = peers.kvcs(
            "publish", "publish", url, "-k", *CACHE, *pquic, "--serve-for", "30", "--json"
        )
        await proc_event(pub, "published", 30)
        fetch = peers.kvcs(
            "fetch", "fetch", url, "-k", *CACHE, *pquic, "--json", "--fetch-timeout", "30",
            "--out", str(out),
        )  # fmt: skip
        assert await proc_exit(fetch, 45) == 0, (fetch.events[-3:], fetch.other[-3:])
        check_done(fetch, out)
        assert pub.p.poll() is None, "the publisher kept its session with the relay"

    run(scenario(), timeout=90)
