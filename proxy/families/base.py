"""What every task family provides to the request path, and the context its work runs in.

A family reads its request (`parse`: 422), names its pool (`pool`: 404), states the worst case
its hold covers (`Job.worst`), and, once admitted, produces the answer (`produce`): fetch what
the client named, call the upstream, check or convert the answer, and count what was used. The
request path sends it (`run`); an async task stores it (proxy.tasks) — the same work either way,
so `produce` needs no client connection, only a `Ctx`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.config import Policies
from proxy.credits.meter import Result
from proxy.credits.pricing import Units
from proxy.errors import validation_failed
from proxy.http.body import read_json
from proxy.upstream.client import Upstreams
from proxy.upstream.early import Early
from proxy.upstream.fetch import MediaFetcher
from proxy.upstream.pool import Pool
from proxy.upstream.queue import Ticket
from proxy.upstream.relay import send_whole
from proxy.upstream.router import Router
from proxy.validate import RequestInvalid


@dataclass(frozen=True, slots=True)
class Ctx:
    """What the work after admission needs, with or without a client connection: the worker's
    long-lived objects, the one policy snapshot the request runs under, the request id (sent
    upstream), the client's headers (backends' `forward_headers` pick from them), its place
    in the queue for an engine slot (proxy.upstream.dispatch), and the slot taken while it
    was admitted, for its first upstream call."""

    policies: Policies
    router: Router
    upstreams: Upstreams
    fetcher: MediaFetcher
    request_id: str
    client_headers: Mapping[str, str]
    ticket: Ticket | None = None
    early: Early | None = None


@dataclass(slots=True)
class Job:
    """A parsed request of one family: what admission and routing need."""

    request: Any  # the family's parsed request (Speech, Transcription, or the passed body)
    model: str | None
    mode: str
    async_: bool
    worst: Units  # what the hold covers
    provider: str | None = None  # image and video: the route's <provider>


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer and what it used."""

    body: bytes
    content_type: str
    used: Units
    headers: Mapping[str, str] = field(default_factory=dict)


class Family(abc.ABC):
    """One task family's steps on the request path (proxy.pipeline.task calls them in order)."""

    name: str  # as tiers.toml `families` names it

    @abc.abstractmethod
    def max_body_bytes(self, policies: Policies) -> int: ...

    async def read(self, request: web.Request, policies: Policies) -> Any:
        """The body: a JSON object (415, 413, 408, 400 as proxy.http.body says)."""
        return await read_json(request, self.max_body_bytes(policies))

    @abc.abstractmethod
    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        """The request as the family reads it (`params`: the route's path parameters); 422
        (GatewayError) when it is not one."""

    @abc.abstractmethod
    def model(self, job: Job, policies: Policies) -> str | None:
        """The model it names (or the default); None when a provider's pool decides."""

    def early_slot(self, job: Job) -> bool:
        """Whether the upstream call follows admission at once, so its engine slot is taken
        beside admission's round trip (not when media must be fetched first: the slot would
        idle through the download)."""
        return True

    def pool(self, router: Router, job: Job, policies: Policies, mode: str = "direct") -> Pool:
        """The backends that serve it in `mode`; 404 for a model no backend serves (so)."""
        return router.pool(self.name, self.model(job, policies) or "", mode)

    @abc.abstractmethod
    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        """Admitted: do it; the answer and what it used."""

    async def run(self, request: web.Request, ctx: Ctx, job: Job, pool: Pool, result: Result,
                  headers: Mapping[str, str]) -> web.Response:
        """Produce the answer and send it with `headers`; charged once it is made."""
        answer = await self.produce(ctx, job, pool)
        result.answered(used=answer.used)
        return await send_whole(request, web.Response(body=answer.body, headers={
            **headers, **answer.headers, "Content-Type": answer.content_type}), result)


def parsed(parse: Any, *args: Any) -> Any:
    """`parse(*args)`, its RequestInvalid as the 422 answer."""
    try:
        return parse(*args)
    except RequestInvalid as exc:
        raise validation_failed(exc.detail) from None
