"""``kvcs publish --encrypt`` and ``kvcs fetch --require-encryption``, each role a process.

A ``kvcs relay`` process, a ``kvcs publish --encrypt`` process and ``kvcs fetch``
processes over QUIC on 127.0.0.1 (helpers of ``test_cli_processes``):

* a consumer with ``--require-encryption`` (and one with the default suite,
  without it) gets the cache bit-identical through the relay;
* a consumer with another ``--cipher-suite`` than the publisher's cannot open
  the manifest: exit 1 with one line naming the cause;
* an unencrypted publication is refused by ``--require-encryption``: exit 1
  with one line;
* inconsistent encryption options exit 2 with one line, before connecting.

Every process is killed by its PID when the test ends (the ``procs`` fixture).
"""

from __future__ import annotations

import json

import pytest
from test_cli_processes import (
    CACHE,
    START_TIMEOUT,
    Procs,
    assert_bit_identical,
    fetch_args,
    kvcs,
    one_error_line,
    procs,  # noqa: F401  (the fixture)
    read_line,
)


def _publisher(ps: Procs, url: str, *extra: str) -> None:
    pub = ps.start("publisher", "publish", url, "-k", *CACHE, "--serve-for", "60", "--json", *extra)
    first = json.loads(read_line(pub, START_TIMEOUT, "the publisher's first line"))
    assert first["event"] == "publishing", first


def test_encrypted_publication_through_a_relay_process(procs: Procs) -> None:  # noqa: F811
    _, url, _ = procs.relay("relay")
    _publisher(procs, url, "--encrypt", "--cipher-suite", "aes256gcm", "--key-id", "7")
    required = procs.start(
        "fetch-required",
        *fetch_args(url, "-k", "--require-encryption", "--cipher-suite", "aes256gcm"),
    )
    assert_bit_identical("fetch-required", required, procs.finish(required), procs)
    on_trio = procs.start(
        "fetch-trio",
        *fetch_args(
            url, "-k", "--loop", "trio", "--require-encryption", "--cipher-suite", "aes256gcm"
        ),
    )
    assert_bit_identical("fetch-trio", on_trio, procs.finish(on_trio), procs)
    # another suite than the publisher's: the manifest does not decrypt
    wrong = procs.start("fetch-wrong-suite", *fetch_args(url, "-k", "--cipher-suite", "aes128gcm"))
    procs.finish(wrong)
    assert wrong.returncode == 1
    line = one_error_line(procs.stderr("fetch-wrong-suite"))
    assert "did not decrypt" in line and "--cipher-suite" in line, line


def test_require_encryption_refuses_an_unencrypted_publication(procs: Procs) -> None:  # noqa: F811
    _, url, _ = procs.relay("relay")
    _publisher(procs, url)
    plain = procs.start("fetch-plain", *fetch_args(url, "-k"))
    assert_bit_identical("fetch-plain", plain, procs.finish(plain), procs)
    required = procs.start("fetch-required", *fetch_args(url, "-k", "--require-encryption"))
    procs.finish(required)
    assert required.returncode == 1
    line = one_error_line(procs.stderr("fetch-required"))
    assert "not encrypted" in line and "--require-encryption" in line, line


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("publish", "--key-id", "3"), "--key-id needs --encrypt"),
        (("publish", "--cipher-suite", "aes256gcm"), "--cipher-suite needs --encrypt"),
        (("publish", "--encrypt", "--key-id", "-1"), "--key-id must be 0..2**64-1"),
        (("fetch", "--cipher-suite", "rot13"), "invalid choice: 'rot13'"),
    ],
)
def test_bad_encryption_options_exit_2_with_one_line(args: tuple[str, ...], words: str) -> None:
    command, *rest = args
    done = kvcs(command, "moqt://127.0.0.1:9", *CACHE, "-k", *rest)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert words in one_error_line(done.stderr), done.stderr
