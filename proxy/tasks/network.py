"""Network mode (DESIGN §6): one request run on `replicas` distinct backends of the model's
network pool, the answer a quorum agrees on returned, and the run recorded as a task the caller
can poll by its `task_address`.

    mode     "network" as asked; "auto" is direct when the model's direct pool has a healthy
             backend, else network when the model is offered there (a stream: always direct)
    slots    with the dispatcher, a slot on each of `replicas` backends, taken at once (the
             request waits in its tier's place until they are free)
    run      each replica on its own one-backend pool (no retry elsewhere: a failed replica is
             a vote lost), the same body (chat: one `seed`, [network] seed, unless the client set
             one), concurrently (proxy.upstream.redundant)
    verdict  the largest group of identical answers (proxy.upstream.quorum.fingerprint) wins if
             it reaches the quorum; else 502 (no two agreed) or the replicas' own failure
    record   `igw:{A}:task:<task_address>`: the answer and the agreement (replicas, agreeing,
             quorum, backends, fingerprints), kept [tasks] result_ttl_s

The request path and the task runner produce network answers alike (`network_chat`,
`network_answer`); only what they record beside the answer differs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import RedisError

from proxy.errors import ErrorKind, GatewayError
from proxy.families.base import Answer, Ctx, Family, Job
from proxy.families.chat import fetch_completion
from proxy.styles.base import ChatCall, ChatStyle
from proxy.tasks.store import TaskStore
from proxy.upstream.pool import Pool
from proxy.upstream.quorum import Verdict, fingerprint, task_address
from proxy.upstream.redundant import run_redundant
from proxy.upstream.router import Router

log = logging.getLogger("proxy.tasks")
T = TypeVar("T")


def choose_mode(router: Router, family: str, model: str, asked: str | None, *,
                stream: bool = False) -> str:
    """The mode a request runs in (a mode the model does not offer: the pool lookup's 404)."""
    if asked in ("direct", "network"):
        return asked
    direct = router.has_pool(family, model, "direct")
    if stream or (direct and router.pool(family, model, "direct").healthy):
        return "direct"
    return "network" if router.has_pool(family, model, "network") else "direct"


@dataclass(frozen=True, slots=True)
class Agreed:
    answer: Any
    address: str
    agreement: dict[str, Any]


async def agreed(ctx: Ctx, pool: Pool, run_one: Callable[[Ctx, Pool], Awaitable[T]],
                 key: Callable[[T], str]) -> Agreed:
    """Run on distinct backends (each replica on its one-backend pool, with `ctx` carrying its
    slot); the answer a quorum agrees on (502 / the failure otherwise). With the dispatcher,
    the request waits in its tier's place until every replica has a slot, all taken at once
    (proxy.upstream.dispatch)."""
    policy = ctx.policies.requests.network
    dispatcher = ctx.upstreams.dispatcher
    replicas = await dispatcher.acquire_distinct(pool, ctx.ticket, policy.replicas)
    try:
        verdict: Verdict[T] = await run_redundant(
            replicas, lambda r: run_one(dataclasses.replace(ctx, early=r[1]), r[0]), key=key,
            quorum=policy.needed, name=lambda r: r[0].backends[0].name)
    finally:
        for _, early in replicas:
            dispatcher.forget(early)  # a replica cancelled before its call: its slot goes back
    if not verdict.agreed:
        failures = [exc for _, exc in verdict.failures]
        if len(failures) == verdict.replicas and isinstance(failures[0], GatewayError):
            raise failures[0]  # all failed alike: the upstream's own answer
        raise GatewayError(ErrorKind.UPSTREAM_ERROR,
                           f"the {verdict.replicas} replicas did not agree ({verdict.agreeing} "
                           f"identical answers, {verdict.quorum} needed)")
    return Agreed(verdict.answer, task_address(ctx.request_id, pool.model, verdict.fingerprints), {
        "replicas": verdict.replicas, "agreeing": verdict.agreeing, "quorum": verdict.quorum,
        "backends": verdict.backends, "fingerprints": verdict.fingerprints})


async def network_chat(ctx: Ctx, store: TaskStore, account: str, style: ChatStyle,
                       call: ChatCall, cap: int, pool: Pool, task_id: str
                       ) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """The completion a quorum agrees on, rendered in the style with its `task_address`, and
    recorded (the record is the rendered answer); with the engine's usage and the address."""
    seed = ctx.policies.requests.network.seed
    done = await agreed(ctx, pool,
                        lambda one_ctx, one: fetch_completion(one_ctx, call, cap, one, seed),
                        fingerprint)
    rendered = style.response(done.answer, call, task_id, "network")
    rendered["task_address"] = done.address
    await record(ctx, store, account, done, rendered)
    return rendered, done.answer.get("usage"), done.address


async def network_answer(ctx: Ctx, store: TaskStore, account: str, family: Family, job: Job,
                         pool: Pool, recorded: Callable[[Answer], Any]) -> Answer:
    """The answer (speech, so far) a quorum agrees on, recorded as `recorded(answer)` says,
    with its `X-Task-Address`."""
    done = await agreed(ctx, pool, lambda one_ctx, one: family.produce(one_ctx, job, one),
                        lambda answer: fingerprint(answer.body))
    answer: Answer = done.answer
    await record(ctx, store, account, done, recorded(answer))
    return Answer(answer.body, answer.content_type, answer.used,
                  {**answer.headers, "X-Task-Address": done.address})


async def record(ctx: Ctx, store: TaskStore, account: str, done: Agreed, result: Any) -> None:
    """The run, pollable at /v2/tasks/{task_address} by its owner. A store that fails leaves
    the answer standing: only its record is missing."""
    try:
        await store.put_completed(account, done.address, result,
                                  ttl_s=ctx.policies.requests.tasks.result_ttl_s,
                                  extra={"agreement": done.agreement})
    except RedisError:
        log.warning("network-mode run %s could not be recorded (request %s)", done.address,
                    ctx.request_id)
