"""Authorization tokens received from the peer: the alias cache (d21 sections 8.9, 9.1).

Theory of operation
-------------------
A Token (wire reference 5.3) is used once (USE_VALUE), or registered under an
alias for the rest of the session (REGISTER, then USE_ALIAS; DELETE retires it).
Alias spaces are per sender, so this cache holds the aliases *the peer*
registered with us. Its size is bounded by the MAX_AUTH_TOKEN_CACHE_SIZE we
advertised (default 0: no aliases); each registration costs 16 + len(value).

Outcomes (d21 9.1, wire reference 5.3 and Ambiguity A12), all session errors:

* REGISTER of a live alias -> DUPLICATE_AUTH_TOKEN_ALIAS;
* REGISTER beyond the cache size -> AUTH_TOKEN_CACHE_OVERFLOW, except in SETUP
  where it is treated as USE_VALUE;
* USE_ALIAS or DELETE of an alias never registered -> UNKNOWN_AUTH_TOKEN_ALIAS
  (A12: there is no REQUEST_ERROR code for it);
* DELETE or USE_ALIAS inside SETUP is rejected by the codec already (A12).

:meth:`TokenCache.resolve` returns the (Token Type, Token Value) pairs a message
carries, aliases resolved, for the application to authorize.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcs_core.moqt.errors import PeerViolation
from kvcs_core.wire.codes import SessionErrorCode, TokenAliasType
from kvcs_core.wire.params import AuthorizationToken

TOKEN_OVERHEAD = 16
"""Cache cost of one registration beyond its value bytes (d21 section 9.1)."""


class TokenCache:
    """The peer's registered aliases, bounded by our MAX_AUTH_TOKEN_CACHE_SIZE."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._aliases: dict[int, tuple[int, bytes]] = {}
        self.used = 0

    def resolve(
        self, tokens: Iterable[AuthorizationToken], *, in_setup: bool = False
    ) -> tuple[tuple[int, bytes], ...]:
        """Apply the tokens of one message in order; return the tokens it presents."""
        presented: list[tuple[int, bytes]] = []
        for tok in tokens:
            kind = tok.alias_type
            if kind is TokenAliasType.USE_VALUE:
                assert tok.token_type is not None and tok.value is not None
                presented.append((tok.token_type, tok.value))
            elif kind is TokenAliasType.REGISTER:
                assert tok.alias is not None and tok.token_type is not None
                assert tok.value is not None
                entry = (tok.token_type, tok.value)
                presented.append(entry)
                cost = TOKEN_OVERHEAD + len(tok.value)
                if tok.alias in self._aliases:
                    raise PeerViolation(
                        SessionErrorCode.DUPLICATE_AUTH_TOKEN_ALIAS,
                        f"alias {tok.alias} registered twice",
                    )
                if self.used + cost > self.max_size:
                    if in_setup:
                        continue  # d21 9.1: treated as USE_VALUE in SETUP
                    raise PeerViolation(
                        SessionErrorCode.AUTH_TOKEN_CACHE_OVERFLOW,
                        f"token alias cache over {self.max_size} bytes",
                    )
                self._aliases[tok.alias] = entry
                self.used += cost
            else:
                assert tok.alias is not None
                entry_or_none = self._aliases.get(tok.alias)
                if entry_or_none is None:
                    raise PeerViolation(
                        SessionErrorCode.UNKNOWN_AUTH_TOKEN_ALIAS, f"alias {tok.alias} unknown"
                    )
                if kind is TokenAliasType.USE_ALIAS:
                    presented.append(entry_or_none)
                else:  # DELETE
                    del self._aliases[tok.alias]
                    self.used -= TOKEN_OVERHEAD + len(entry_or_none[1])
        return tuple(presented)

    def __len__(self) -> int:
        return len(self._aliases)
