"""Backends grouped into pools, built once from backends.toml: (task family, model, mode) ->
the pool that serves it, image and video backends also by their provider. No I/O."""

from __future__ import annotations

from collections.abc import Iterable

from proxy.config import BackendSpec, HealthSection, RoutingSection
from proxy.errors import ErrorKind, GatewayError
from proxy.policy.tiers import FAMILY_NAMES
from proxy.upstream.pool import MODES, Backend, Pool


class Router:
    """(task family, model name, mode) -> pool, built once from backends.toml; image and video
    backends are also found by their provider (the `<provider>` of their routes, direct mode)."""

    def __init__(self, specs: Iterable[BackendSpec], health: HealthSection | None = None,
                 routing: RoutingSection | None = None) -> None:
        r = routing or RoutingSection()
        queued = r.engine_queue if r.dispatch else 0
        self.backends = tuple(Backend(spec, health, queued) for spec in specs)
        grouped: dict[tuple[str, str, str], list[Backend]] = {}
        self._providers: dict[tuple[str, str], list[Backend]] = {}
        for backend in self.backends:
            family = backend.spec.serves
            modes = [mode for mode in MODES if mode in backend.spec.modes]  # in MODES' order
            for model in backend.spec.models:
                for mode in modes:
                    grouped.setdefault((family, model, mode), []).append(backend)
            if family in ("image", "video") and "direct" in modes:
                provider = backend.spec.provider or backend.name
                self._providers.setdefault((family, provider), []).append(backend)
        # Chat pools pick by [routing]; the other families' servers publish no load figures.
        self._pools = {key: Pool(key[1], group,
                                 r.models.get(key[1], r.pick) if key[0] == "chat" else "p2c", r,
                                 key="/".join(key))
                       for key, group in grouped.items()}
        self._by_key = {pool.key: pool for pool in self._pools.values()}
        for backend in self.backends:  # the ejection cap is counted per pool
            backend.peers = tuple(pool.backends for pool in self._pools.values()
                                  if backend in pool.backends)
        self._families = {model: family for family, model, _ in self._pools}
        self._offered = {(family, model) for family, model, _ in self._pools}
        offered_in: dict[str, set[str]] = {}
        for _, model, offered in self._pools:
            offered_in.setdefault(model, set()).add(offered)
        self._modes = {model: [m for m in MODES if m in modes]
                       for model, modes in offered_in.items()}

    def by_key(self, key: str) -> Pool | None:
        """The pool named `key` (`Pool.key`) in this gateway's backends.toml."""
        return self._by_key.get(key)

    @property
    def prefix_pools(self) -> list[Pool]:
        """The pools that match prompts to their replicas' caches."""
        return [pool for pool in self._pools.values() if pool.index is not None]

    def chat_pool(self, model: str) -> Pool:
        return self.pool("chat", model)

    def pool(self, family: str, model: str, mode: str = "direct") -> Pool:
        """404 for a model no backend serves, serves for another task family, or does not
        offer in `mode`."""
        pool = self._pools.get((family, model, mode))
        if pool is not None:
            return pool
        if (family, model) in self._offered:
            raise GatewayError(ErrorKind.NOT_FOUND,
                               f"model {model!r} is not offered in {mode} mode")
        if model in self._families:
            raise GatewayError(ErrorKind.NOT_FOUND, f"model {model!r} is not a "
                               f"{FAMILY_NAMES[family]} model")
        raise GatewayError(ErrorKind.NOT_FOUND, f"model {model!r} does not exist")

    def require(self, family: str, model: str) -> None:
        """404 unless some backend serves `model` for `family` (in any mode)."""
        if (family, model) not in self._offered:
            self.pool(family, model)  # raises the 404 that says why

    def has_pool(self, family: str, model: str, mode: str) -> bool:
        return (family, model, mode) in self._pools

    def modes(self, model: str) -> list[str]:
        """The modes `model` is offered in, "direct" first; [] for an unknown model."""
        return list(self._modes.get(model, ()))

    def provider_pool(self, family: str, provider: str, model: str | None) -> Pool:
        """The pool of `provider`'s backends serving `model` (default: its first model)."""
        backends = self._providers.get((family, provider))
        if backends is None:
            raise GatewayError(ErrorKind.NOT_FOUND, f"no {FAMILY_NAMES[family]} provider "
                               f"named {provider!r}")
        model = model if model is not None else backends[0].spec.models[0]
        serving = [b for b in backends if model in b.spec.models]
        if not serving:
            raise GatewayError(ErrorKind.NOT_FOUND,
                               f"provider {provider!r} does not serve model {model!r}")
        return Pool(model, serving, key=f"{family}/{provider}/{model}")

    def providers(self, family: str) -> list[str]:
        return sorted(p for f, p in self._providers if f == family)

    def models(self, family: str) -> list[str]:
        """The family's models, in whatever modes they are offered."""
        return sorted({model for f, model, _ in self._pools if f == family})

    @property
    def chat_models(self) -> list[str]:
        return self.models("chat")
