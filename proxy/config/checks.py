"""The config's cross-field rules: what a file's schema cannot say alone (unique names, usable
URLs, pools big enough for network mode, a hold outliving every request ...). Each check returns
its problems as `file: key: message` lines; an empty list is a pass.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from proxy.config.backends import BackendsFile, BackendSpec, MediaSection, UpstreamSection
from proxy.config.policies import (
    ANY_GROUP,
    STANDARD_GROUP,
    FetchPolicy,
    NetworkPolicy,
    PricesPolicy,
    TiersPolicy,
)
from proxy.config.vocabulary import EMBED_KINDS, FAMILY_OF_KIND, VOICE_PRESETS
from proxy.headers import NEVER_FORWARDED


def check_backends(file: BackendsFile) -> list[str]:
    """Rules that span fields: unique names, usable URLs, readable key variables."""
    problems: list[str] = []
    seen: set[str] = set()
    for i, backend in enumerate(file.backends):
        where = f"backends.toml: backends[{i}]"
        if backend.name in seen:
            problems.append(f"{where}.name: duplicate backend name {backend.name!r}")
        seen.add(backend.name)
        url = urlsplit(backend.url)
        if url.scheme not in ("http", "https") or not url.hostname:
            problems.append(f"{where}.url: must be an http:// or https:// URL with a host")
        elif url.query or url.fragment or url.username or url.password:
            problems.append(f"{where}.url: must not carry a query, fragment or credentials")
        for name in backend.forward_headers:
            if name.rstrip("*").lower() in NEVER_FORWARDED | {""}:
                problems.append(f"{where}.forward_headers: {name!r} may never be forwarded")
        for preset in backend.voices:
            if preset not in VOICE_PRESETS:
                problems.append(f"{where}.voices: {preset!r} is not a preset "
                                f"({', '.join(VOICE_PRESETS)})")
        problems.extend(_check_modes(backend, where))
        if backend.health_path and not backend.health_path.startswith("/"):
            problems.append(f"{where}.health_path: must start with '/' (or be \"\" for none)")
        problems.extend(_check_supervised(backend, where))
        if backend.kv_events is not None and backend.kind != "vllm":
            problems.append(f"{where}.kv_events: only vLLM publishes KV-cache events")
        elif backend.kv_events is not None and backend.kv_events.startswith("tcp://*:"):
            problems.append(f"{where}.kv_events: name the engine's host (tcp://*:port is "
                            "what the engine binds; the gateway connects to it)")
    problems.extend(_check_fleet_sections(file))
    return problems


def _check_modes(backend: BackendSpec, where: str) -> list[str]:
    problems = []
    if len(set(backend.modes)) != len(backend.modes):
        problems.append(f"{where}.modes: lists a mode twice")
    if "network" in backend.modes and backend.serves == "asr":
        problems.append(f"{where}.modes: speech recognition is direct-only (DESIGN §6)")
    if "network" in backend.modes and backend.serves == "embed":
        problems.append(f"{where}.modes: embeddings are direct-only (no two engines' vectors "
                        "are equal to compare)")
    allowed = {FAMILY_OF_KIND[backend.kind]} | ({"embed"} if backend.kind in EMBED_KINDS
                                                 else set())
    if backend.family is not None and backend.family not in allowed:
        problems.append(f"{where}.family: a {backend.kind!r} backend serves "
                        + " or ".join(map(repr, sorted(allowed))))
    return problems


def _check_supervised(backend: BackendSpec, where: str) -> list[str]:
    if backend.command is None:
        if backend.env or backend.cwd is not None:
            return [f"{where}: env and cwd apply only to a backend with a command"]
        return []
    problems = []
    if not backend.command:
        problems.append(f"{where}.command: must name the program to run")
    for key in backend.env:
        if not key or "=" in key or "\0" in key:
            problems.append(f"{where}.env: {key!r} is not an environment variable name")
    return problems


def _check_fleet_sections(file: BackendsFile) -> list[str]:
    problems = []
    if file.health.ejection_base_s > file.health.ejection_max_s:
        problems.append("backends.toml: health.ejection_base_s: must not exceed ejection_max_s")
    if file.supervisor.backoff_base_s > file.supervisor.backoff_max_s:
        problems.append("backends.toml: supervisor.backoff_base_s: must not exceed backoff_max_s")
    # A port two supervised backends both listen on: one of them could never start.
    started: dict[tuple[str | None, int], str] = {}
    for i, backend in enumerate(file.backends):
        if backend.command is None:
            continue
        url = urlsplit(backend.url)
        address = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
        if address in started:
            problems.append(f"backends.toml: backends[{i}].url: the same address as "
                            f"{started[address]!r}, also started by the gateway")
        started.setdefault(address, backend.name)
    return problems


def check_network_mode(network: NetworkPolicy) -> list[str]:
    if network.quorum is not None and network.quorum > network.replicas:
        return [f"policies/requests.toml: network.quorum: must not exceed network.replicas "
                f"({network.quorum} > {network.replicas}): no answer could ever be agreed"]
    return []


def check_network_pools(specs: list[BackendSpec], network: NetworkPolicy) -> list[str]:
    """A network pool smaller than `replicas` could never run a request: every one would 503."""
    serving: dict[str, list[str]] = {}
    for spec in specs:
        if "network" in spec.modes:
            for model in spec.models:
                serving.setdefault(model, []).append(spec.name)
    return [f"backends.toml: model {model!r} is offered in network mode by {len(names)} "
            f"backend(s) ({', '.join(names)}), fewer than policies/requests.toml "
            f"network.replicas ({network.replicas})"
            for model, names in serving.items() if len(names) < network.replicas]


def check_routing(backends: BackendsFile) -> list[str]:
    """A per-model pick must name a chat model some backend serves (a typo would do nothing)."""
    chat = {m for s in backends.backends if s.serves == "chat" for m in s.models}
    return [f"backends.toml: routing.models: {model!r} is not a chat model of any backend"
            for model in backends.routing.models if model not in chat]


def check_media(media: MediaSection) -> list[str]:
    if media.store == "s3" and media.bucket is None:
        return ["backends.toml: media.bucket: the s3 store needs a bucket"]
    return []


def check_request_life(upstream: UpstreamSection, prices: PricesPolicy) -> list[str]:
    """A request must end before its hold can expire: the sweeper would release a hold whose
    stream is still running, and that stream would be free."""
    longest = upstream.longest_request_s
    if longest >= prices.hold_ttl_s:
        return [f"policies/prices.toml: hold_ttl_s: must exceed the longest a request may run, "
                f"2 x (connect_timeout_s + first_byte_timeout_s) + max_stream_s from "
                f"backends.toml [upstream] ({longest:.0f} s)"]
    return []


def check_networks(fetch: FetchPolicy) -> list[str]:
    problems = []
    for network in fetch.allow_networks:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError:
            problems.append(f"policies/requests.toml: fetch.allow_networks: {network!r} is not "
                            "a network (e.g. 10.1.2.0/24)")
    return problems


def check_tiers(tiers: TiersPolicy) -> list[str]:
    where = "policies/tiers.toml"
    problems: list[str] = []
    if "guest" not in tiers.tiers:
        problems.append(f"{where}: tiers.guest: the guest tier is required (callers without keys)")
    known = set(tiers.groups) | {STANDARD_GROUP, ANY_GROUP}
    for name, tier in tiers.tiers.items():
        for group in tier.models:
            if group not in known:
                problems.append(f"{where}: tiers.{name}.models.{group}: unknown model group")
        for group in tier.group_tokens:
            if group not in known - {ANY_GROUP}:
                problems.append(f"{where}: tiers.{name}.group_tokens.{group}: unknown model "
                                "group (the tier's own limits count every model)")
    owner: dict[str, str] = {}
    for group, models in tiers.groups.items():
        if group in (STANDARD_GROUP, ANY_GROUP):
            problems.append(f"{where}: groups.{group}: reserved group name")
        for model in models:
            if model in owner:
                problems.append(f"{where}: groups.{group}: {model!r} is already in "
                                f"{owner[model]!r}")
            owner[model] = group
    return problems
