"""``kv_connector_extra_config`` parsing: typed settings, one-line errors naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvcs.vllm.config import ConnectorConfigError, Role, parse_settings

KEY = "ab" * 32
BASE = {"relay": "moqt://127.0.0.1:4443", "scope_key": KEY}


def test_roles_map_to_what_the_engine_does() -> None:
    for kv_role, role, publishes, loads in (
        ("kv_producer", Role.PRODUCER, True, False),
        ("kv_consumer", Role.CONSUMER, False, True),
        ("kv_both", Role.BOTH, True, True),
    ):
        s = parse_settings(kv_role, BASE)
        assert s.role is role and s.role.publishes is publishes and s.role.loads is loads


def test_defaults_and_values() -> None:
    s = parse_settings("kv_consumer", BASE)
    assert s.scope_key == bytes.fromhex(KEY)
    assert s.relay == BASE["relay"] and s.tls.verify and s.tls.cafile is None
    assert (s.lookup_timeout, s.load_timeout, s.recovery_time) == (5.0, 30.0, 1.0)
    assert s.lookup_quiet == 0.25
    assert s.token is None and s.signer is None and s.producer_keys is None
    assert s.encrypt is False and s.event_log is None and s.stack == "qh3"
    s = parse_settings(
        "kv_both",
        {**BASE, "insecure": True, "lookup_timeout": 0.5, "load_timeout": 3, "encrypt": True,
         "model_id": "m", "revision": "r", "stack": "aioquic", "event_log": "/tmp/x.jsonl"},
    )  # fmt: skip
    assert not s.tls.verify and s.lookup_timeout == 0.5 and s.load_timeout == 3.0
    assert s.encrypt and (s.model_id, s.revision, s.stack) == ("m", "r", "aioquic")
    assert s.event_log == Path("/tmp/x.jsonl")
    assert KEY not in repr(s)  # the scope key is never printed


def test_files_are_read_once(tmp_path: Path) -> None:
    (tmp_path / "scope").write_text(KEY + "\n")
    (tmp_path / "token").write_text("  tok-en \n")
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    priv = Ed25519PrivateKey.generate()
    (tmp_path / "sign.pem").write_bytes(
        priv.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (tmp_path / "pub.pem").write_bytes(
        priv.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    s = parse_settings(
        "kv_both",
        {"relay": BASE["relay"], "scope_key_file": str(tmp_path / "scope"),
         "token_file": str(tmp_path / "token"), "ca": str(ca),
         "sign_key": str(tmp_path / "sign.pem"), "producer_key": str(tmp_path / "pub.pem"),
         "key_id": "k1"},
    )  # fmt: skip
    assert s.scope_key == bytes.fromhex(KEY) and s.token == "tok-en" and s.tls.cafile == str(ca)
    assert s.signer is not None and s.producer_keys is not None
    assert set(s.producer_keys) == {b"k1"}


@pytest.mark.parametrize(
    ("role", "extra", "message"),
    [
        ("kv_sender", BASE, "kv_role must be one of"),
        (None, BASE, "kv_role must be one of"),
        ("kv_consumer", {**BASE, "relay_url": "x"}, "unknown kv_connector_extra_config key"),
        ("kv_consumer", {"scope_key": KEY}, "relay (a moqt:// or https:// URL) is required"),
        ("kv_consumer", {**BASE, "relay": "http://x"}, "relay:"),
        ("kv_consumer", {"relay": BASE["relay"]}, "scope_key (64 hex digits)"),
        ("kv_consumer", {**BASE, "scope_key": "zz"}, "scope_key: not hex"),
        ("kv_consumer", {**BASE, "scope_key": "ab" * 8}, "must be 32 octets, not 8"),
        ("kv_consumer", {**BASE, "scope_key_file": "/nonexistent"}, "give scope_key or"),
        ("kv_consumer", {**BASE, "lookup_timeout": 0}, "lookup_timeout: must be a positive"),
        ("kv_consumer", {**BASE, "load_timeout": "5"}, "load_timeout: a number of seconds"),
        ("kv_consumer", {**BASE, "recovery_time": float("nan")}, "recovery_time: must be"),
        ("kv_consumer", {**BASE, "encrypt": "yes"}, "encrypt: true or false"),
        ("kv_consumer", {**BASE, "ca": "/nonexistent/ca.pem"}, "ca: file not found"),
        ("kv_consumer", {**BASE, "stack": "quiche"}, "stack: one of"),
        ("kv_consumer", {**BASE, "sign_key": "/x"}, "sign_key is for kv_producer"),
        ("kv_producer", {**BASE, "producer_key": "/x"}, "producer_key is for kv_consumer"),
        ("kv_producer", {**BASE, "sign_key": "/nonexistent"}, "sign_key: cannot read"),
        ("kv_consumer", {**BASE, "token": "a", "token_file": "/x"}, "give token or token_file"),
        ("kv_consumer", {**BASE, "model_id": ""}, "model_id: a non-empty string"),
    ],
)
def test_bad_settings_are_one_line_errors(role: Any, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConnectorConfigError) as info:
        parse_settings(role, extra)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_a_file_that_is_not_a_key_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "k.pem"
    bad.write_text("not a key")
    with pytest.raises(ConnectorConfigError, match="sign_key: not a usable private key"):
        parse_settings("kv_producer", {**BASE, "sign_key": str(bad)})
    with pytest.raises(ConnectorConfigError, match="producer_key: not a public key"):
        parse_settings("kv_consumer", {**BASE, "producer_key": str(bad)})


def test_importing_kvcs_does_not_import_vllm() -> None:
    code = "import sys, kvcs, kvcs.adapters.torch_kv; assert 'vllm' not in sys.modules"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
