"""What a process loads: ``import kvcs`` and ``kvcs relay`` stay light.

``kvcs`` resolves its public names on first use (PEP 562), and the command line imports
numpy, the cache files, trio and prometheus_client inside the subcommands that use them.
A relay holds no arrays, runs on asyncio unless told otherwise and serves no metrics
unless given ``--metrics``: those packages cost an idle relay about 20 MiB (79 MiB
before, 57 after, qh3, Python 3.13). Each check runs in a fresh interpreter, since this
one has imported everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import kvcs

HEAVY = ("numpy", "trio", "prometheus_client", "torch", "transformers", "safetensors")


def _loaded_after(code: str, timeout: float = 60.0) -> list[str]:
    """The heavy top-level packages loaded once ``code`` has run in a fresh interpreter."""
    probe = textwrap.dedent(
        f"""
        import atexit, json, sys
        atexit.register(lambda: print("LOADED " + json.dumps(sorted(
            {{m.split(".")[0] for m in sys.modules}} & set({list(HEAVY)!r})))))
        """
    ) + textwrap.dedent(code)
    out = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("LOADED ")]
    assert lines, f"probe printed nothing (exit {out.returncode}): {out.stderr[-2000:]}"
    loaded: list[str] = json.loads(lines[-1].removeprefix("LOADED "))
    return loaded


def test_import_kvcs_loads_no_heavy_package() -> None:
    assert _loaded_after("import kvcs, kvcs.transports.cli") == []


def test_a_public_name_loads_what_it_needs() -> None:
    assert _loaded_after("import kvcs; kvcs.KvDestination") == ["numpy"]
    assert _loaded_after("import kvcs; kvcs.RelayConfig; kvcs.connect; kvcs.TlsConfig") == []


def test_every_public_name_resolves_to_its_home() -> None:
    assert sorted(kvcs._HOMES) == sorted(kvcs.__all__)
    for name in kvcs.__all__:
        value = getattr(kvcs, name)
        assert getattr(value, "__module__", kvcs._HOMES[name]).startswith(("kvcs", "kvcs_core"))
    assert set(kvcs.__all__) <= set(dir(kvcs))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = kvcs.no_such_name  # type: ignore[attr-defined]


@pytest.mark.parametrize("stack", ["qh3", "aioquic"])
def test_a_running_relay_loads_no_heavy_package(stack: str) -> None:
    """A real ``kvcs relay`` (self-signed, a free port, 0.5 s) in a fresh interpreter."""
    loaded = _loaded_after(
        f"""
        from kvcs.transports.cli import main
        status = main(["relay", "--self-signed", "--listen", "127.0.0.1:0",
                       "--run-for", "0.5", "--stack", "{stack}"])
        assert status == 0, status
        """
    )
    assert loaded == []


def test_trio_is_loaded_when_asked_for() -> None:
    loaded = _loaded_after(
        """
        from kvcs.transports.cli import main
        status = main(["relay", "--self-signed", "--listen", "127.0.0.1:0",
                       "--run-for", "0.3", "--loop", "trio"])
        assert status == 0, status
        """
    )
    assert loaded == ["trio"]
