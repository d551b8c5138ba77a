"""Interop tests (tests/interop/): every one runs inside a loopback-only network namespace.

Why: aiomoqt (aiopquic) binds its UDP sockets to every interface whatever it
is told, its relay *and* its clients (tests/peers/README.md "Safety"). So the
whole of each interop test, peers and our side alike, runs in a network
namespace whose only interface is ``lo``.

How: when pytest runs outside such a namespace, the first interop test it
reaches re-executes one inner pytest session, for exactly the interop tests
this session selected, under ``unshare -n`` (``unshare -r -n`` when not root)
after ``ip link set lo up``. The inner session writes each test report as a
JSON line (pytest's own ``pytest_report_to_serializable``); this outer session
then replays those reports as the results of its own items, so ``pytest -q``
shows every interop test as passed / failed / skipped / xfailed with its own
reason, duration and traceback, as if it had run here. Inside a loopback-only
namespace (the inner session, or a developer already in one) the tests simply
run.

A test that fails is re-run once in a fresh namespace session and its second
result counts (announced on stderr): the peers are independent processes on a
shared machine, and a failure can be timing alone; one that fails twice fails.

Skips, always with the reason: the peers are not installed (``.peers``, see
scripts/install_peers.sh), or no namespace can be created (no ``unshare`` or
``ip``, or not permitted). The inner session is bounded (``INNER_TIMEOUT``):
past it the inner pytest gets SIGINT (fixtures stop their processes by PID),
then SIGKILL for its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "peers"))  # peerlib, peer_common (standard library only)

from peerlib import loopback_only, peers_missing  # noqa: E402

REPORT_ENV = "KVCS_INTEROP_REPORT"
"""Set in the inner session: the file its test reports go to (JSON lines)."""

INNER_TIMEOUT = 420.0
"""Seconds the whole inner session may take (each test bounds its own waits far below)."""


def _is_interop(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(HERE)


class _NamespaceRun:
    """The one inner pytest session of this process (outside a namespace only)."""

    def __init__(self) -> None:
        self.items: list[pytest.Item] = []
        self.started = False
        self.skip: str | None = None
        """Why the interop tests skip (peers missing, no namespace possible)."""
        self.error: str | None = None
        """Why the inner session gave no result (a crash, a timeout)."""
        self.reports: dict[str, list[dict[str, Any]]] = {}
        self.log: Path | None = None

    def run(self, config: pytest.Config) -> None:
        if self.started:
            return
        self.started = True
        self.skip = peers_missing()
        if self.skip is None:
            prefix = self._unshare_prefix()
            if prefix is not None:
                self._run_inner(config, prefix)

    def _unshare_prefix(self) -> list[str] | None:
        if shutil.which("unshare") is None:
            self.skip = "no loopback-only network namespace: 'unshare' (util-linux) not found"
            return None
        if shutil.which("ip") is None:
            self.skip = "no loopback-only network namespace: 'ip' (iproute2) not found"
            return None
        tries = ([["unshare", "-n"]] if os.geteuid() == 0 else []) + [["unshare", "-r", "-n"]]
        why = []
        for prefix in tries:
            try:
                r = subprocess.run(
                    [*prefix, "ip", "link", "set", "lo", "up"],
                    capture_output=True,
                    text=True,
                    timeout=15,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                why.append(f"{' '.join(prefix)}: {exc}")
                continue
            if r.returncode == 0:
                return prefix
            why.append(f"{' '.join(prefix)}: {(r.stderr or r.stdout).strip()[-200:]}")
        self.skip = "unshare -n not permitted here (" + "; ".join(why) + ")"
        return None

    def _run_inner(self, config: pytest.Config, prefix: list[str]) -> None:
        """Run the selected tests in the namespace; re-run once those that failed.

        The peers are independent processes on a shared 2-core machine: a test that
        fails can fail on timing alone. Each failure is re-run once in a fresh inner
        session and the second result counts; the re-run is announced on stderr, so a
        test that only passes on its second try stays visible.
        """
        nodeids = [item.nodeid for item in self.items]
        reports, ok = self._run_once(config, prefix, nodeids)
        failed = [
            nodeid
            for nodeid, reps in reports.items()
            if any(r.get("outcome") == "failed" for r in reps)
        ]
        if failed and self.error is None:
            print(
                f"\ninterop: re-running {len(failed)} failed test(s) once: {', '.join(failed)}",
                file=sys.stderr,
            )
            again, ok = self._run_once(config, prefix, failed)
            reports.update(again)
        self.reports = reports
        if ok and self.error is None:
            self.log = None

    def _run_once(
        self, config: pytest.Config, prefix: list[str], nodeids: list[str]
    ) -> tuple[dict[str, list[dict[str, Any]]], bool]:
        tmp = Path(tempfile.mkdtemp(prefix="kvcs-interop-"))
        report = tmp / "reports.jsonl"
        self.log = tmp / "inner-pytest.log"
        argv = [
            *prefix,
            "bash",
            "-c",
            'ip link set lo up && exec "$@"',
            "bash",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *nodeids,
        ]
        env = dict(os.environ, **{REPORT_ENV: str(report)})
        with self.log.open("w") as log:
            proc = subprocess.Popen(
                argv,
                cwd=config.rootpath,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                proc.wait(INNER_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.error = f"the namespace session ran past {INNER_TIMEOUT:g} s"
                proc.send_signal(signal.SIGINT)  # pytest unwinds: fixtures stop processes
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # its own group (by ID)
                    proc.wait(5)
        reports: dict[str, list[dict[str, Any]]] = {}
        if report.exists():
            for line in report.read_text().splitlines():
                entry = json.loads(line)
                reports.setdefault(entry["nodeid"], []).append(entry["report"])
        if self.error is None and proc.returncode not in (0, 1):
            self.error = f"the namespace session exited with status {proc.returncode}"
        ok = proc.returncode == 0 and self.error is None
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)  # kept (with its log) when anything failed
        return reports, ok

    def tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").splitlines()[-30:]
        return f"\n--- last lines of {self.log} ---\n" + "\n".join(lines)


_RUN = _NamespaceRun()


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if not loopback_only():
        _RUN.items = [item for item in items if _is_interop(item)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Outside a namespace: replay the inner session's reports for this item."""
    if loopback_only() or not _is_interop(item):
        return None
    _RUN.run(item.config)
    reports = _RUN.reports.get(item.nodeid)
    if not reports:
        return None  # the usual protocol; _netns_guard skips or fails with the reason
    hook = item.ihook
    hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for data in reports:
        if isinstance(data.get("longrepr"), list):  # a skip's (path, line, reason): JSON made
            data["longrepr"] = tuple(data["longrepr"])  # it a list; the summary wants a tuple
        rep = item.config.hook.pytest_report_from_serializable(config=item.config, data=data)
        hook.pytest_runtest_logreport(report=rep)
    hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Inside the namespace session: write every report for the outer session."""
    path = os.environ.get(REPORT_ENV)
    if not path or not loopback_only() or not _CONFIG:
        return
    config = _CONFIG[0]
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "report": data}) + "\n")


_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG.append(config)


@pytest.fixture(autouse=True)
def _netns_guard() -> Iterator[None]:
    """Outside a namespace, reached only when the inner session gave no result."""
    if not loopback_only():
        if _RUN.skip is not None:
            pytest.skip(_RUN.skip)
        pytest.fail(
            "no result from the loopback-only namespace session: "
            f"{_RUN.error or 'the test did not run there'}{_RUN.tail()}",
            pytrace=False,
        )
    yield


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[Any]:
    """The processes of one test (peer scripts, our CLI), stopped by PID at the end."""
    from interop_harness import Peers, require_namespace  # noqa: PLC0415

    require_namespace()
    (tmp_path / "cert").mkdir()
    with Peers(tmp_path, port=0) as ps:
        yield ps


@pytest.fixture
def our_relay(tmp_path: Path, peers: Any) -> Iterator[Any]:
    """Our relay (serve_relay) in this process; after the test: no exception, all moqt-22."""
    from interop_harness import InprocRelay  # noqa: PLC0415

    with InprocRelay(tmp_path) as relay:
        yield relay
    relay.check()
