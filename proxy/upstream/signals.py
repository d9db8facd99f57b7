"""What an engine says of its own load, read from its Prometheus `/metrics` text. No I/O.

vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc`
(0..1), summed over the models one server serves, and the size of its KV cache in tokens
(`vllm:cache_config_info`'s `num_gpu_blocks` x `block_size`). TGI: `tgi_queue_size`,
`tgi_batch_current_size`, and the batch's share of its token budget
(`tgi_batch_current_max_tokens` / `tgi_batch_max_total_tokens`) standing in for KV use. Both
count completed requests (`vllm:request_success_total`, `tgi_request_success`), from which the
workers learn each engine's completion rate; vLLM's prefill histograms' sums and counts
(`vllm:request_prefill_time_seconds`, `vllm:request_prefill_kv_computed_tokens`) give its price
of a prompt token (proxy.upstream.prefill_price). Other
kinds publish nothing a router can use; their backends are picked on outstanding counts.
"""

from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from proxy.upstream.prefill_price import PrefillTotals

SIGNAL_KINDS = frozenset({"vllm", "tgi"})
SIGNALS_FRESH_S = 2.0  # a snapshot older than this is not used (the master's hash expires too)
MAX_TEXT = 4 * 1024 * 1024  # a /metrics answer larger than this is not an engine's
_VLLM = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
         "vllm:kv_cache_usage_perc": "kv", "vllm:request_success_total": "done",
         "vllm:request_prefill_time_seconds_count": "prefills",
         "vllm:request_prefill_time_seconds_sum": "prefill_s",
         "vllm:request_prefill_kv_computed_tokens_sum": "prefill_tokens"}
_TGI = {"tgi_queue_size": "waiting", "tgi_batch_current_size": "running",
        "tgi_batch_current_max_tokens": "batch_tokens", "tgi_batch_max_total_tokens": "budget",
        "tgi_request_success": "done"}


class EngineSignals(msgspec.Struct, frozen=True, kw_only=True):
    """One scrape of one engine; `at` is the scraper's wall clock (seconds)."""

    waiting: float
    running: float
    kv: float | None  # share of the KV cache (or token budget) in use, 0..1; None: unknown
    at: float
    done: float | None = None  # requests the engine has completed since it started (a counter)
    cache_tokens: float | None = None  # the KV cache's size, in tokens (vLLM)
    # vLLM's prefills so far: requests, their seconds and the prompt tokens computed (counters)
    prefill: PrefillTotals | None = None

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    def fresh(self, now: float) -> bool:
        return now - self.at < SIGNALS_FRESH_S

    @staticmethod
    def decode(raw: bytes | str) -> EngineSignals | None:
        try:
            return msgspec.json.decode(raw, type=EngineSignals)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None


def parse_signals(kind: str, text: str, at: float) -> EngineSignals | None:
    """The load figures in an engine's /metrics text; None when they are not all there (a
    different server, a version that renamed them, text that does not parse)."""
    names = _VLLM if kind == "vllm" else _TGI if kind == "tgi" else None
    if names is None or len(text) > MAX_TEXT:
        return None
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(_samples_of(text, names)):
            for sample in family.samples:
                if sample.name == "vllm:cache_config_info":
                    found["cache_tokens"] = found.get("cache_tokens", 0.0) + _cache_tokens(
                        sample.labels)
                    continue
                field = names.get(sample.name)
                if field is not None and sample.value == sample.value:  # NaN: not a figure
                    found[field] = found.get(field, 0.0) + max(0.0, sample.value)
    except (ValueError, TypeError, IndexError):
        return None
    if "waiting" not in found or "running" not in found:
        return None
    kv = found.get("kv")
    if kind == "tgi":
        budget = found.get("budget")
        kv = found["batch_tokens"] / budget if budget and "batch_tokens" in found else None
    return EngineSignals(waiting=found["waiting"], running=found["running"],
                         kv=None if kv is None else min(1.0, kv), at=at, done=found.get("done"),
                         cache_tokens=found.get("cache_tokens") or None,
                         prefill=_prefill(found))


def _samples_of(text: str, names: dict[str, str]) -> str:
    """Only the sample lines of `names` (and the cache config): a vLLM's /metrics is ~700 lines
    of histograms, and the parser took ~30 ms over all of them, a quarter of a core at four
    reads a second of two engines; over these few, well under a millisecond."""
    wanted = {*names, "vllm:cache_config_info"}  # comments and blank lines name none of them
    keep = [line for line in text.splitlines()
            if line.split("{", 1)[0].split(" ", 1)[0] in wanted]
    return "\n".join(keep) + "\n"


def _prefill(found: dict[str, float]) -> PrefillTotals | None:
    if not all(k in found for k in ("prefills", "prefill_s", "prefill_tokens")):
        return None
    return PrefillTotals(requests=found["prefills"], seconds=found["prefill_s"],
                         tokens=found["prefill_tokens"])


def _cache_tokens(labels: dict[str, str]) -> float:
    """A vLLM engine's KV cache in tokens, from its cache config's labels (0: not stated)."""
    try:
        return max(0.0, float(labels["num_gpu_blocks"]) * float(labels["block_size"]))
    except (KeyError, ValueError):
        return 0.0
