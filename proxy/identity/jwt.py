"""Verification of signed JWT bearer tokens (DESIGN §6 Keys; reliability K2, RFC 8725).

The algorithms come from policy only, never from the token; one policy is either HMAC or
public-key, never both (mixing them is the HS/RS key-confusion attack). Keys are loaded once,
and checked, by proxy.config.jwt_keys (which `check-config` runs too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from jwt.types import Options

from proxy.config import JwtPolicy
from proxy.config.jwt_keys import PublicKey, check_jwt_policy, load_jwt_keys
from proxy.identity.principal import ACCOUNT_PATTERN

__all__ = ["InvalidToken", "JwtVerifier", "TokenClaims", "check_jwt_policy", "looks_like_jwt"]

_MAX_TOKEN_CHARS = 8192  # bounds the parsing work an unauthenticated caller can ask for
_ACCOUNT_RE = re.compile(ACCOUNT_PATTERN)  # the account ends up in Redis keys and logs
_JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")

# Public reasons only: pyjwt's own messages can quote header values the caller chose.
_REASONS: tuple[tuple[type[Exception], str], ...] = (
    (jwt.ExpiredSignatureError, "token expired"),
    (jwt.ImmatureSignatureError, "token not yet valid"),
    (jwt.InvalidAudienceError, "wrong audience"),
    (jwt.InvalidIssuerError, "wrong issuer"),
    (jwt.InvalidSignatureError, "bad signature"),
    (jwt.InvalidAlgorithmError, "algorithm not allowed"),
    (jwt.InvalidKeyError, "key does not fit the algorithm"),
    (jwt.InvalidIssuedAtError, "bad claim 'iat'"),
    (jwt.DecodeError, "malformed token"),
)


class InvalidToken(Exception):
    """A bearer token that must be refused (401); `reason` is safe to show the caller."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TokenClaims:
    account: str
    tier: str | None
    role: str | None
    token_id: str | None  # jti


def looks_like_jwt(token: str) -> bool:
    """Three base64url segments (the last may be empty, so `alg: none` is still refused as JWT)."""
    return _JWT_SHAPE.fullmatch(token) is not None


class JwtVerifier:
    def __init__(self, policy: JwtPolicy, config_root: Path) -> None:
        keys, problems = load_jwt_keys(policy, config_root)
        if problems:
            raise ValueError("; ".join(problems))
        self._policy = policy
        self._keys = keys
        self._algorithms: list[str] = list(policy.algorithms)
        # exp is always required; iss/aud become required once configured.
        require = ["exp"] + ["iss"] * bool(policy.issuer) + ["aud"] * bool(policy.audience)
        self._options: Options = {"require": require,
                                            "enforce_minimum_key_length": True}

    @property
    def enabled(self) -> bool:
        return bool(self._algorithms)

    def verify(self, token: str) -> TokenClaims:
        if not self.enabled:
            raise InvalidToken("bearer tokens are not enabled")
        if len(token) > _MAX_TOKEN_CHARS:
            raise InvalidToken("token too large")
        try:
            header = jwt.get_unverified_header(token)
        except (jwt.PyJWTError, ValueError, TypeError):
            raise InvalidToken("malformed token") from None
        # Checked before any key is chosen: refuses `none` and every algorithm not pinned.
        if header.get("alg") not in self._algorithms:
            raise InvalidToken("algorithm not allowed")
        key = self._key_for(header)
        p = self._policy
        try:
            payload = jwt.decode(token, key, algorithms=self._algorithms, options=self._options,
                                 audience=p.audience, issuer=p.issuer, leeway=p.leeway_s)
        except jwt.MissingRequiredClaimError as exc:
            raise InvalidToken(f"missing claim {exc.claim!r}") from None
        except (jwt.PyJWTError, ValueError, TypeError) as exc:
            reason = next((r for cls, r in _REASONS if isinstance(exc, cls)), "invalid token")
            raise InvalidToken(reason) from None  # `from None`: keep pyjwt's text out of logs
        return self._claims(payload)

    def _key_for(self, header: dict[str, Any]) -> jwt.PyJWK | PublicKey | bytes:
        if self._keys.secret is not None:
            return self._keys.secret
        if self._keys.public is not None:
            return self._keys.public
        # A PyJWK binds its own algorithm, so pyjwt also refuses a kid used with another alg.
        # Header-supplied keys (jwk, jku, x5u) are never consulted.
        jwk = self._keys.jwks.get(header.get("kid") or "")
        if jwk is None:
            raise InvalidToken("unknown key id")
        return jwk

    def _claims(self, payload: dict[str, Any]) -> TokenClaims:
        p = self._policy
        account = payload.get(p.account_claim)
        if not isinstance(account, str) or not account:
            raise InvalidToken(f"missing claim {p.account_claim!r}")
        # An account name as keys have them: no ':' (a guest is "guest:<address>", so no token
        # can speak for one), nothing that could split a Redis key or a log line.
        if not _ACCOUNT_RE.fullmatch(account):
            raise InvalidToken(f"bad claim {p.account_claim!r}: not an account name")
        return TokenClaims(account=account, tier=_optional_str(payload, p.tier_claim),
                           role=_optional_str(payload, p.role_claim),
                           token_id=_optional_str(payload, "jti"))


def _optional_str(payload: dict[str, Any], name: str) -> str | None:
    value = payload.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidToken(f"bad claim {name!r}")
    return value
