"""Verification of signed JWT bearer tokens (DESIGN §6 Keys; reliability K2, RFC 8725).

The algorithms come from policy only, never from the token; one policy is either HMAC or
public-key, never both (mixing them is the HS/RS key-confusion attack). Keys are loaded once.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from jwt.types import Options

from proxy.config import JwtPolicy

_MAX_TOKEN_CHARS = 8192  # bounds the parsing work an unauthenticated caller can ask for
_MAX_ACCOUNT_CHARS = 256  # the account ends up in Redis keys and logs
_JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
# RFC 7518 §3.2: an HMAC key at least as long as the hash output.
_HMAC_MIN_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}
_EC_CURVES = {"ES256": "secp256r1", "ES384": "secp384r1", "ES512": "secp521r1"}
_MIN_RSA_BITS = 2048

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

_PublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey


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


@dataclass
class _Keys:
    secret: bytes | None = None
    public: _PublicKey | None = None
    jwks: dict[str, jwt.PyJWK] = field(default_factory=dict)


def _key_problem(alg: str, key: object) -> str | None:
    if alg.startswith("ES"):
        curve = _EC_CURVES.get(alg, "?")
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != curve:
            return f"{alg} needs an EC public key on {curve}"
    elif not isinstance(key, rsa.RSAPublicKey) or key.key_size < _MIN_RSA_BITS:
        return f"{alg} needs an RSA public key of at least {_MIN_RSA_BITS} bits"
    return None


def _load_secret(policy: JwtPolicy, algs: list[str], keys: _Keys, problems: list[str]) -> None:
    if policy.public_key_file or policy.jwks_file:
        problems.append("jwt: public_key_file/jwks_file are for RS*/ES*/PS* algorithms, not HS*")
    if not policy.secret_env:
        problems.append("jwt.secret_env: HS* algorithms need the name of the environment "
                        "variable that holds the shared secret")
        return
    secret = os.environ.get(policy.secret_env, "").encode()
    need = max(_HMAC_MIN_BYTES[a] for a in algs)
    if not secret:
        problems.append(f"jwt.secret_env: environment variable {policy.secret_env} is unset "
                        "or empty")
    elif len(secret) < need:
        problems.append(f"jwt.secret_env: the secret in {policy.secret_env} is {len(secret)} "
                        f"bytes; {', '.join(algs)} need at least {need}")
    else:
        keys.secret = secret


def _load_pem(path: Path, algs: list[str], keys: _Keys, problems: list[str]) -> None:
    try:
        key: object = load_pem_public_key(path.read_bytes())
    except OSError as exc:
        problems.append(f"jwt.public_key_file: cannot read {path}: {exc.strerror}")
        return
    except (ValueError, TypeError, UnsupportedAlgorithm):
        problems.append(f"jwt.public_key_file: {path} is not a PEM public key")
        return
    found = [p for a in algs if (p := _key_problem(a, key))]
    problems.extend(f"jwt.public_key_file: {path}: {p}" for p in found)
    if not found and isinstance(key, rsa.RSAPublicKey | ec.EllipticCurvePublicKey):
        keys.public = key


def _load_jwks(path: Path, algs: list[str], keys: _Keys, problems: list[str]) -> None:
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        problems.append(f"jwt.jwks_file: cannot read {path}: {exc.strerror}")
        return
    except ValueError:
        problems.append(f"jwt.jwks_file: {path} is not JSON")
        return
    try:
        jwk_set = jwt.PyJWKSet.from_dict(data if isinstance(data, dict) else {})
    except (jwt.PyJWTError, ValueError, TypeError, KeyError):
        jwk_set = None
    for jwk in jwk_set or ():
        # A key is usable only with a kid, for signing, public, and for a pinned algorithm.
        if (jwk.key_id and jwk.public_key_use in (None, "sig") and jwk.algorithm_name in algs
                and _key_problem(jwk.algorithm_name, jwk.key) is None):
            keys.jwks.setdefault(jwk.key_id, jwk)
    if not keys.jwks:
        problems.append(f"jwt.jwks_file: {path} has no usable key (public, with a kid, "
                        f"`alg` or type matching one of {', '.join(algs)})")


def _load_keys(policy: JwtPolicy, config_root: Path) -> tuple[_Keys, list[str]]:
    keys, problems = _Keys(), list[str]()
    algs: list[str] = list(policy.algorithms)
    families = {a[:2] for a in algs}
    if not algs:
        return keys, problems
    if "HS" in families and len(families) > 1:
        problems.append("jwt.algorithms: HS* mixed with RS*/ES*/PS* in one policy is refused "
                        "(it enables HS/RS key confusion); pin one family")
    elif "HS" in families:
        _load_secret(policy, algs, keys, problems)
    elif bool(policy.public_key_file) == bool(policy.jwks_file):
        problems.append("jwt: RS*/ES*/PS* algorithms need exactly one of public_key_file or "
                        "jwks_file")
    elif policy.public_key_file:
        _load_pem(config_root / policy.public_key_file, algs, keys, problems)
    elif policy.jwks_file:
        _load_jwks(config_root / policy.jwks_file, algs, keys, problems)
    return keys, problems


def check_jwt_policy(policy: JwtPolicy, config_root: Path) -> list[str]:
    """Human-readable problems with the JWT policy (for `check-config`); empty when fine."""
    return _load_keys(policy, config_root)[1]


class JwtVerifier:
    def __init__(self, policy: JwtPolicy, config_root: Path) -> None:
        keys, problems = _load_keys(policy, config_root)
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

    def _key_for(self, header: dict[str, Any]) -> jwt.PyJWK | _PublicKey | bytes:
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
        if len(account) > _MAX_ACCOUNT_CHARS:
            raise InvalidToken(f"bad claim {p.account_claim!r}")
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
