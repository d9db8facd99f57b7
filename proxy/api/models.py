"""GET /v2/models: what backends.toml serves, OpenAI list style, with the gateway's own facts.

Each model carries its resource name (`mode.source.model`), modes, task family, the tiers that
may use it in each mode, its price, and whether a backend can take traffic for it right now.
Credentials are optional here; a credential that is present must be valid. Not rate-limited.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from proxy.appkeys import CONFIG, LIVE, ROUTER
from proxy.config import VOICE_PRESETS, BackendSpec, ModelPrice, Rates
from proxy.policy.tiers import denial

SOURCE_OF_FAMILY = {"chat": "compat", "asr": "audio", "tts": "audio", "image": "image",
                    "video": "video", "embed": "compat"}


async def list_models(request: web.Request) -> web.Response:
    snapshot = request.app[LIVE].current
    await snapshot.auth.principal(request.headers, request.remote)  # 401 on a bad credential
    policies = snapshot.policies
    backends: dict[str, list[BackendSpec]] = {}
    for spec in request.app[CONFIG].backends:
        for model in spec.models:
            backends.setdefault(model, []).append(spec)
    router = request.app[ROUTER]
    live = {b.name: b.available for b in router.backends}
    data = []
    for model, specs in sorted(backends.items()):
        family = specs[0].serves
        rates = policies.prices.models.get(model, policies.prices.default)
        modes = router.modes(model) or ["direct"]
        data.append({
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "inference-gateway",
            "resource": f"{modes[0]}.{SOURCE_OF_FAMILY[family]}.{model}",
            "resources": [f"{mode}.{SOURCE_OF_FAMILY[family]}.{model}" for mode in modes],
            "task_family": family,
            "modes": modes,
            "tiers": {mode: [name for name in policies.tiers.tiers
                             if denial(policies.tiers, name, family=family, model=model,
                                       mode=mode) is None]
                      for mode in modes},
            "price": _price(rates, policies.prices.version),
            **({"network_price": _price(rates.network, policies.prices.version)}
               if isinstance(rates, ModelPrice) and rates.network else {}),
            "healthy": any(live.get(spec.name, False) for spec in specs),
        })
    return web.Response(body=orjson.dumps({"object": "list", "data": data}),
                        content_type="application/json")


def _price(rates: Rates, version: str) -> dict[str, Any]:
    fields = ("prompt_per_1k_tokens", "cached_prompt_per_1k_tokens", "completion_per_1k_tokens",
              "per_1k_characters",
              "per_audio_second", "per_image", "per_video_second")
    price = {name: getattr(rates, name) for name in fields if getattr(rates, name)}
    return {"unit": "micro-credits", "version": version, **price}


async def tts_presets(request: web.Request) -> web.Response:
    """GET /v2/audio/tts/presets: the voices `preset_voice` may name, to guests and keys alike
    (a credential that is present must be valid)."""
    await request.app[LIVE].current.auth.principal(request.headers, request.remote)
    return web.Response(body=orjson.dumps(list(VOICE_PRESETS)), content_type="application/json")
