"""``kvcs token`` (keygen, issue, inspect), the token options and the relay's safe default.

Nothing here opens a socket: the relay cases stop before binding.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from kvcs.transports.cli import build_parser, main
from kvcs.transports.cli.common import CliError, Exit, client_token
from kvcs.transports.cli.token import parse_duration, relay_authorizer
from kvcs_core.auth import MoqtAction, TokenStatus, parse_key_file, token_from_text, validate_token
from kvcs_core.kvsp.keys import scope_id

SCOPE_KEY = "c3" * 32


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's own errors (status 2)
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("alg", ["EdDSA", "ES256", "HMAC256"])
def test_keygen_issue_inspect_round_trip(
    alg: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "k.json"
    rc, out, err = _run(capsys, "token", "keygen", "--alg", alg, "--out", str(key), "--kid", "t1")
    assert rc == 0, err
    pub = tmp_path / "k.json.pub"
    assert key.stat().st_mode & 0o077 == 0  # the private key is private
    (private,) = parse_key_file(key.read_text())
    (public,) = parse_key_file(pub.read_text())
    assert private.can_issue and public.kid == b"t1"
    assert not public.d
    rc, out, err = _run(
        capsys, "token", "issue", "--key", str(key), "--scope-key", SCOPE_KEY,
        "--allow", "subscribe,discover", "--expires-in", "10m", "--issuer", "me",
    )  # fmt: skip
    assert rc == 0, err
    text = out.strip()
    verdict = validate_token(token_from_text(text), {public.kid: public}, now=time.time())
    assert verdict.ok and verdict.claims is not None and verdict.claims.moqt is not None
    sid = scope_id(bytes.fromhex(SCOPE_KEY))
    moqt = verdict.claims.moqt
    assert moqt.permits(MoqtAction.SUBSCRIBE, [b"kvcs-1", sid, b"c"], b"t")
    assert moqt.allows_action(MoqtAction.CLIENT_SETUP)
    assert not moqt.permits(MoqtAction.PUBLISH_NAMESPACE, [b"kvcs-1", sid])
    assert not moqt.permits(MoqtAction.FETCH, [b"kvcs-1", sid, b"c"], b"t")
    assert verdict.claims.issuer == "me"
    assert 590 <= (verdict.claims.expires or 0) - time.time() <= 601
    rc, out, err = _run(capsys, "token", "inspect", text, "--key", str(pub))
    assert rc == 0, err
    shown = json.loads(out)
    assert shown["verified"] is True and shown["kid"] == "t1" and shown["iss"] == "me"
    assert shown["moqt"][0]["namespace"] == ["kvcs-1", "0x" + sid.hex()]
    # verified against another key: shown, but status 1
    other = tmp_path / "other.json"
    assert _run(capsys, "token", "keygen", "--alg", alg, "--out", str(other), "--kid", "t1")[0] == 0
    rc, out, _ = _run(capsys, "token", "inspect", text, "--key", f"{other}.pub")
    assert rc == Exit.FAILED and json.loads(out)["status"] == TokenStatus.UNTRUSTED.name


def test_issue_scopes_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "k.json"
    assert _run(capsys, "token", "keygen", "--out", str(key))[0] == 0
    rc, out, _ = _run(capsys, "token", "issue", "--key", str(key), "--scope", "ab" * 16)
    assert rc == 0
    rc, out, _ = _run(capsys, "token", "inspect", out.strip())
    assert rc == 0 and json.loads(out)["moqt"][0]["namespace"] == ["kvcs-1", "0x" + "ab" * 16]
    scope_file = tmp_path / "scope.key"
    scope_file.write_text(SCOPE_KEY + "\n")
    assert (
        _run(capsys, "token", "issue", "--key", str(key), "--scope-key-file", str(scope_file))[0]
        == 0
    )
    rc, out, _ = _run(capsys, "token", "issue", "--key", str(key), "--all-scopes")
    assert rc == 0
    _, shown, _ = _run(capsys, "token", "inspect", out.strip())
    assert json.loads(shown)["moqt"][0]["namespace"] == ["kvcs-1"]
    bad = [
        ["issue", "--key", str(key)],  # no scope
        ["issue", "--key", str(key), "--scope", "ab", "--all-scopes"],
        ["issue", "--key", str(key), "--scope", "zz"],
        ["issue", "--key", str(key), "--scope", "ab" * 15],
        ["issue", "--key", str(key), "--all-scopes", "--allow", "publish,admin"],
        ["issue", "--key", str(key) + ".pub", "--all-scopes"],  # a public key cannot issue
        ["issue", "--key", str(key), "--all-scopes", "--expires-in", "soon"],
        ["issue", "--all-scopes"],
        ["inspect"],
        ["inspect", "***"],
        ["keygen"],
    ]
    for args in bad:
        rc, _, err = _run(capsys, "token", *args)
        assert rc == Exit.USAGE, (args, err)
        assert err.count("error:") == 1 and "Traceback" not in err, err
    rc, _, err = _run(capsys, "token", "inspect", "AAAA")
    assert rc == Exit.FAILED and "not a CAT token" in err
    rc, _, err = _run(capsys, "token", "issue", "--key", str(tmp_path / "missing"), "--all-scopes")
    assert rc == Exit.FILE, err
    notjson = tmp_path / "bad.json"
    notjson.write_text("{")
    rc, _, err = _run(capsys, "token", "issue", "--key", str(notjson), "--all-scopes")
    assert rc == Exit.USAGE and "not JSON" in err


def test_durations() -> None:
    assert parse_duration("90") == 90 and parse_duration("15m") == 900
    assert parse_duration("1h") == 3600 and parse_duration("2d") == 172800
    for bad in ("", "0", "-5", "1y", "h"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(bad)


def test_token_options_on_client_commands(tmp_path: Path) -> None:
    parser = build_parser()
    for command in ("publish", "fetch", "ls", "relay"):
        argv = [command] if command == "relay" else [command, "moqt://127.0.0.1:9"]
        args = parser.parse_args([*argv, "--token", "AAEC"])
        assert client_token(args) == b"\x00\x01\x02"
        path = tmp_path / "t"
        path.write_text("AAEC\n")
        assert (
            client_token(parser.parse_args([*argv, "--token-file", str(path)])) == b"\x00\x01\x02"
        )
        assert client_token(parser.parse_args(argv)) is None
        with pytest.raises(SystemExit):  # one or the other
            parser.parse_args([*argv, "--token", "AAEC", "--token-file", str(path)])
    with pytest.raises(CliError) as e:
        client_token(parser.parse_args(["ls", "moqt://127.0.0.1:9", "--token", "!!"]))
    assert e.value.status == Exit.USAGE


def test_bad_token_text_is_a_usage_error_before_connecting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, _, err = _run(capsys, "ls", "moqt://127.0.0.1:9", "-k", "--token", "not base64!")
    assert rc == Exit.USAGE and "--token" in err and "Traceback" not in err


def test_relay_safe_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    # loopback: anonymous is fine; elsewhere refused unless --allow-anonymous
    assert relay_authorizer(parser.parse_args(["relay", "--listen", "127.0.0.1:0"])) is None
    assert relay_authorizer(parser.parse_args(["relay", "--listen", "localhost:0"])) is None
    for host in ("0.0.0.0:4443", "[::]:4443", "192.0.2.7:4443"):
        with pytest.raises(CliError) as e:
            relay_authorizer(parser.parse_args(["relay", "--listen", host]))
        assert e.value.status == Exit.USAGE and "--auth-keys" in str(e.value)
        assert (
            relay_authorizer(parser.parse_args(["relay", "--listen", host, "--allow-anonymous"]))
            is None
        )
    rc, _, err = _run(capsys, "relay", "--listen", "0.0.0.0:0", "--self-signed")
    assert rc == Exit.USAGE and err.count("error:") == 1 and "--allow-anonymous" in err
    rc, _, err = _run(capsys, "relay", "--allow-anonymous", "--auth-keys", "x.json")
    assert rc == Exit.USAGE
    key = tmp_path / "k.json"
    assert _run(capsys, "token", "keygen", "--out", str(key))[0] == 0
    auth = relay_authorizer(
        parser.parse_args(["relay", "--listen", "0.0.0.0:1", "--auth-keys", f"{key}.pub"])
    )
    assert auth is not None and set(auth.keys) == {b"issuer-1"}
    broken = tmp_path / "broken.json"
    broken.write_text('{"kid": "x", "alg": "EdDSA"}')
    with pytest.raises(CliError) as e:
        relay_authorizer(parser.parse_args(["relay", "--auth-keys", str(broken)]))
    assert e.value.status == Exit.USAGE
    with pytest.raises(CliError) as e:
        relay_authorizer(parser.parse_args(["relay", "--auth-keys", str(tmp_path / "none")]))
    assert e.value.status == Exit.FILE
