"""What prefilling a prompt token costs on an engine, learned from its own figures. No I/O.

vLLM counts, per finished request, the seconds from its scheduling to its first token
(`vllm:request_prefill_time_seconds`) and the prompt tokens it computed rather than found cached
(`vllm:request_prefill_kv_computed_tokens`); the workers see both histograms' sums and counts at
every read of the engine's figures (proxy.upstream.signals). Between two reads

    seconds = fixed x requests + per_token x tokens

where `fixed` is a step's cost every request pays however short (scheduling, the first decode
step, the detokenizer) and `per_token` is the price the "prefix" pick weighs a replica's wait
against. Least squares over the reads, each older read weighing `DECAY` times less per newer one
with prefills in it, so the figure follows the engine (a restarted or busier one) within a
minute of traffic. The sums' ratio alone (the recipe an operator can read by hand) mixes in
the fixed cost: on the routing benchmark's simulators (20 ms a request, 60 ms per 1,000 tokens,
~300 computed tokens a request) it reads ~2 x the true price.

The fit stands only when it can separate the two: at least `MIN_PREFILLS` requests, reads whose
requests-to-tokens ratios differ (prompts of one length give a line through no point), and a
positive per-token cost; else `per_token_s` is None and the pool keeps its configured price.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.98  # each read with prefills in it: older reads count this much less (half in ~35)
MIN_PREFILLS = 20.0  # requests (decayed) before the fit is used
SEPARABLE = 0.05  # 1 - the squared correlation of requests and tokens over the reads, at least
MAX_PER_TOKEN_S = 0.1  # a figure above (100 s per 1,000 tokens) is not a prefill's


@dataclass(frozen=True, slots=True)
class PrefillTotals:
    """An engine's counters at one read (they only grow, until it restarts)."""

    requests: float
    seconds: float
    tokens: float


@dataclass(slots=True)
class PrefillFit:
    """One engine's prefill price, fitted over the reads of its counters."""

    last: PrefillTotals | None = None
    _nn: float = 0.0  # decayed sums of products: requests (n), tokens (t), seconds (s)
    _nt: float = 0.0
    _tt: float = 0.0
    _ns: float = 0.0
    _ts: float = 0.0
    _requests: float = 0.0
    per_token_s: float | None = None
    fixed_s: float | None = None

    def take(self, totals: PrefillTotals | None) -> None:
        """The next read's counters (None: the engine publishes none now)."""
        last, self.last = self.last, totals
        if totals is None or last is None:
            return
        n = totals.requests - last.requests
        t, s = totals.tokens - last.tokens, totals.seconds - last.seconds
        if n <= 0 or t < 0 or s < 0:  # no prefill finished, or the engine restarted
            return
        self._nn = DECAY * self._nn + n * n
        self._nt = DECAY * self._nt + n * t
        self._tt = DECAY * self._tt + t * t
        self._ns = DECAY * self._ns + n * s
        self._ts = DECAY * self._ts + t * s
        self._requests = DECAY * self._requests + n
        self._solve()

    def _solve(self) -> None:
        nn, nt, tt, ns, ts = self._nn, self._nt, self._tt, self._ns, self._ts
        det = nn * tt - nt * nt
        if self._requests < MIN_PREFILLS or tt <= 0 or det <= SEPARABLE * nn * tt:
            return  # not enough, or not separable yet: the last fit (if any) stands
        fixed = (tt * ns - nt * ts) / det
        per_token = (nn * ts - nt * ns) / det
        if fixed < 0:  # no fixed cost to be found: all of it per token
            fixed, per_token = 0.0, ts / tt
        if 0 < per_token <= MAX_PER_TOKEN_S:
            self.per_token_s, self.fixed_s = per_token, fixed
