"""Authorization with CAT tokens for MOQT (draft-ietf-moq-c4m-02), pure.

* :mod:`.scope`: the ``moqt`` claim (actions x namespace match x track match);
* :mod:`.keys`: issuer keys and the JSON key-file format;
* :mod:`.cat`: issuing and validating a token (a COSE-protected CWT);
* :mod:`.policy`: a relay's decisions, with MOQT's error codes.
"""

from kvcs_core.auth.cat import (
    CAT_TOKEN_TYPE,
    TokenClaims,
    TokenStatus,
    TokenVerdict,
    inspect_token,
    issue_token,
    token_from_text,
    token_to_text,
    validate_token,
)
from kvcs_core.auth.keys import IssuerKey, KeyFileError, TokenAlg, key_file_text, parse_key_file
from kvcs_core.auth.policy import Authorizer, Decision, SessionGrant
from kvcs_core.auth.scope import ClaimError, Match, MatchType, MoqtAction, MoqtClaim, MoqtScope

__all__ = [
    "CAT_TOKEN_TYPE",
    "Authorizer",
    "ClaimError",
    "Decision",
    "IssuerKey",
    "KeyFileError",
    "Match",
    "MatchType",
    "MoqtAction",
    "MoqtClaim",
    "MoqtScope",
    "SessionGrant",
    "TokenAlg",
    "TokenClaims",
    "TokenStatus",
    "TokenVerdict",
    "inspect_token",
    "issue_token",
    "key_file_text",
    "parse_key_file",
    "token_from_text",
    "token_to_text",
    "validate_token",
]
