"""The token windows a chat request counts in: its tier's (every model's) and its model
group's, each over a minute or a day, of prompt + completion tokens, or of the prompt's
(input) or the completion's (output) alone. No I/O.

admit.lua reserves a request's worst case in each window (a bound on its prompt, its
completion cap) in the admission step; token_settle.lua puts the engine's counts in its place.
Each window is a hash of buckets (1 s for a minute, 5 min for a day) and a zset of those
buckets, under `igw:{A}:tk:<tier>:<scope>:<code>` (`AccountKeys.token_window`); the scripts
know a window by its code: kind (t, i, o) then period (m, d).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from proxy.config import TierPolicy, TokenLimits

# The periods' buckets: seconds each and how many the window spans, as the scripts count them.
BUCKETS = {"minute": (1, 60), "day": (300, 288)}
_KINDS = (("tokens", ""), ("input_tokens", "input_"), ("output_tokens", "output_"))
ALL_MODELS = "*"


@dataclass(frozen=True, slots=True)
class TokenWindow:
    scope: str  # ALL_MODELS (the tier's) or a model group
    kind: str  # tokens (prompt + completion), input_tokens, output_tokens
    period: str  # minute, day
    limit: int

    @property
    def code(self) -> str:
        """How the scripts know it: 'tm' (tokens a minute), 'id' (input tokens a day) ..."""
        return self.kind[0] + self.period[0]

    @property
    def suffix(self) -> str:
        """Its keys' tail (after the tier): the scope and the code."""
        return f"{self.scope}:{self.code}"

    def reserve(self, prompt: int, completion: int) -> int:
        """What a request reserves in it, from its worst-case prompt and completion."""
        if self.kind == "input_tokens":
            return prompt
        if self.kind == "output_tokens":
            return completion
        return prompt + completion

    def describe(self) -> str:
        """"20000 input tokens a minute on large-chat models"."""
        words = self.kind.replace("_", " ")
        where = "" if self.scope == ALL_MODELS else f" on {self.scope} models"
        return f"{self.limit} {words} a {self.period}{where}"


def _limits(scope: str, limits: TokenLimits) -> Iterable[TokenWindow]:
    for kind, prefix in _KINDS:
        for period in BUCKETS:
            limit = getattr(limits, f"{prefix}tokens_per_{period}")
            if limit:
                yield TokenWindow(scope, kind, period, limit)


def token_windows(tier: TierPolicy, group: str) -> tuple[TokenWindow, ...]:
    """The windows a request to a model of `group` counts in."""
    found = tuple(_limits(ALL_MODELS, tier))
    limits = tier.group_tokens.get(group)
    return found + tuple(_limits(group, limits)) if limits is not None else found


class WindowsByTier:
    """Each tier's windows per model group, worked out once per policy version (the policy
    snapshot holds one): a request reads them rather than building them."""

    def __init__(self) -> None:
        self._found: dict[tuple[str, str], tuple[TokenWindow, ...]] = {}

    def of(self, tier_name: str, tier: TierPolicy, group: str) -> tuple[TokenWindow, ...]:
        found = self._found.get((tier_name, group))
        if found is None:
            found = self._found[tier_name, group] = token_windows(tier, group)
        return found


def all_token_windows(tier: TierPolicy) -> tuple[TokenWindow, ...]:
    """Every window of the tier: its own, then each group's (for /v2/account)."""
    found = list(_limits(ALL_MODELS, tier))
    for group, limits in sorted(tier.group_tokens.items()):
        found += _limits(group, limits)
    return tuple(found)


def tightest(windows: Iterable[tuple[TokenWindow, int]], kinds: tuple[str, ...]
             ) -> tuple[TokenWindow, int] | None:
    """Of (window, tokens remaining) pairs of these kinds, the one with the fewest left."""
    found = [pair for pair in windows if pair[0].kind in kinds]
    return min(found, key=lambda pair: pair[1]) if found else None
