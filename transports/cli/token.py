"""``kvcs token`` (issue, inspect, keygen) and the relay's ``--auth-keys``.

Theory of operation
-------------------
Tokens are CAT-4-MOQT tokens (:mod:`kvcs_core.auth`): a CWT signed (EdDSA,
ES256) or MACed (HMAC256) by an issuer key, whose ``moqt`` claim grants actions
under namespace prefixes. This module only reads and writes files and the
clock; validation and issuing are the core's.

* ``kvcs token keygen --out FILE [--alg EdDSA|ES256|HMAC256] [--kid K] [--issuer I]``
  writes a private key file (mode 0600) and its public key file
  (``--public-out``, default ``FILE.pub``), the JSON format of
  :mod:`kvcs_core.auth.keys`. The public file is what ``kvcs relay --auth-keys``
  reads (for HMAC256 it holds the shared secret too: keep it private).
* ``kvcs token issue --key FILE (--scope HEX | --scope-key HEX | --scope-key-file F
  | --all-scopes) [--allow publish,subscribe,fetch,discover] [--expires-in 1h]
  [--issuer I]`` prints a token (base64url) granting the listed action groups
  under ``("kvcs-1", Scope ID)`` (or every ``kvcs-1`` namespace) and the same
  under ``("kvcs-idx-1", Scope ID)``, the scope's KVSP index (binding 9: one
  namespace per indexed block, announced by publishers and looked up by
  consumers), and always CLIENT_SETUP (:data:`ALLOW`).
* ``kvcs token inspect TOKEN|--token-file F [--key FILE]`` prints the claims as
  JSON; with ``--key`` also whether it verifies now (status 1 if not).

Relay side (:func:`relay_authorizer`): ``--auth-keys FILE`` makes the relay
enforce tokens; without it a relay listening on anything but loopback refuses to
start unless ``--allow-anonymous`` is given (the safe default, status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Final

from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from kvcs.transports.quic._setup import is_loopback
from kvcs.transports.quic.config import parse_hostport
from kvcs_core.auth import (
    Authorizer,
    IssuerKey,
    KeyFileError,
    MoqtAction,
    MoqtClaim,
    TokenAlg,
    TokenStatus,
    inspect_token,
    issue_token,
    key_file_text,
    parse_key_file,
    token_from_text,
    token_to_text,
    validate_token,
)
from kvcs_core.auth.cat import TokenVerdict
from kvcs_core.auth.scope import prefix_scope
from kvcs_core.kvcs.index import INDEX_NAMESPACE_TAG
from kvcs_core.kvcs.names import KVCS_NAMESPACE_TAG
from kvcs_core.kvsp.keys import scope_id

from .common import CliError, Exit, read_file

ALLOW: Final[dict[str, tuple[MoqtAction, ...]]] = {
    "publish": (MoqtAction.PUBLISH_NAMESPACE, MoqtAction.PUBLISH),
    "subscribe": (MoqtAction.SUBSCRIBE, MoqtAction.REQUEST_UPDATE, MoqtAction.TRACK_STATUS),
    "fetch": (MoqtAction.FETCH, MoqtAction.TRACK_STATUS),
    "discover": (MoqtAction.SUBSCRIBE_NAMESPACE,),
}
"""``--allow`` groups -> ``moqt`` claim actions (CLIENT_SETUP is always added)."""
DEFAULT_ALLOW: Final = "publish,subscribe,fetch,discover"
_ALG_CHOICES: Final = {
    "EdDSA": TokenAlg.EDDSA,
    "ES256": TokenAlg.ES256,
    "HMAC256": TokenAlg.HMAC256,
}
_UNITS: Final = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``7d`` -> seconds (argparse type)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", text.lower())
    if m is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 15m, 1h, 7d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def add_token_command(sub: Any, each: dict[str, Any]) -> None:
    """The ``kvcs token`` subcommand (module docstring)."""
    t = sub.add_parser("token", help="issue, inspect or make keys for authorization tokens", **each)
    t.add_argument("action", choices=("issue", "inspect", "keygen"), help="what to do")
    t.add_argument("text", nargs="?", metavar="TOKEN", help="inspect: the token text ('-': stdin)")
    t.add_argument(
        "--key",
        type=Path,
        metavar="FILE",
        help="issue: the issuer's private key file; inspect: a key file to verify with",
    )
    t.add_argument("--scope", metavar="HEX", help="issue: the 16-octet Scope ID in hex")
    t.add_argument("--scope-key", metavar="HEX", help="issue: the 32-octet scope key in hex")
    t.add_argument(
        "--scope-key-file", type=Path, metavar="FILE", help="issue: file holding the scope key"
    )
    t.add_argument(
        "--all-scopes",
        action="store_true",
        help="issue: grant every kvcs-1 namespace (a relay's upstream token)",
    )
    t.add_argument(
        "--allow",
        default=DEFAULT_ALLOW,
        metavar="LIST",
        help=f"issue: comma-separated {', '.join(ALLOW)} (default {DEFAULT_ALLOW})",
    )
    t.add_argument(
        "--expires-in",
        type=parse_duration,
        default=3600.0,
        metavar="DURATION",
        help="issue: lifetime, e.g. 900, 15m, 1h, 7d (default 1h)",
    )
    t.add_argument("--issuer", metavar="TEXT", help="issue/keygen: the 'iss' claim")
    t.add_argument(
        "--token-file", type=Path, metavar="FILE", help="inspect: read the token from FILE"
    )
    t.add_argument("--out", type=Path, metavar="FILE", help="keygen: private key file to write")
    t.add_argument(
        "--public-out",
        type=Path,
        metavar="FILE",
        help="keygen: public key file for 'kvcs relay --auth-keys' (default FILE.pub)",
    )
    t.add_argument(
        "--alg",
        choices=tuple(_ALG_CHOICES),
        default="EdDSA",
        help="keygen: EdDSA (Ed25519, default), ES256 (P-256) or HMAC256 (shared secret)",
    )
    t.add_argument("--kid", default="issuer-1", help="keygen: key ID (default issuer-1)")


def add_relay_auth_options(r: argparse.ArgumentParser) -> None:
    g = r.add_argument_group("authorization")
    one = g.add_mutually_exclusive_group()
    one.add_argument(
        "--auth-keys",
        type=Path,
        metavar="FILE",
        help="enforce CAT tokens signed by these issuer keys (kvcs token keygen's .pub file)",
    )
    one.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="serve without authorization on a non-loopback address",
    )


def load_keys(path: Path, what: str) -> tuple[IssuerKey, ...]:
    data = read_file(path)
    try:
        return parse_key_file(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise CliError(f"{what} {path}: not UTF-8 text", Exit.USAGE) from None
    except KeyFileError as exc:
        raise CliError(f"{what} {path}: {exc}", Exit.USAGE) from None


def relay_authorizer(args: argparse.Namespace) -> Authorizer | None:
    """The relay's :class:`Authorizer` from ``--auth-keys``; ``None`` for anonymous access,
    refused (status 2) on a non-loopback ``--listen`` without ``--allow-anonymous``."""
    if args.auth_keys is not None:
        return Authorizer(load_keys(args.auth_keys, "--auth-keys"), time.time)
    host, _port = parse_hostport(args.listen)
    if not is_loopback(host) and not args.allow_anonymous:
        raise CliError(
            f"refusing to serve {host} without authorization: give --auth-keys FILE "
            "(or --allow-anonymous)",
            Exit.USAGE,
        )
    return None


# --- kvcs token ------------------------------------------------------------------------------


def token_command(args: argparse.Namespace) -> int:
    if args.action == "keygen":
        return _keygen(args)
    if args.action == "issue":
        return _issue(args)
    return _inspect(args)


def _private_key(alg: TokenAlg, kid: str, issuer: str | None) -> IssuerKey:
    if alg is TokenAlg.HMAC256:
        return IssuerKey(kid=kid.encode(), alg=alg, k=os.urandom(32), issuer=issuer)
    if alg is TokenAlg.EDDSA:
        sk = ed25519.Ed25519PrivateKey.generate()
        return IssuerKey(
            kid=kid.encode(),
            alg=alg,
            x=sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
            d=sk.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
            issuer=issuer,
        )
    n = ec.generate_private_key(ec.SECP256R1()).private_numbers()
    return IssuerKey(
        kid=kid.encode(),
        alg=alg,
        x=n.public_numbers.x.to_bytes(32, "big"),
        y=n.public_numbers.y.to_bytes(32, "big"),
        d=n.private_value.to_bytes(32, "big"),
        issuer=issuer,
    )


def _write(path: Path, text: str, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror or exc}", Exit.FILE) from None


def _keygen(args: argparse.Namespace) -> int:
    if args.out is None:
        raise CliError("kvcs token keygen needs --out FILE", Exit.USAGE)
    if not args.kid:
        raise CliError("--kid must not be empty", Exit.USAGE)
    key = _private_key(_ALG_CHOICES[args.alg], args.kid, args.issuer)
    public_out = args.public_out or args.out.with_name(args.out.name + ".pub")
    _write(args.out, key_file_text((key,)), 0o600)
    _write(public_out, key_file_text((key.public(),)), 0o600 if key.k else 0o644)
    print(f"private key: {args.out}\npublic key:  {public_out} (for kvcs relay --auth-keys)")
    return Exit.OK


def _scope_fields(args: argparse.Namespace) -> tuple[bytes, ...] | None:
    given = [
        n for n in ("scope", "scope_key", "scope_key_file") if getattr(args, n) is not None
    ] + (["all_scopes"] if args.all_scopes else [])
    if len(given) != 1:
        raise CliError(
            "give exactly one of --scope, --scope-key, --scope-key-file, --all-scopes",
            Exit.USAGE,
        )
    if args.all_scopes:
        return (KVCS_NAMESPACE_TAG,)
    if args.scope is not None:
        try:
            sid = bytes.fromhex(args.scope)
        except ValueError:
            raise CliError("--scope: not hex", Exit.USAGE) from None
        if len(sid) != 16:
            raise CliError(f"--scope: a Scope ID is 16 octets, not {len(sid)}", Exit.USAGE)
        return (KVCS_NAMESPACE_TAG, sid)
    if args.scope_key_file is not None:
        raw = read_file(args.scope_key_file)
        try:
            key = bytes.fromhex(raw.decode("ascii").strip()) if len(raw) != 32 else raw
        except (UnicodeDecodeError, ValueError):
            raise CliError("--scope-key-file: neither 32 octets nor hex", Exit.USAGE) from None
    else:
        try:
            key = bytes.fromhex(args.scope_key)
        except ValueError:
            raise CliError("--scope-key: not hex", Exit.USAGE) from None
    if len(key) != 32:
        raise CliError(f"the scope key must be 32 octets, not {len(key)}", Exit.USAGE)
    return (KVCS_NAMESPACE_TAG, scope_id(key))


def scope_claim(actions: set[MoqtAction], fields: tuple[bytes, ...] | None) -> MoqtClaim:
    """The claim ``kvcs token issue`` grants: ``actions`` under ``fields`` (``("kvcs-1",
    Scope ID)`` or ``("kvcs-1",)``) and under the same fields of the KVSP index
    (``kvcs-idx-1``), so that publications can announce their index and consumers
    look it up wherever they may publish and discover (``None``: every namespace)."""
    if fields is None:
        return MoqtClaim((prefix_scope(actions, None),))
    index = (INDEX_NAMESPACE_TAG, *fields[1:])
    return MoqtClaim((prefix_scope(actions, fields), prefix_scope(actions, index)))


def _actions(text: str) -> set[MoqtAction]:
    out = {MoqtAction.CLIENT_SETUP}
    for word in (w.strip() for w in text.split(",")):
        if word not in ALLOW:
            raise CliError(f"--allow: {word!r} is not one of {', '.join(ALLOW)}", Exit.USAGE)
        out.update(ALLOW[word])
    return out


def _issue(args: argparse.Namespace) -> int:
    if args.key is None:
        raise CliError("kvcs token issue needs --key FILE (the issuer's private key)", Exit.USAGE)
    fields = _scope_fields(args)
    actions = _actions(args.allow)
    keys = load_keys(args.key, "--key")
    if len(keys) != 1:
        raise CliError(f"--key {args.key}: holds {len(keys)} keys, not one", Exit.USAGE)
    try:
        token = issue_token(
            keys[0],
            scope_claim(actions, fields),
            now=time.time(),
            expires_in=args.expires_in,
            issuer=args.issuer,
        )
    except ValueError as exc:
        raise CliError(f"--key {args.key}: {exc}", Exit.USAGE) from None
    print(token_to_text(token))
    return Exit.OK


def _claims_json(v: TokenVerdict) -> dict[str, Any]:
    c = v.claims
    assert c is not None

    def match(m: Any) -> Any:
        v = m.value
        text = v.decode("ascii") if all(0x20 <= c < 0x7F for c in v) else "0x" + v.hex()
        return text if m.kind == 0 else {"prefix" if m.kind == 1 else "suffix": text}

    scopes = [
        {
            "actions": sorted(a.name for a in s.actions),
            "namespace": None if s.namespace is None else [match(m) for m in s.namespace],
            "exact_length": s.exact_length,
            "track": None if s.track is None else match(s.track),
        }
        for s in (c.moqt.scopes if c.moqt is not None else ())
    ]
    return {
        "kid": c.kid.decode("utf-8", "replace"),
        "iss": c.issuer,
        "iat": c.issued_at,
        "nbf": c.not_before,
        "exp": c.expires,
        "moqt": scopes,
    }


def _inspect(args: argparse.Namespace) -> int:
    if (args.text is None) == (args.token_file is None):
        raise CliError("give the token text or --token-file FILE (one of them)", Exit.USAGE)
    text = sys.stdin.read() if args.text == "-" else args.text
    if args.token_file is not None:
        try:
            text = read_file(args.token_file).decode("ascii")
        except UnicodeDecodeError:
            raise CliError(
                f"--token-file {args.token_file}: not base64url text", Exit.USAGE
            ) from None
    try:
        token = token_from_text(text)
    except ValueError as exc:
        raise CliError(str(exc), Exit.USAGE) from None
    shown = inspect_token(token)
    if not shown.ok:
        raise CliError(f"not a CAT token: {shown.detail}", Exit.FAILED)
    out = _claims_json(shown)
    status = Exit.OK
    if args.key is not None:
        keys = {k.kid: k for k in load_keys(args.key, "--key")}
        verdict = validate_token(token, keys, now=time.time())
        out["verified"] = verdict.ok
        out["status"] = verdict.status.name
        if verdict.status is not TokenStatus.OK:
            out["detail"] = verdict.detail
            status = Exit.FAILED
    json.dump(out, sys.stdout, indent=2)
    print()
    return status


__all__ = [
    "ALLOW",
    "add_relay_auth_options",
    "add_token_command",
    "parse_duration",
    "relay_authorizer",
    "token_command",
]
