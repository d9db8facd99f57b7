"""An engine's price of a prompt token, fitted from its prefill counters
(proxy.upstream.prefill_price), and how a "prefix" pool uses it."""

from __future__ import annotations

import random
import time

from proxy.config import BackendSpec, RoutingSection
from proxy.upstream.prefill_price import MIN_PREFILLS, PrefillFit, PrefillTotals
from proxy.upstream.router import Router
from proxy.upstream.signals import EngineSignals, parse_signals

MODEL = "acme/small-chat"


def engine_reads(fixed_s: float, per_token_s: float, reads: int, seed: int = 1,
                 start: PrefillTotals | None = None) -> list[PrefillTotals]:
    """Counters as an engine at that price shows them, read after 0-3 requests of 10-2,000
    computed tokens each (some found cached, some not), with a little noise."""
    rng = random.Random(seed)
    n = s = t = 0.0
    if start is not None:
        n, s, t = start.requests, start.seconds, start.tokens
    out = [PrefillTotals(requests=n, seconds=s, tokens=t)]
    for _ in range(reads):
        for _ in range(rng.randint(0, 3)):
            tokens = rng.choice([rng.uniform(10, 60), rng.uniform(200, 2000)])
            n, t = n + 1, t + tokens
            s += (fixed_s + per_token_s * tokens) * rng.uniform(0.9, 1.1)
        out.append(PrefillTotals(requests=n, seconds=s, tokens=t))
    return out


def fitted(reads: list[PrefillTotals], fit: PrefillFit | None = None) -> PrefillFit:
    fit = fit or PrefillFit()
    for totals in reads:
        fit.take(totals)
    return fit


def test_the_fit_separates_the_fixed_step_from_the_price_of_a_token() -> None:
    fit = fitted(engine_reads(0.020, 60e-6, 200))
    assert fit.per_token_s is not None and fit.fixed_s is not None
    assert abs(fit.per_token_s / 60e-6 - 1) < 0.05
    assert abs(fit.fixed_s / 0.020 - 1) < 0.25
    reads = engine_reads(0.020, 60e-6, 200)  # the sums' ratio, by hand, reads far higher
    assert reads[-1].seconds / reads[-1].tokens > 1.2 * 60e-6


def test_no_fixed_cost_is_all_per_token() -> None:
    fit = fitted(engine_reads(0.0, 434e-6, 200))
    assert fit.per_token_s is not None and abs(fit.per_token_s / 434e-6 - 1) < 0.05
    assert fit.fixed_s is not None and fit.fixed_s < 0.005


def test_no_figure_until_the_reads_can_show_one() -> None:
    few = engine_reads(0.020, 60e-6, 400)
    first = next(i for i, r in enumerate(few) if r.requests >= MIN_PREFILLS / 2)
    assert fitted(few[:first]).per_token_s is None  # too few requests yet
    # Every request the same length, one per read: requests and tokens on one line.
    alike = [PrefillTotals(requests=i, seconds=i * 0.05, tokens=i * 500.0) for i in range(100)]
    assert fitted(alike).per_token_s is None
    # Time that does not grow with tokens is no price of a token.
    flat = [PrefillTotals(requests=i, seconds=i * 0.05, tokens=i * 500.0 + (i % 7) * 300)
            for i in range(100)]
    assert fitted(flat).per_token_s is None


def test_a_restarted_engine_and_a_gap_in_its_figures_break_nothing() -> None:
    fit = fitted(engine_reads(0.020, 60e-6, 200))
    before = fit.per_token_s
    fit.take(PrefillTotals(requests=3, seconds=0.2, tokens=900))  # counters began again
    fit.take(None)  # no figures for a read
    assert fit.per_token_s == before
    fitted(engine_reads(0.020, 60e-6, 50, seed=2, start=fit.last), fit)
    assert fit.per_token_s is not None and abs(fit.per_token_s / 60e-6 - 1) < 0.05


def test_the_fit_follows_an_engine_that_slows() -> None:
    fit = fitted(engine_reads(0.020, 60e-6, 200))
    assert fit.last is not None
    fitted(engine_reads(0.020, 180e-6, 300, seed=3, start=fit.last), fit)
    assert fit.per_token_s is not None and abs(fit.per_token_s / 180e-6 - 1) < 0.1


def test_the_counters_are_read_from_vllms_metrics() -> None:
    text = """\
vllm:num_requests_running{engine="0",model_name="a"} 1.0
vllm:num_requests_waiting{engine="0",model_name="a"} 0.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="a"} 11.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="a"} 3.3
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="a"} 11.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="a"} 11.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="a"} 147.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="b"} 1.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="b"} 0.5
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="b"} 3.0
"""
    signals = parse_signals("vllm", text, 1.0)
    assert signals is not None
    assert signals.prefill == PrefillTotals(requests=12, seconds=3.8, tokens=150)
    assert EngineSignals.decode(signals.encode()) == signals  # as the workers get it
    older = parse_signals("vllm", text.replace("vllm:request_prefill_kv", "x"), 1.0)
    assert older is not None and older.prefill is None  # a vLLM without the computed tokens


def test_a_pool_prices_a_token_at_its_fastest_engines_figure_once_learned() -> None:
    specs = [BackendSpec(name=n, kind="vllm", url=f"http://{n}:8000", models=[MODEL])
             for n in ("a", "b")]

    def pool(learn: bool) -> tuple[float, float]:
        router = Router(specs, routing=RoutingSection(prefill_ms_per_1k_tokens=60,
                                                      learn_prefill=learn))
        chat = router.pool("chat", MODEL)
        before = chat.prefill_s_per_token
        for backend, per_token, seed in zip(chat.backends, (434e-6, 300e-6), (1, 2),
                                            strict=True):
            for at, totals in enumerate(engine_reads(0.0, per_token, 200, seed=seed)):
                backend.take_signals(EngineSignals(waiting=0, running=0, kv=0.0,
                                                   at=time.time() - 200 + at, prefill=totals))
        return before, chat.prefill_s_per_token

    before, learned = pool(learn=True)
    assert before == 60e-6
    assert abs(learned / 300e-6 - 1) < 0.05
    assert pool(learn=False) == (60e-6, 60e-6)
