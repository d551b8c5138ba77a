"""``connect(token=...)`` against ``serve_relay`` with an Authorizer, on asyncio and trio.

Everything in this process over real QUIC on 127.0.0.1 (port 0); each scenario runs
under a hard deadline on its loop.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio
from auth_keys import SCOPE_A, SCOPE_B, ed25519_key, scope_token

from kvcs.transports.quic import asyncio_binding, trio_binding
from kvcs.transports.quic.api import ConnectError
from kvcs.transports.quic.tls import TlsConfig, self_signed
from kvcs_core.auth import Authorizer, token_to_text
from kvcs_core.relay import RelayConfig
from kvcs_core.wire.names import TrackNamespace

DEADLINE = 40.0
INSECURE = TlsConfig(verify=False)


async def _scenario(b: ModuleType, certs: Path) -> dict[str, Any]:
    key = ed25519_key()
    config = RelayConfig(authorizer=Authorizer([key.public()], time.time))
    out: dict[str, Any] = {}
    async with b.serve_relay("127.0.0.1:0", tls=self_signed(certs), relay_config=config) as relay:
        now = time.time()
        good = scope_token(key, SCOPE_A, now=now)
        async with b.connect(relay.url, tls=INSECURE, token=token_to_text(good)) as client:
            out["connected"] = client.connected
            found = await client.discover(TrackNamespace((b"kvcs-1",)), quiet=0.3)
            out["found"] = found
            try:
                await client.discover(TrackNamespace((b"kvcs-1", SCOPE_B)), quiet=0.3)
            except ConnectError as exc:
                out["other_scope"] = str(exc)
        for name, token in (
            ("none", None),
            ("expired", scope_token(key, SCOPE_A, now=now - 7200, expires_in=60)),
            ("stranger", scope_token(ed25519_key(), SCOPE_A, now=now)),
        ):
            try:
                async with b.connect(relay.url, tls=INSECURE, token=token, timeout=10) as c:
                    # the close may come just after the end of setup: wait for it
                    await c.driver.wait_for(lambda c=c: c.closed, 10.0)
                    out[name] = c.pump.close_reason
            except ConnectError as exc:
                out[name] = str(exc)
        # a session lasts as long as its SETUP token: closed at its exp
        short = scope_token(key, SCOPE_A, now=time.time(), expires_in=2)
        async with b.connect(relay.url, tls=INSECURE, token=short) as c:
            began = time.monotonic()
            out["short_connected"] = c.connected
            await c.driver.wait_for(lambda: c.closed, 10.0)
            out["short"] = c.pump.close_reason
            out["short_lasted"] = time.monotonic() - began
    return out


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_connect_with_a_token(loop: str, tmp_path: Path) -> None:
    if loop == "asyncio":
        out = asyncio.run(asyncio.wait_for(_scenario(asyncio_binding, tmp_path), DEADLINE))
    else:

        async def bounded() -> dict[str, Any]:
            with trio.fail_after(DEADLINE):
                return await _scenario(trio_binding, tmp_path)

        out = trio.run(bounded)
    assert out["connected"] is True
    assert out["found"] == []  # nothing published yet, and the listing was allowed
    assert "(code 1)" in out["other_scope"], out  # REQUEST_ERROR UNAUTHORIZED
    assert "code 0x2" in out["none"], out
    assert "code 0x18" in out["expired"], out
    assert "code 0x2" in out["stranger"], out
    assert out["short_connected"] is True and "code 0x18" in out["short"], out
    assert out["short_lasted"] > 0.5, out


def test_a_bad_token_text_is_a_value_error() -> None:
    async def go() -> None:
        with pytest.raises(ValueError, match="base64"):
            async with asyncio_binding.connect("moqt://127.0.0.1:9", token="not base64!"):
                pass

    asyncio.run(asyncio.wait_for(go(), DEADLINE))
