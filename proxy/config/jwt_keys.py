"""The JWT policy's key material (auth.toml [jwt]), loaded and checked: an HMAC secret from the
environment, a PEM public key, or a JWKS file (DESIGN §6 Keys; reliability K2, RFC 8725).

One policy is either HMAC or public-key, never both (mixing them is the HS/RS key-confusion
attack); every key must fit every pinned algorithm. `check-config` reports the problems found
here, and `proxy.identity.jwt.JwtVerifier` verifies with the keys. PyJWT and cryptography load
with this module, which the loader imports only when JWT algorithms are configured.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from proxy.config.policies import JwtPolicy

# RFC 7518 §3.2: an HMAC key at least as long as the hash output.
_HMAC_MIN_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}
_EC_CURVES = {"ES256": "secp256r1", "ES384": "secp384r1", "ES512": "secp521r1"}
_MIN_RSA_BITS = 2048

PublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey


@dataclass
class JwtKeys:
    """What tokens are verified with: one of a secret, a public key, or JWKS keys by `kid`."""

    secret: bytes | None = None
    public: PublicKey | None = None
    jwks: dict[str, jwt.PyJWK] = field(default_factory=dict)


def _key_problem(alg: str, key: object) -> str | None:
    if alg.startswith("ES"):
        curve = _EC_CURVES.get(alg, "?")
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != curve:
            return f"{alg} needs an EC public key on {curve}"
    elif not isinstance(key, rsa.RSAPublicKey) or key.key_size < _MIN_RSA_BITS:
        return f"{alg} needs an RSA public key of at least {_MIN_RSA_BITS} bits"
    return None


def _load_secret(policy: JwtPolicy, algs: list[str], keys: JwtKeys, problems: list[str]
                 ) -> None:
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


def _load_pem(path: Path, algs: list[str], keys: JwtKeys, problems: list[str]) -> None:
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


def _load_jwks(path: Path, algs: list[str], keys: JwtKeys, problems: list[str]) -> None:
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


def load_jwt_keys(policy: JwtPolicy, config_root: Path) -> tuple[JwtKeys, list[str]]:
    """The policy's keys, and every problem with them (`jwt.<key>: message` lines)."""
    keys, problems = JwtKeys(), list[str]()
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
    return load_jwt_keys(policy, config_root)[1]
