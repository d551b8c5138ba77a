"""SETUP options and the Token structure (d21 sections 9.1, 8.3 and 8.9).

Theory of operation
-------------------
The body of SETUP (d21 section 9.1) is nothing but a count-less KVP list of
Setup Options (section 8.3, ``kvp.py``) running to the end of the message.
:class:`SetupOptions` is that body with the known options typed:

* ``None`` means "option absent, its default applies"; a known option other
  than AUTHORIZATION_TOKEN that repeats is a PROTOCOL_VIOLATION;
* options this module does not know (GREASE among them) are kept, in wire
  order, in ``extra_options``, and encode back in place (the merged list is
  sorted stably by type);
* the Setup Option namespace is separate from the Message Parameter one
  (Ambiguity A29): the same code means different things in each.

``messages.Setup`` is :class:`SetupOptions` framed as a control message (it
adds only ``TYPE``), so this module needs nothing from ``messages.py``.

The Token structure (d21 section 8.9; wire reference 5.3)::

    Alias Type (vi64)   # DELETE 0, REGISTER 1, USE_ALIAS 2, USE_VALUE 3
    [Token Alias (vi64)]  # DELETE, REGISTER, USE_ALIAS
    [Token Type (vi64)]   # REGISTER, USE_VALUE
    [Token Value (..)]    # REGISTER, USE_VALUE: the rest of the enclosing length

is both the value of SETUP option 0x03 and of the AUTHORIZATION_TOKEN Message
Parameter (0x03), so :class:`AuthorizationToken` (a Message Parameter class,
re-exported by ``params.py``) and :func:`encode_token` / :func:`read_token` /
:func:`decode_token` live here. An undecodable Token closes the session with
KEY_VALUE_FORMATTING_ERROR; DELETE or USE_ALIAS in SETUP is PV in both
directions (Ambiguity A12).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Final, Self

import attrs

from kvcs_core.wire.codes import (
    MAX_VI64,
    ParameterType,
    SessionErrorCode,
    SetupOption,
    TokenAliasType,
)
from kvcs_core.wire.errors import CodecError, EncodeError, Incomplete
from kvcs_core.wire.filters import MessageParameter, vi64_validator
from kvcs_core.wire.kvp import KeyValuePair, KeyValuePairs, encode_kvps, read_kvps
from kvcs_core.wire.reader import read_vi64
from kvcs_core.wire.varint import Buffer, encode_vi64

__all__ = [
    "AuthorizationToken",
    "SetupOptions",
    "decode_token",
    "encode_token",
    "read_token",
]

P = ParameterType

# --- AUTHORIZATION_TOKEN (0x03) and the Token structure ------------------------


def _to_alias_type(value: int) -> TokenAliasType:
    try:
        return TokenAliasType(value)
    except ValueError:
        raise EncodeError(f"unknown token Alias Type {value!r}") from None


def _opt_bytes(value: bytes | str | None) -> bytes | None:
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else bytes(value)


_TOKEN_HAS_ALIAS: Final = frozenset(
    {TokenAliasType.DELETE, TokenAliasType.REGISTER, TokenAliasType.USE_ALIAS}
)
_TOKEN_HAS_VALUE: Final = frozenset({TokenAliasType.REGISTER, TokenAliasType.USE_VALUE})


@attrs.frozen
class AuthorizationToken(MessageParameter):
    """AUTHORIZATION_TOKEN (0x03) / SETUP option 0x03: a Token (d21 section 8.9).

    ``alias`` is present for DELETE, REGISTER and USE_ALIAS; ``token_type`` and
    ``value`` for REGISTER and USE_VALUE. Use the class-method constructors.
    """

    TYPE: ClassVar[ParameterType] = P.AUTHORIZATION_TOKEN
    alias_type: TokenAliasType = attrs.field(converter=_to_alias_type)
    alias: int | None = None
    token_type: int | None = None
    value: bytes | None = attrs.field(default=None, converter=_opt_bytes)

    def __attrs_post_init__(self) -> None:
        has_alias = self.alias_type in _TOKEN_HAS_ALIAS
        has_value = self.alias_type in _TOKEN_HAS_VALUE
        name = self.alias_type.name
        if (self.alias is not None) != has_alias:
            raise EncodeError(f"{name} token {'needs' if has_alias else 'has no'} alias")
        if (self.token_type is not None) != has_value or (self.value is not None) != has_value:
            raise EncodeError(f"{name} token {'needs' if has_value else 'has no'} type and value")
        for what, v in (("alias", self.alias), ("token_type", self.token_type)):
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_VI64
            ):
                raise EncodeError(f"token {what} {v!r} is not a vi64")

    @classmethod
    def delete(cls, alias: int) -> AuthorizationToken:
        """DELETE: retire ``alias``."""
        return cls(TokenAliasType.DELETE, alias)

    @classmethod
    def register(cls, alias: int, token_type: int, value: bytes | str) -> AuthorizationToken:
        """REGISTER: bind ``alias`` to (type, value) and use it."""
        return cls(TokenAliasType.REGISTER, alias, token_type, value)

    @classmethod
    def use_alias(cls, alias: int) -> AuthorizationToken:
        """USE_ALIAS: use the token registered under ``alias``."""
        return cls(TokenAliasType.USE_ALIAS, alias)

    @classmethod
    def use_value(cls, token_type: int, value: bytes | str) -> AuthorizationToken:
        """USE_VALUE: use (type, value) once, without caching."""
        return cls(TokenAliasType.USE_VALUE, None, token_type, value)

    def encode_value(self, out: bytearray) -> None:
        """Append ``Length`` and the Token."""
        tok = encode_token(self)
        out += encode_vi64(len(tok))
        out += tok


def encode_token(tok: AuthorizationToken) -> bytes:
    """The Token structure (no length prefix): Alias Type, [Alias], [Type], [Value]."""
    out = bytearray(encode_vi64(tok.alias_type))
    if tok.alias is not None:
        out += encode_vi64(tok.alias)
    if tok.token_type is not None:
        out += encode_vi64(tok.token_type)
    if tok.value is not None:
        out += tok.value
    return bytes(out)


def read_token(buf: Buffer, start: int, end: int) -> AuthorizationToken:
    """Decode the Token occupying ``buf[start:end]`` (offsets in ``buf``'s coordinates).

    Anything undecodable is KEY_VALUE_FORMATTING_ERROR (section 5.3).
    """
    kvfe = SessionErrorCode.KEY_VALUE_FORMATTING_ERROR
    bounded = buf[:end]
    pos = start
    try:
        at, pos = read_vi64(bounded, pos)
        try:
            alias_type = TokenAliasType(at)
        except ValueError:
            raise CodecError(f"unknown token Alias Type {at:#x}", code=kvfe, offset=start) from None
        alias = token_type = None
        value: bytes | None = None
        if alias_type in _TOKEN_HAS_ALIAS:
            alias, pos = read_vi64(bounded, pos)
        if alias_type in _TOKEN_HAS_VALUE:
            token_type, pos = read_vi64(bounded, pos)
            value = bytes(bounded[pos:end])
            pos = end
    except Incomplete:
        raise CodecError("token ends inside a field", code=kvfe, offset=start) from None
    if pos != end:
        raise CodecError(f"{alias_type.name} token has trailing bytes", code=kvfe, offset=pos)
    return AuthorizationToken(alias_type, alias, token_type, value)


def decode_token(buf: Buffer) -> AuthorizationToken:
    """Decode a whole Token value (e.g. a SETUP option's bytes)."""
    return read_token(buf, 0, len(buf))


# --- SETUP options ---------------------------------------------------------------

_SETUP_KNOWN: Final = frozenset(int(o) for o in SetupOption)


def _opt_vi64(_inst: object, attr: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None:
        vi64_validator(_inst, attr, value)


def _sorted_kvps(value: Iterable[KeyValuePair]) -> KeyValuePairs:
    pairs = tuple(sorted(value, key=lambda kv: kv.type))
    for p in pairs:
        if not isinstance(p, KeyValuePair):
            raise EncodeError(f"{p!r} is not a KeyValuePair")
    return pairs


def _as_tokens(value: Iterable[AuthorizationToken]) -> tuple[AuthorizationToken, ...]:
    return tuple(value)


@attrs.frozen
class SetupOptions:
    """The body of SETUP (d21 section 9.1): a count-less KVP list of Setup Options.

    ``None`` = option absent (its default applies). ``authorization_tokens`` may
    hold several REGISTER or USE_VALUE tokens (DELETE/USE_ALIAS in SETUP is PV).
    ``extra_options`` keeps unknown options (GREASE included) in wire order.
    ``messages.Setup`` adds the message framing.
    """

    path: bytes | None = attrs.field(default=None, converter=_opt_bytes)
    authority: bytes | None = attrs.field(default=None, converter=_opt_bytes)
    max_filter_ranges: int | None = attrs.field(default=None, validator=_opt_vi64)
    max_request_updates: int | None = attrs.field(default=None, validator=_opt_vi64)
    max_auth_token_cache_size: int | None = attrs.field(default=None, validator=_opt_vi64)
    moqt_implementation: bytes | None = attrs.field(default=None, converter=_opt_bytes)
    authorization_tokens: tuple[AuthorizationToken, ...] = attrs.field(
        default=(), converter=_as_tokens
    )
    extra_options: KeyValuePairs = attrs.field(default=(), converter=_sorted_kvps)

    def __attrs_post_init__(self) -> None:
        for tok in self.authorization_tokens:
            if tok.alias_type in (TokenAliasType.DELETE, TokenAliasType.USE_ALIAS):
                raise EncodeError(f"{tok.alias_type.name} token is not allowed in SETUP")
        for kv in self.extra_options:
            if kv.type in _SETUP_KNOWN:
                raise EncodeError(f"option {kv.type:#x} is known: use its typed field")
        self.options()  # every option value must fit a KVP (EncodeError otherwise)

    def options(self) -> KeyValuePairs:
        """All options as KVPs, merged in ascending type order (extras stay in order)."""
        o: list[KeyValuePair] = []
        if self.path is not None:
            o.append(KeyValuePair(SetupOption.PATH, self.path))
        o.extend(
            KeyValuePair(SetupOption.AUTHORIZATION_TOKEN, encode_token(t))
            for t in self.authorization_tokens
        )
        for t, v in (
            (SetupOption.MAX_AUTH_TOKEN_CACHE_SIZE, self.max_auth_token_cache_size),
            (SetupOption.AUTHORITY, self.authority),
            (SetupOption.MAX_FILTER_RANGES, self.max_filter_ranges),
            (SetupOption.MOQT_IMPLEMENTATION, self.moqt_implementation),
            (SetupOption.MAX_REQUEST_UPDATES, self.max_request_updates),
        ):
            if v is not None:
                o.append(KeyValuePair(t, v))
        o.extend(self.extra_options)
        return tuple(sorted(o, key=lambda kv: kv.type))

    def encode_body(self, out: bytearray) -> None:
        """Append the options."""
        encode_kvps(self.options(), out)

    @classmethod
    def decode_body(cls, buf: bytes, pos: int) -> tuple[Self, int]:
        """Parse the options: known ones typed, a repeated known one (not a token) is PV."""
        start = pos
        known: dict[int, Any] = {}
        tokens: list[AuthorizationToken] = []
        extras: list[KeyValuePair] = []
        for kv in read_kvps(buf, pos, len(buf), what="Setup Options"):
            if kv.type == SetupOption.AUTHORIZATION_TOKEN:
                assert isinstance(kv.value, bytes)  # odd type
                try:
                    tok = decode_token(kv.value)
                except CodecError as e:  # KEY_VALUE_FORMATTING_ERROR
                    raise CodecError(f"SETUP: {e.reason}", code=e.code, offset=start) from None
                if tok.alias_type in (TokenAliasType.DELETE, TokenAliasType.USE_ALIAS):
                    # Ambiguity A12 (last sentence): PV in both directions.
                    raise CodecError(f"SETUP: {tok.alias_type.name} token", offset=start)
                tokens.append(tok)
            elif kv.type in _SETUP_KNOWN:
                if kv.type in known:
                    name = SetupOption(kv.type).name
                    raise CodecError(f"SETUP: option {name} repeated", offset=start)
                known[kv.type] = kv.value  # parity fixes bytes (odd) or int (even)
            else:
                extras.append(kv)
        o = SetupOption
        msg = cls(
            path=known.get(o.PATH),
            authority=known.get(o.AUTHORITY),
            max_filter_ranges=known.get(o.MAX_FILTER_RANGES),
            max_request_updates=known.get(o.MAX_REQUEST_UPDATES),
            max_auth_token_cache_size=known.get(o.MAX_AUTH_TOKEN_CACHE_SIZE),
            moqt_implementation=known.get(o.MOQT_IMPLEMENTATION),
            authorization_tokens=tokens,
            extra_options=extras,
        )
        return msg, len(buf)
