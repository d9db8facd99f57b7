"""GET /admin/shadow: the tiers as the live and the shadow policies set them, side by side, and
what the shadow decided differently since it was loaded, over every worker and gateway
(proxy.policy.shadowing keeps the tallies)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy.api.admin import require_admin
from proxy.appkeys import REDIS
from proxy.errors import store_unavailable
from proxy.policy.shadow import differences, tier_fields
from proxy.policy.shadowing import summary


async def show_shadow(request: web.Request) -> web.Response:
    snapshot = await require_admin(request)
    live, shadow = snapshot.policies.tiers.tiers, snapshot.shadow
    if shadow is None:
        tiers: list[dict[str, Any]] = [
            {"name": name, "live": tier_fields(tier), "shadow": None, "differs": []}
            for name, tier in sorted(live.items())]
        body = {"loaded": False, "version": snapshot.version, "files": [], "fingerprint": None,
                "since": None, "tiers": tiers,
                "summary": {"requests": 0, "disagreements": 0, "by_tier": {}}}
        return web.Response(body=orjson.dumps(body), content_type="application/json")
    try:
        judged = await summary(request.app[REDIS], shadow.fingerprint)
    except RedisError:
        raise store_unavailable("shadow tallies") from None
    candidate = shadow.policies.tiers.tiers
    tiers = [{"name": name, "live": tier_fields(live.get(name)),
              "shadow": tier_fields(candidate.get(name)),
              "differs": differences(live.get(name), candidate.get(name))}
             for name in sorted(live.keys() | candidate.keys())]
    body = {"loaded": True, "version": snapshot.version, "files": list(shadow.files),
            "fingerprint": shadow.fingerprint, "since": judged.pop("since"), "tiers": tiers,
            "summary": judged}
    return web.Response(body=orjson.dumps(body), content_type="application/json")
