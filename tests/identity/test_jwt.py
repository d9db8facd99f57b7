"""JWT bearer verification (reliability K2): valid tokens pass, every forgery is refused."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from proxy.config import JwtPolicy
from proxy.identity.jwt import (
    InvalidToken,
    JwtVerifier,
    TokenClaims,
    check_jwt_policy,
    looks_like_jwt,
)

SECRET = "s" * 32
SECRET64 = "t" * 64
ENV = "GATEWAY_JWT_SECRET"
HS256_HEADER = b'{"alg":"HS256","typ":"JWT"}'


# --- helpers ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def rsa_other() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    base: dict[str, Any] = {"sub": "acct-1", "tier": "pro", "role": "admin", "jti": "tok-9",
                            "iat": now, "exp": now + 300}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def hs_verifier(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **over: Any) -> JwtVerifier:
    monkeypatch.setenv(ENV, SECRET)
    fields: dict[str, Any] = {"algorithms": ["HS256"], "secret_env": ENV}
    fields.update(over)
    return JwtVerifier(JwtPolicy(**fields), tmp_path)


def pem_verifier(tmp_path: Path, key: Any, algorithms: list[str], **over: Any) -> JwtVerifier:
    (tmp_path / "jwt.pem").write_bytes(pem(key))
    policy = JwtPolicy(algorithms=algorithms, public_key_file="jwt.pem", **over)  # type: ignore[arg-type]
    return JwtVerifier(policy, tmp_path)


def refused(verifier: JwtVerifier, token: str) -> str:
    with pytest.raises(InvalidToken) as info:
        verifier.verify(token)
    # No pyjwt exception (whose text may quote the token) is chained for a logger to print.
    exc = info.value
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)
    return info.value.reason


def write_jwks(tmp_path: Path, keys: list[dict[str, Any]]) -> None:
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": keys}))


def rsa_jwk(key: rsa.RSAPrivateKey, kid: str, **extra: Any) -> dict[str, Any]:
    jwk: dict[str, Any] = RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
    return {**jwk, "kid": kid, **extra}


def ec_jwk(key: ec.EllipticCurvePrivateKey, kid: str) -> dict[str, Any]:
    jwk: dict[str, Any] = ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
    return {**jwk, "kid": kid, "alg": "ES256", "use": "sig"}


# --- valid tokens ----------------------------------------------------------------------

def test_hs256_valid(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path)
    assert verifier.enabled
    token = jwt.encode(claims(), SECRET, algorithm="HS256")
    assert verifier.verify(token) == TokenClaims("acct-1", "pro", "admin", "tok-9")


def test_optional_claims_absent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path)
    token = jwt.encode(claims(tier=None, role=None, jti=None, iat=None), SECRET, "HS256")
    assert verifier.verify(token) == TokenClaims("acct-1", None, None, None)


def test_custom_claim_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path, account_claim="acct", tier_claim="plan",
                           role_claim="scope")
    token = jwt.encode(claims(sub=None, acct="a-7", plan="max", scope="user"), SECRET, "HS256")
    assert verifier.verify(token) == TokenClaims("a-7", "max", "user", "tok-9")


@pytest.mark.parametrize("alg", ["RS256", "PS256"])
def test_rsa_pem_valid(tmp_path: Path, rsa_key: rsa.RSAPrivateKey, alg: str) -> None:
    verifier = pem_verifier(tmp_path, rsa_key, [alg], issuer="https://idp", audience="gw")
    token = jwt.encode(claims(iss="https://idp", aud="gw"), rsa_key, algorithm=alg)
    assert verifier.verify(token).account == "acct-1"


def test_es256_pem_valid(tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    verifier = pem_verifier(tmp_path, ec_key, ["ES256"])
    token = jwt.encode(claims(), ec_key, algorithm="ES256")
    assert verifier.verify(token).tier == "pro"


def test_jwks_picks_key_by_kid(tmp_path: Path, rsa_key: rsa.RSAPrivateKey,
                               rsa_other: rsa.RSAPrivateKey,
                               ec_key: ec.EllipticCurvePrivateKey) -> None:
    write_jwks(tmp_path, [rsa_jwk(rsa_key, "r1", alg="RS256"), rsa_jwk(rsa_other, "r2"),
                          ec_jwk(ec_key, "e1")])
    verifier = JwtVerifier(JwtPolicy(algorithms=["RS256", "ES256"], jwks_file="jwks.json"),
                           tmp_path)
    signers: list[tuple[rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, str, str]] = [
        (rsa_key, "r1", "RS256"), (rsa_other, "r2", "RS256"), (ec_key, "e1", "ES256")]
    for key, kid, alg in signers:
        token = jwt.encode(claims(sub=kid), key, algorithm=alg, headers={"kid": kid})
        assert verifier.verify(token).account == kid
    # Right kid, wrong signer; a kid whose key is for another algorithm; no kid; unknown kid.
    wrong = jwt.encode(claims(), rsa_other, algorithm="RS256", headers={"kid": "r1"})
    assert refused(verifier, wrong) == "bad signature"
    cross = jwt.encode(claims(), ec_key, algorithm="ES256", headers={"kid": "r1"})
    assert refused(verifier, cross) == "algorithm not allowed"
    assert refused(verifier, jwt.encode(claims(), rsa_key, algorithm="RS256")) == "unknown key id"
    unknown = jwt.encode(claims(), rsa_key, algorithm="RS256", headers={"kid": "nope"})
    assert refused(verifier, unknown) == "unknown key id"


# --- attacks ---------------------------------------------------------------------------

@pytest.mark.parametrize("alg", ["none", "None", "NONE", ""])
def test_alg_none_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                          rsa_key: rsa.RSAPrivateKey, alg: str) -> None:
    unsigned = f"{b64(json.dumps({'alg': alg, 'typ': 'JWT'}).encode())}." \
               f"{b64(json.dumps(claims()).encode())}."
    assert looks_like_jwt(unsigned)
    assert refused(hs_verifier(monkeypatch, tmp_path), unsigned) == "algorithm not allowed"
    assert refused(pem_verifier(tmp_path, rsa_key, ["RS256"]), unsigned) == "algorithm not allowed"


def test_hs_rs_confusion_refused(tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    # The attacker signs HS256 with the (public) RSA PEM as the HMAC secret; pyjwt itself
    # will not sign with a PEM secret, so the token is built by hand.
    signing_input = f"{b64(HS256_HEADER)}.{b64(json.dumps(claims()).encode())}"
    mac = hmac.new(pem(rsa_key), signing_input.encode(), hashlib.sha256).digest()
    forged = f"{signing_input}.{b64(mac)}"
    assert refused(pem_verifier(tmp_path, rsa_key, ["RS256"]), forged) == "algorithm not allowed"


def test_mixed_families_refused_at_construction(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path,
                                                 rsa_key: rsa.RSAPrivateKey) -> None:
    monkeypatch.setenv(ENV, SECRET)
    (tmp_path / "jwt.pem").write_bytes(pem(rsa_key))
    policy = JwtPolicy(algorithms=["RS256", "HS256"], secret_env=ENV, public_key_file="jwt.pem")
    with pytest.raises(ValueError, match="key confusion"):
        JwtVerifier(policy, tmp_path)
    assert any("key confusion" in p for p in check_jwt_policy(policy, tmp_path))


def test_expired(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path, leeway_s=30)
    now = int(time.time())
    beyond = jwt.encode(claims(exp=now - 60, iat=now - 600), SECRET, "HS256")
    assert refused(verifier, beyond) == "token expired"
    within = jwt.encode(claims(exp=now - 10, iat=now - 600), SECRET, "HS256")
    assert verifier.verify(within).account == "acct-1"
    strict = hs_verifier(monkeypatch, tmp_path, leeway_s=0)
    assert refused(strict, within) == "token expired"


def test_not_yet_valid(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path, leeway_s=30)
    now = int(time.time())
    future = jwt.encode(claims(nbf=now + 300), SECRET, "HS256")
    assert refused(verifier, future) == "token not yet valid"
    assert verifier.verify(jwt.encode(claims(nbf=now + 10), SECRET, "HS256"))  # within leeway
    issued_later = jwt.encode(claims(iat=now + 300), SECRET, "HS256")
    assert refused(verifier, issued_later) == "token not yet valid"


def test_audience_and_issuer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path, issuer="https://idp", audience="gw")
    ok = claims(iss="https://idp", aud="gw")
    assert verifier.verify(jwt.encode(ok, SECRET, "HS256")).account == "acct-1"
    cases = {"wrong audience": {**ok, "aud": "other"}, "wrong issuer": {**ok, "iss": "evil"},
             "missing claim 'aud'": {k: v for k, v in ok.items() if k != "aud"},
             "missing claim 'iss'": {k: v for k, v in ok.items() if k != "iss"}}
    for reason, payload in cases.items():
        assert refused(verifier, jwt.encode(payload, SECRET, "HS256")) == reason
    # With no audience configured, a token minted for some other audience is refused too.
    plain = hs_verifier(monkeypatch, tmp_path)
    assert refused(plain, jwt.encode(ok, SECRET, "HS256")) == "wrong audience"


def test_missing_exp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path)
    assert refused(verifier, jwt.encode(claims(exp=None), SECRET, "HS256")) == \
        "missing claim 'exp'"


def test_tampered_payload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                          rsa_key: rsa.RSAPrivateKey) -> None:
    head, _, sig = jwt.encode(claims(), SECRET, "HS256").split(".")
    forged = f"{head}.{b64(json.dumps(claims(tier='max')).encode())}.{sig}"
    assert refused(hs_verifier(monkeypatch, tmp_path), forged) == "bad signature"
    head, _, sig = jwt.encode(claims(), rsa_key, "RS256").split(".")
    forged = f"{head}.{b64(json.dumps(claims(tier='max')).encode())}.{sig}"
    assert refused(pem_verifier(tmp_path, rsa_key, ["RS256"]), forged) == "bad signature"


def test_wrong_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token = jwt.encode(claims(), "x" * 32, "HS256")
    assert refused(hs_verifier(monkeypatch, tmp_path), token) == "bad signature"


def test_algorithm_not_pinned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                              ec_key: ec.EllipticCurvePrivateKey,
                              rsa_key: rsa.RSAPrivateKey) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path)
    assert refused(verifier, jwt.encode(claims(), SECRET64, "HS512")) == "algorithm not allowed"
    rs = pem_verifier(tmp_path, rsa_key, ["RS256"])
    assert refused(rs, jwt.encode(claims(), rsa_key, "PS256")) == "algorithm not allowed"
    assert refused(rs, jwt.encode(claims(), ec_key, "ES256")) == "algorithm not allowed"


@pytest.mark.parametrize("payload, reason", [
    ({"sub": None}, "missing claim 'sub'"),
    ({"sub": ""}, "missing claim 'sub'"),
    ({"sub": "a" * 300}, "bad claim 'sub': not an account name"),
    # A guest's account, and names that would split a Redis key or a log line: never accounts.
    ({"sub": "guest:127.0.0.1"}, "bad claim 'sub': not an account name"),
    ({"sub": "alice}:task:x"}, "bad claim 'sub': not an account name"),
    ({"sub": "<script>"}, "bad claim 'sub': not an account name"),
    ({"sub": "a" * 65}, "bad claim 'sub': not an account name"),
    ({"tier": 3}, "bad claim 'tier'"),
    ({"role": ["admin"]}, "bad claim 'role'"),
])
def test_bad_account_and_claims(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                payload: dict[str, Any], reason: str) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path)
    assert refused(verifier, jwt.encode(claims(**payload), SECRET, "HS256")) == reason


def test_non_string_account_claim(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verifier = hs_verifier(monkeypatch, tmp_path, account_claim="acct")
    token = jwt.encode(claims(acct=42), SECRET, "HS256")
    assert refused(verifier, token) == "missing claim 'acct'"


MARKER = "CANARYzzTOKEN"


@pytest.mark.parametrize("token", [
    "", "abc", "a.b.c", "...", "eyJ.eyJ.", "é.é.é", f"{MARKER}.{MARKER}.{MARKER}",
    f"{b64(b'[1,2]')}.{b64(b'{}')}.", f"{b64(HS256_HEADER)}.{b64(b'[1]')}.AAAA",
    f"{b64(json.dumps({'alg': 'HS256', 'kid': MARKER}).encode())}.{b64(b'not json')}.AAAA",
    "a" * 10_000,
], ids=lambda t: t[:24])
def test_garbage_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, token: str) -> None:
    reason = refused(hs_verifier(monkeypatch, tmp_path), token)
    assert MARKER not in reason


def test_disabled(tmp_path: Path) -> None:
    verifier = JwtVerifier(JwtPolicy(), tmp_path)
    assert not verifier.enabled
    assert refused(verifier, jwt.encode(claims(), SECRET, "HS256")) == \
        "bearer tokens are not enabled"
    assert check_jwt_policy(JwtPolicy(), tmp_path) == []


# --- construction and check_jwt_policy -------------------------------------------------

@pytest.mark.parametrize("value, algs, fragment", [
    (None, ["HS256"], "unset or empty"),
    ("", ["HS256"], "unset or empty"),
    ("short", ["HS256"], "at least 32"),
    ("s" * 32, ["HS256", "HS512"], "at least 64"),
])
def test_secret_problems(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                         value: str | None, algs: list[str], fragment: str) -> None:
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    policy = JwtPolicy(algorithms=algs, secret_env=ENV)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=fragment):
        JwtVerifier(policy, tmp_path)
    problems = check_jwt_policy(policy, tmp_path)
    assert len(problems) == 1 and ENV in problems[0]
    assert "s" * 32 not in problems[0]  # never the secret itself


def test_check_policy_problems(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                               rsa_key: rsa.RSAPrivateKey,
                               ec_key: ec.EllipticCurvePrivateKey) -> None:
    def problems(**fields: Any) -> str:
        found = check_jwt_policy(JwtPolicy(**fields), tmp_path)
        assert found, fields
        return " | ".join(found)

    assert "secret_env" in problems(algorithms=["HS256"])
    assert "cannot read" in problems(algorithms=["RS256"], public_key_file="missing.pem")
    assert "exactly one" in problems(algorithms=["RS256"])
    (tmp_path / "jwt.pem").write_bytes(pem(rsa_key))
    assert "exactly one" in problems(algorithms=["RS256"], public_key_file="jwt.pem",
                                     jwks_file="jwks.json")
    assert "EC public key" in problems(algorithms=["ES256"], public_key_file="jwt.pem")
    (tmp_path / "priv.pem").write_bytes(rsa_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    assert "not a PEM public key" in problems(algorithms=["RS256"], public_key_file="priv.pem")
    (tmp_path / "small.pem").write_bytes(pem(rsa.generate_private_key(65537, 1024)))
    assert "2048" in problems(algorithms=["RS256"], public_key_file="small.pem")
    assert "cannot read" in problems(algorithms=["RS256"], jwks_file="missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    assert "not JSON" in problems(algorithms=["RS256"], jwks_file="bad.json")
    # JWKS without usable keys: empty, no kid, encryption-only, only for other algorithms.
    for keys in ([], [rsa_jwk(rsa_key, "")], [rsa_jwk(rsa_key, "r", use="enc")],
                 [ec_jwk(ec_key, "e")], [{"kty": "oct", "k": b64(b"k" * 32), "kid": "h"}]):
        write_jwks(tmp_path, keys)
        assert "no usable key" in problems(algorithms=["RS256"], jwks_file="jwks.json")
    monkeypatch.setenv(ENV, SECRET)
    assert "not HS" in problems(algorithms=["HS256"], secret_env=ENV, public_key_file="jwt.pem")
    # Good configs have no problems.
    write_jwks(tmp_path, [rsa_jwk(rsa_key, "r")])
    assert check_jwt_policy(JwtPolicy(algorithms=["RS256"], jwks_file="jwks.json"), tmp_path) == []
    assert check_jwt_policy(JwtPolicy(algorithms=["RS256"], public_key_file="jwt.pem"),
                            tmp_path) == []
    assert check_jwt_policy(JwtPolicy(algorithms=["HS256"], secret_env=ENV), tmp_path) == []


def test_looks_like_jwt(monkeypatch: pytest.MonkeyPatch) -> None:
    assert looks_like_jwt(jwt.encode(claims(), SECRET, "HS256"))
    assert looks_like_jwt("eyJh.eyJi.")  # unsigned: still routed to the verifier and refused
    for not_jwt in ["igw_sk_0123456789abcdefABCDEF", "", "a.b", "a.b.c.d", "a b.c.d",
                    "a.b.c\n", ".b.c", "a..c", "a+b.c.d", "a=.b.c"]:
        assert not looks_like_jwt(not_jwt), not_jwt
