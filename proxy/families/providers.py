"""Image and video generation on the request path: the body passed through to a named
provider's `/v1/images/generations` or `/v1/videos/generations` -> charged per image delivered,
or per second of video decoded. The few fields the gateway reads are in
proxy.families.generation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from proxy.config import Policies
from proxy.credits.pricing import Units
from proxy.errors import ErrorKind, GatewayError
from proxy.families import generation
from proxy.families.base import Answer, Ctx, Family, Job, parsed
from proxy.upstream import http1
from proxy.upstream.client import read_answer
from proxy.upstream.pool import Backend, Pool
from proxy.upstream.router import Router


class Generation(Family):
    """Image (`name = "image"`) or video (`"video"`) generation by a named provider."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path

    def max_body_bytes(self, policies: Policies) -> int:
        return policies.requests.generation.max_body_bytes

    def parse(self, body: Any, policies: Policies, params: Mapping[str, str]) -> Job:
        limits = policies.requests.generation
        req: generation.ImageRequest | generation.VideoRequest
        if self.name == "image":
            image, sent = parsed(generation.parse_image, body, limits.max_images)
            req, worst = image, Units(images=image.n or 1)
        else:
            video, sent = parsed(generation.parse_video, body, limits.max_video_s)
            seconds = generation.video_seconds_asked(video, limits.max_video_s)
            req, worst = video, Units(video_ms=seconds * 1000)
        return Job(generation.forwarded(sent), req.model, req.mode or "auto", bool(req.async_),
                   worst, params["provider"])

    def model(self, job: Job, policies: Policies) -> str | None:
        return None  # the provider's pool names it

    def pool(self, router: Router, job: Job, policies: Policies, mode: str = "direct") -> Pool:
        if mode != "direct":
            raise GatewayError(ErrorKind.NOT_FOUND, f"{self.name} providers are not offered "
                               "in network mode")
        return router.provider_pool(self.name, job.provider or "", job.model)

    async def produce(self, ctx: Ctx, job: Job, pool: Pool) -> Answer:
        body = orjson.dumps({**job.request, "model": pool.model})
        headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id}
        cap = ctx.policies.requests.generation.max_media_bytes

        async def use(backend: Backend, upstream: http1.Response) -> Answer:
            raw = await read_answer(upstream, cap)
            content_type = upstream.headers.get("Content-Type", "application/octet-stream")
            media = content_type.partition(";")[0].strip().lower()
            try:
                answer = orjson.loads(raw) if media == "application/json" else None
            except orjson.JSONDecodeError:
                answer = None
            if self.name == "image":
                used = Units(images=generation.images_in(answer, media))
            else:
                ms = generation.video_ms_in(raw, answer, media)
                used = Units(video_ms=job.worst.video_ms if ms is None else ms)
            if not used.counts():
                raise GatewayError(ErrorKind.UPSTREAM_ERROR,
                                   f"the {self.name} provider sent an unusable answer")
            return Answer(raw, content_type, used)

        return await ctx.upstreams.call(pool, self.path, lambda b: body, headers,
                                        ctx.client_headers, use, ticket=ctx.ticket,
                                        early=ctx.early)


IMAGE = Generation("image", "/v1/images/generations")
VIDEO = Generation("video", "/v1/videos/generations")
