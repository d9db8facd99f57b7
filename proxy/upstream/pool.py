"""Backends grouped into pools, and the pick of one backend for a request. No I/O.

Pick: the power of two choices on outstanding requests (two weighted random candidates, the one
with fewer requests in flight per unit of weight wins), among backends that are healthy and below
their concurrency cap. When none is, the answer is an immediate 503 with Retry-After rather than
a queue that grows without bound.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Sequence

from proxy.config import CHAT_KINDS, BackendSpec
from proxy.errors import ErrorKind, GatewayError
from proxy.headers import HeaderRule

RETRY_AFTER_S = "1"


class Backend:
    """One upstream server as this worker sees it: its spec and its live counters."""

    __slots__ = ("auth", "base_url", "forward", "healthy", "name", "outstanding", "spec")

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.base_url = spec.url.rstrip("/")
        self.forward = HeaderRule(spec.forward_headers)
        key = os.environ.get(spec.api_key_env, "") if spec.api_key_env else ""
        self.auth = {"authorization": f"Bearer {key}"} if key else {}
        self.outstanding = 0
        self.healthy = True

    @property
    def available(self) -> bool:
        return self.healthy and self.outstanding < self.spec.max_concurrency

    def score(self) -> float:
        return (self.outstanding + 1) / self.spec.weight


class Pool:
    """The backends that can serve one model for one task family."""

    __slots__ = ("backends", "model")

    def __init__(self, model: str, backends: Sequence[Backend]) -> None:
        self.model = model
        self.backends = tuple(backends)

    def pick(self, exclude: Backend | None = None, rng: random.Random | None = None) -> Backend:
        candidates = [b for b in self.backends if b.available and b is not exclude]
        if not candidates:
            raise self._none_available(exclude)
        if len(candidates) == 1:
            return candidates[0]
        choose = (rng or random).choices
        first, second = choose(candidates, weights=[b.spec.weight for b in candidates], k=2)
        return first if first.score() <= second.score() else second

    def _none_available(self, exclude: Backend | None) -> GatewayError:
        others = [b for b in self.backends if b is not exclude]
        if others and all(b.healthy for b in others):
            reason = "all backends are at their concurrency limit"
        else:
            reason = "no healthy backend"
        return GatewayError(
            ErrorKind.UNAVAILABLE,
            f"model {self.model!r} is temporarily unavailable: {reason}",
            headers={"Retry-After": RETRY_AFTER_S},
        )


class Router:
    """Model name -> pool, per task family, built once from backends.toml."""

    def __init__(self, specs: Iterable[BackendSpec]) -> None:
        self.backends = tuple(Backend(spec) for spec in specs)
        by_model: dict[str, list[Backend]] = {}
        for backend in self.backends:
            if backend.spec.kind in CHAT_KINDS:
                for model in backend.spec.models:
                    by_model.setdefault(model, []).append(backend)
        self._chat = {model: Pool(model, group) for model, group in by_model.items()}
        self._all_models = frozenset(m for b in self.backends for m in b.spec.models)

    def chat_pool(self, model: str) -> Pool:
        pool = self._chat.get(model)
        if pool is not None:
            return pool
        if model in self._all_models:
            raise GatewayError(ErrorKind.NOT_FOUND, f"model {model!r} is not a chat model")
        raise GatewayError(ErrorKind.NOT_FOUND, f"model {model!r} does not exist")

    @property
    def chat_models(self) -> list[str]:
        return sorted(self._chat)
