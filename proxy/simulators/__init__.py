"""Upstream simulators: TGI and vLLM servers without GPUs, speaking the real wire formats.

Operators run them with `inference-gateway simulate KIND ...`; the gateway's tests run
against them. Faults are chosen per request with `x-sim-*` headers (see `faults`), and
`/_sim/requests`, `/_sim/stats`, `/_sim/reset`, `/_sim/health` expose what they saw.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from proxy.simulators import tgi, vllm
from proxy.simulators.runtime import STATE, SimConfig, SimState, add_sim_routes

KINDS = ("tgi", "vllm")
MAX_BODY = 16 * 1024 * 1024  # above both servers' defaults: the gateway enforces the real caps

__all__ = ["KINDS", "SimConfig", "build_app"]


def build_app(kind: str, config: SimConfig) -> web.Application:
    if kind not in KINDS:
        raise ValueError(f"unknown simulator kind {kind!r}; expected one of {KINDS}")
    if not config.models:
        raise ValueError("a simulator needs at least one model")
    app = web.Application(client_max_size=MAX_BODY)
    app[STATE] = SimState(kind, config)
    add_sim_routes(app)
    (tgi.add_routes if kind == "tgi" else vllm.add_routes)(app)
    if config.startup_delay_s > 0:
        # on_startup runs before the site binds, so the port stays closed (connection
        # refused) while "loading", as with the real servers.
        async def load(_app: web.Application) -> None:
            await asyncio.sleep(config.startup_delay_s)

        app.on_startup.append(load)
    return app
