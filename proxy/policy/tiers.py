"""Policy decisions for a principal: tier access and per-request caps. Pure."""

from __future__ import annotations

from proxy.config import ANY_GROUP, TierPolicy, TiersPolicy
from proxy.errors import ErrorKind, GatewayError

FAMILY_NAMES = {
    "chat": "chat", "tts": "speech synthesis", "asr": "speech recognition",
    "image": "image generation", "video": "video generation", "embed": "embeddings",
}


def tier_of(tiers: TiersPolicy, name: str) -> TierPolicy:
    tier = tiers.tiers.get(name)
    if tier is None:
        raise GatewayError(ErrorKind.FORBIDDEN, f"tier {name!r} is not configured on this gateway")
    return tier


def denial(tiers: TiersPolicy, tier_name: str, *, family: str, model: str, mode: str
           ) -> str | None:
    """What the tier lacks for this use (the task family, the model's group, or the mode)."""
    tier = tiers.tiers.get(tier_name)
    if tier is None:
        return f"tier {tier_name!r} is not configured on this gateway"
    if family not in tier.families:
        return f"the {tier_name} tier does not include {FAMILY_NAMES[family]}"
    group = tiers.group_of(model)
    modes = set(tier.models.get(group, ())) | set(tier.models.get(ANY_GROUP, ()))
    if not modes:
        return f"the {tier_name} tier may not use model group {group!r}"
    if mode not in modes:
        return f"the {tier_name} tier may not use model group {group!r} in {mode} mode"
    return None


def check_access(tiers: TiersPolicy, tier_name: str, *, family: str, model: str, mode: str
                 ) -> None:
    """403 naming what the tier lacks."""
    reason = denial(tiers, tier_name, family=family, model=model, mode=mode)
    if reason is not None:
        raise _forbidden(reason)


def check_queue_budget(tier: TierPolicy, tier_name: str, model: str,
                       waiting_per_replica: float | None, retry_after_s: int) -> None:
    """503 `pool_saturated` when the model's engines already queue as much as this tier may
    add to (`queue_budget`); before anything is held, so nothing is charged."""
    budget = tier.queue_budget
    if budget is None or waiting_per_replica is None or waiting_per_replica < budget:
        return
    raise GatewayError(
        ErrorKind.POOL_SATURATED,
        f"model {model!r} is saturated: {waiting_per_replica:g} requests wait per replica, "
        f"and tier {tier_name!r} queues only while fewer than {budget} do; retry shortly",
        headers={"Retry-After": str(retry_after_s)})


def completion_cap(tier: TierPolicy, tier_name: str, requested: int | None) -> int | None:
    """The completion-token cap to send upstream; 403 when the request asks for more."""
    cap = tier.max_tokens_per_request
    if cap is None:
        return requested
    if requested is not None and requested > cap:
        raise _forbidden(f"the {tier_name} tier allows at most {cap} completion tokens a request")
    return requested if requested is not None else cap


def _forbidden(message: str) -> GatewayError:
    return GatewayError(ErrorKind.FORBIDDEN, message)
