"""A simulator's settings (`inference-gateway simulate KIND ...`): one frozen value per app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class KvEventsConfig(NamedTuple):
    """vLLM's `--kv-events-config` when it publishes (`kv_events.parse_config`)."""

    endpoint: str  # the ZMQ PUB socket's, bound
    topic: str = ""
    hwm: int = 100_000  # messages queued for a slow subscriber before ZMQ drops them


@dataclass(frozen=True)
class SimConfig:
    models: tuple[str, ...]
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0  # 0: no pacing, tokens as fast as the socket takes them
    # TGI --max-concurrent-requests: 429 beyond it; vLLM --max-num-seqs: its running batch.
    max_concurrency: int = 128
    max_batch_size: int | None = None  # TGI's running batch; None: max_concurrency (no queue)
    startup_delay_s: float = 0.0
    fail_generation: bool = False  # /health stays OK while every generation fails
    default_completion_tokens: int = 16
    # vLLM's engine options (`simulate vllm --max-model-len ...`).
    max_model_len: int = 32768  # the context: prompt + completion
    max_queued: int | None = None  # --max-num-queued-reqs: in flight beyond it -> 503
    # --scheduling-policy: "fcfs" refuses any priority but 0 (400); "priority" honours it.
    scheduling_policy: str = "fcfs"
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details (cached tokens)
    block_size: int = 16  # KV-cache block: prompts share a cached beginning in whole blocks
    # KV-cache capacity in blocks (vLLM's num_gpu_blocks): with 16-token blocks, the 1,048,576
    # tokens of the captured vLLM's cache; so much that only a pool meant to fill it does.
    kv_cache_blocks: int = 65536
    prefill_ms_per_1k_tokens: float = 0.0  # prefill cost of the prompt tokens not cached
    speed: float = 1.0  # divides every latency: 0.33 is a replica three times slower
    death_close_s: float = 3.0  # after an engine death the port closes within this long
    # Media kinds (`simulate tts|whisper|image|video`); the chat kinds ignore these.
    voices: tuple[str, ...] = ()  # tts: accepted voices; () = the default list
    sample_rate: int = 24000  # tts: output rate (22050 emulates Piper)
    word_timestamps: bool = False  # whisper: honour timestamp_granularities[]=word (vLLM won't)
    whisper_cpp_errors_200: bool = False  # whisper /inference: errors with HTTP 200 (<= v1.8)
    # Embedding models (`simulate tei`, `simulate vllm --runner pooling`): the vector's length,
    # the longest input in tokens (TEI's max_input_length; vLLM's is --max-model-len), and the
    # most inputs one TEI request may carry (--max-client-batch-size).
    embedding_size: int = 384
    max_input_length: int = 512
    max_client_batch_size: int = 32
    runner: str = "generate"  # vLLM --runner: "pooling" serves /v1/embeddings, not chat
    kv_events: KvEventsConfig | None = None  # vLLM: publish KV-cache events (None: don't)

    @property
    def batch_size(self) -> int:
        return self.max_batch_size or self.max_concurrency

    @property
    def ttft_s(self) -> float:
        """`ttft_ms` at this replica's speed (the media kinds' processing time)."""
        return self.ttft_ms / 1000 / self.speed

    @property
    def token_interval_s(self) -> float:
        return 1 / (self.tokens_per_s * self.speed) if self.tokens_per_s > 0 else 0.0

    @property
    def prefill_s_per_token(self) -> float:
        return self.prefill_ms_per_1k_tokens / 1_000_000 / self.speed
