"""Loading: backends.toml and policies/*.toml read from a config folder, checked and turned into
one frozen `Config`; or a `ConfigError` listing every problem as `file: key: message`.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from proxy.config.backends import (
    AlertsSection,
    BackendsFile,
    BackendSpec,
    GatewaySection,
    HealthSection,
    MediaSection,
    RoutingSection,
    ServerSection,
    SupervisorSection,
    TelemetrySection,
    UpstreamSection,
)
from proxy.config.checks import (
    check_backends,
    check_media,
    check_network_mode,
    check_network_pools,
    check_networks,
    check_request_life,
    check_routing,
    check_tiers,
)
from proxy.config.policies import POLICY_FILES, Policies, PricesPolicy, RequestsPolicy
from proxy.config.vocabulary import Section
from proxy.validate import RequestInvalid, validate


class Config(Section, frozen=True):
    root: str
    gateway: GatewaySection
    server: ServerSection
    upstream: UpstreamSection
    health: HealthSection
    supervisor: SupervisorSection
    routing: RoutingSection
    media: MediaSection
    alerts: AlertsSection
    telemetry: TelemetrySection | None
    backends: tuple[BackendSpec, ...]
    policies: Policies
    shadow: ShadowPolicies | None = None  # policies/shadow/, when it holds any file

    @property
    def data_dir(self) -> Path:
        return Path(self.root) / self.gateway.data_dir


# What a shadow set may change: the files whose decisions it judges (access, limits, queue
# budgets, prices). Identity and request caps are the live ones' alone.
SHADOW_FILES = ("tiers.toml", "prices.toml")


class ShadowPolicies(Section, frozen=True):
    """policies/shadow/: a candidate tiers.toml and/or prices.toml, judged on every request
    beside the live ones and never enforced (proxy.policy.shadow); a file it lacks is the live
    one."""

    policies: Policies
    files: tuple[str, ...]
    # Of the live and the shadow tiers and prices: a change to either starts new tallies.
    fingerprint: str


class ConfigError(Exception):
    """Every problem found in the config folder, one `file: key: message` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


S = TypeVar("S", bound=msgspec.Struct)


def load_config(folder: str | Path = ".") -> Config:
    """Read backends.toml and policies/*.toml from `folder`; ConfigError lists every fault."""
    root = Path(folder).resolve()
    problems: list[str] = []

    backends_path = root / "backends.toml"
    backends = _load_file(backends_path, "backends.toml", BackendsFile, problems)
    if backends is not None:
        problems.extend(check_backends(backends))

    policies = _policy_files(root / "policies", problems)
    if backends is not None:
        problems.extend(check_network_pools(
            backends.backends, policies.get("requests", RequestsPolicy()).network))
        problems.extend(check_routing(backends))
        problems.extend(check_media(backends.media))
    if "auth" in policies and policies["auth"].jwt.algorithms:
        # PyJWT and cryptography load only where JWTs are configured (~10 MB).
        from proxy.config.jwt_keys import check_jwt_policy

        problems.extend(f"policies/auth.toml: jwt: {p}"
                        for p in check_jwt_policy(policies["auth"].jwt, root))
    if backends is not None:
        problems.extend(check_request_life(backends.upstream,
                                            policies.get("prices", PricesPolicy())))
    live = Policies(**policies)
    shadow = _shadow(root / "policies" / "shadow", live, problems)
    if backends is not None and shadow is not None and "prices.toml" in shadow.files:
        problems.extend(_in_shadow(check_request_life(backends.upstream,
                                                      shadow.policies.prices)))
    if problems or backends is None:
        raise ConfigError(problems)
    return Config(
        root=str(root),
        gateway=backends.gateway,
        server=backends.server,
        upstream=backends.upstream,
        health=backends.health,
        supervisor=backends.supervisor,
        routing=backends.routing,
        media=backends.media,
        alerts=backends.alerts,
        telemetry=backends.telemetry,
        backends=tuple(backends.backends),
        policies=live,
        shadow=shadow,
    )


def load_policies(folder: str | Path, under: str | Path | None = None) -> Policies:
    """A policies folder alone (a candidate set for `policy replay`): the files and the rules
    within them, as `load_config` checks them; a file it lacks is `under`'s (a live policies
    folder, e.g. for a shadow set), if that folder exists, else the defaults. ConfigError
    lists every fault."""
    problems: list[str] = []
    root = Path(folder).resolve()
    if not root.is_dir():
        raise ConfigError([f"{folder}: not a folder of policy files"])
    policies = _policy_files(root, problems)
    if under is not None and Path(under).is_dir() and Path(under).resolve() != root:
        policies = {**_policy_files(Path(under), problems), **policies}
    if problems:
        raise ConfigError(problems)
    return Policies(**policies)


def _shadow(folder: Path, live: Policies, problems: list[str]) -> ShadowPolicies | None:
    """policies/shadow/ over the live policies; None when it holds no policy file."""
    if not folder.is_dir():
        return None
    found: dict[str, Any] = {}
    files = []
    for path in sorted(folder.glob("*.toml")):
        label = f"policies/shadow/{path.name}"
        if path.name not in SHADOW_FILES:
            problems.append(f"{label}: a shadow set holds only {' and '.join(SHADOW_FILES)} "
                            f"(what it judges: access, limits, queue budgets, prices); "
                            f"{path.name} is the live policies' alone")
            continue
        loaded = _load_file(path, label, POLICY_FILES[path.name], problems)
        if loaded is not None:
            found[path.stem] = loaded
            files.append(path.name)
    if "tiers" in found:
        problems.extend(_in_shadow(check_tiers(found["tiers"])))
    if not files:
        return None
    shadow = msgspec.structs.replace(live, **found)
    both = msgspec.json.encode((live.tiers, live.prices, shadow.tiers, shadow.prices))
    return ShadowPolicies(shadow, tuple(files), hashlib.sha256(both).hexdigest()[:16])


def _in_shadow(problems: list[str]) -> list[str]:
    """A live file's problems as the shadow set's file's ("policies/shadow/tiers.toml: ...")."""
    return [f"policies/shadow/{p.removeprefix('policies/')}" for p in problems]


def _policy_files(folder: Path, problems: list[str]) -> dict[str, Any]:
    """policies/*.toml by file stem, each checked; faults added to `problems`."""
    policies: dict[str, Any] = {}
    if folder.is_dir():
        for path in sorted(folder.glob("*.toml")):
            label = f"policies/{path.name}"
            schema = POLICY_FILES.get(path.name)
            if schema is None:
                known = ", ".join(sorted(POLICY_FILES))
                problems.append(f"{label}: unknown policy file (known: {known})")
                continue
            loaded = _load_file(path, label, schema, problems)
            if loaded is not None:
                policies[path.stem] = loaded
    if "tiers" in policies:
        problems.extend(check_tiers(policies["tiers"]))
    if "requests" in policies:
        problems.extend(check_networks(policies["requests"].fetch))
        problems.extend(check_network_mode(policies["requests"].network))
    return policies


def _load_file(path: Path, label: str, schema: type[S], problems: list[str]) -> S | None:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(f"{label}: file not found in {path.parent}")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{label}: cannot read: {exc.__class__.__name__}")
        return None
    except tomllib.TOMLDecodeError as exc:
        problems.append(f"{label}: not valid TOML: {exc}")
        return None
    try:
        return validate(data, schema)
    except RequestInvalid as exc:
        for item in exc.detail:
            problems.append(f"{label}: {_key_path(item['loc'])}: {item['msg']}")
        return None


def _key_path(loc: object) -> str:
    parts = list(loc) if isinstance(loc, list | tuple) else []
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"
