"""Loading: backends.toml and policies/*.toml read from a config folder, checked and turned into
one frozen `Config`; or a `ConfigError` listing every problem as `file: key: message`.
"""

from __future__ import annotations

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

    @property
    def data_dir(self) -> Path:
        return Path(self.root) / self.gateway.data_dir


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
        policies=Policies(**policies),
    )


def load_policies(folder: str | Path) -> Policies:
    """A policies folder alone (a candidate set for `policy replay`): the files and the rules
    within them, as `load_config` checks them; ConfigError lists every fault."""
    problems: list[str] = []
    root = Path(folder).resolve()
    if not root.is_dir():
        raise ConfigError([f"{folder}: not a folder of policy files"])
    policies = _policy_files(root, problems)
    if problems:
        raise ConfigError(problems)
    return Policies(**policies)


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
