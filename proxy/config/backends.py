"""backends.toml: the gateway's own settings ([gateway], [server], [upstream], [health],
[supervisor], [routing], [media], [alerts], [telemetry]) and the upstream servers it sends
requests to ([[backends]]).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from proxy.config.vocabulary import (
    FAMILY_OF_KIND,
    BackendKind,
    Family,
    Mode,
    NonEmpty,
    Port,
    Seconds,
    Section,
)


def _direct_only() -> list[Mode]:
    return ["direct"]


class GatewaySection(Section, frozen=True):
    host: str = "127.0.0.1"
    port: Port = 8080
    # Unset: `serve` starts an embedded redis-server under data_dir (GATEWAY_REDIS_URL overrides).
    redis_url: str | None = None
    # Rate-limit counters need no durability; a Redis without fsync-on-every-write keeps them
    # off the ledger's slow path (GATEWAY_RATELIMIT_REDIS_URL overrides). Unset: the embedded
    # gateway starts a second, non-persistent server; with `redis_url` set, that one is used.
    rate_limit_redis_url: str | None = None
    # The embedded ledger Redis's `appendfsync`: "always" (default) loses no acknowledged charge
    # or top-up in a machine crash; "everysec" can lose the last second of them, and spares
    # every admission the wait behind an fsync on Redis' main thread (DESIGN §4; docs/credits.md).
    ledger_fsync: Literal["always", "everysec"] = "always"
    # With replicas (Redis Cluster, Sentinel): each settlement batch and top-up waits until this
    # many replicas have it (WAIT, at most 1 s), so a failover keeps every settled charge.
    ledger_ack_replicas: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    # Relative paths are taken from the config folder.
    data_dir: str = ".gateway"
    # HTTP worker processes sharing the port (SO_REUSEPORT); unset = one per CPU.
    workers: Annotated[int, msgspec.Meta(ge=1, le=256)] | None = None
    # On SIGTERM: readiness fails at once, open streams get this long to finish.
    drain_timeout_s: Seconds = 30.0
    # One JSON line per request: "stderr", "off", or a file (relative to the config folder).
    access_log: NonEmpty = "stderr"


class ServerSection(Section, frozen=True):
    """Client connections: deadlines and a per-worker cap, so slow or silent sockets cannot pile
    up (aiohttp alone keeps an idle connection an hour and puts no deadline on a request head)."""

    # An idle kept-alive connection is closed this long after its last response.
    keepalive_timeout_s: Seconds = 15.0
    # A request head (request line and headers) must be complete this long after the connection
    # opens, or after its first byte on a kept-alive connection; else 408 (or a silent close).
    header_timeout_s: Seconds = 10.0
    # A route reading a body must have all of it this long after it starts reading; else 408.
    body_timeout_s: Seconds = 30.0
    # A client that reads nothing of a response for this long is treated as gone.
    write_timeout_s: Seconds = 30.0
    # Open client connections per worker; the next ones get 503 and are closed. Lowered at start
    # to stay under the worker's open-file limit.
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 4096


class UpstreamSection(Section, frozen=True):
    connect_timeout_s: Seconds = 5.0
    # Until the first byte of the body: covers queueing and prefill (and, for a non-streaming
    # request, the whole generation, since those servers answer only when done).
    first_byte_timeout_s: Seconds = 300.0
    # Longest silence between two chunks once a stream is flowing.
    idle_timeout_s: Seconds = 60.0
    # Longest a stream may run in all; it then ends with an error event. With the timeouts above
    # it must stay below prices.toml's hold_ttl_s, so no hold can expire under a live request.
    max_stream_s: Seconds = 1800.0

    @property
    def longest_request_s(self) -> float:
        """The longest a request may run: connect and first byte twice (one retry on another
        backend), then the stream."""
        return 2 * (self.connect_timeout_s + self.first_byte_timeout_s) + self.max_stream_s


class BackendSpec(Section, frozen=True):
    name: NonEmpty
    kind: BackendKind
    url: NonEmpty
    models: Annotated[list[NonEmpty], msgspec.Meta(min_length=1)]
    # The requests its engine runs at once (its batch: vLLM --max-num-seqs, TGI
    # --max-concurrent-requests, a speech or image server's concurrency). With [routing]
    # dispatch, the whole fleet sends it at most this many, plus [routing] engine_queue (beyond
    # them requests wait in the gateway's queue, in tier order); without, each worker does (503
    # beyond).
    max_concurrency: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 64
    # The pools this backend is in: "direct" (one backend answers) and/or "network" (the request
    # runs on several backends of the network pool and a quorum must agree); a backend may be in
    # both. Network replicas must answer alike, so list only servers of the same weights there.
    modes: Annotated[list[Mode], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=_direct_only)
    weight: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1
    # kind "vllm" started with `--scheduling-policy priority`: each request carries its tier's
    # priority (tiers.toml `priority`, sent negated: vLLM runs lower values first), so a
    # higher tier also goes first in the engine's own queue. Off: vLLM refuses any priority.
    priority_scheduling: bool = False
    # kind "vllm" started with `--kv-events-config` (its ZMQ publisher): where to read its
    # KV-cache events, "tcp://host:port" (the engine binds tcp://*:port). A "prefix" pool then
    # forgets a prompt on this replica when the engine evicts it (proxy.upstream.kv_blocks).
    kv_events: Annotated[str, msgspec.Meta(pattern=r"^tcp://[^\s/]+:[0-9]{1,5}$")] | None = None
    # Client headers passed upstream as they are: exact names or prefixes ending in `*`
    # (the simulators read `x-sim-*` fault headers). Nothing else from the client goes upstream.
    forward_headers: list[NonEmpty] = []
    # Name of an environment variable holding the backend's own API key (vLLM --api-key, OpenAI).
    api_key_env: str | None = None
    # Health probe path (default by kind: TGI and vLLM `/health`, Ollama `/`); "" disables it.
    health_path: str | None = None
    # Supervision: when `command` is set the gateway starts this process itself (argv list, no
    # shell), waits for its health probe before routing to it, and restarts it when it exits.
    command: list[NonEmpty] | None = None
    env: dict[str, str] = {}  # merged over the gateway's environment
    cwd: str | None = None  # relative to the config folder (default: the folder itself)
    # kind "tts": the server's voice for each preset (unlisted presets go in lower case), and
    # the longest text it takes in one request (OpenAI's 4096): longer texts are spoken in
    # pieces, split between sentences, and joined into one WAV.
    voices: dict[str, NonEmpty] = {}
    max_input_chars: Annotated[int, msgspec.Meta(ge=100, le=1_000_000)] = 4096
    # kind "whisper": which wire it speaks: "openai" (OpenAI, vLLM, speaches:
    # /v1/audio/transcriptions and /translations) or "whisper.cpp" (its server's /inference).
    api: Literal["openai", "whisper.cpp"] = "openai"
    # kinds "image" and "video": the <provider> of /v2/image/<provider>/generate and
    # /v2/video/<provider>/t2v that this backend serves (default: its name).
    provider: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")] | None \
        = None
    # kinds "vllm" and "openai": what its models are for, "chat" (the default) or "embed" (an
    # embedding model: vLLM started with `--runner pooling`); kind "tei" serves "embed" only.
    family: Family | None = None
    # Embeddings: the most inputs the server takes in one request; more are sent in batches
    # of this many. Unset: for kind "tei" what its /info says (--max-client-batch-size, 32 by
    # default), no limit for the others.
    max_batch_inputs: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | None = None

    @property
    def serves(self) -> Family:
        """The task family its models are for."""
        return self.family or FAMILY_OF_KIND[self.kind]


class HealthSection(Section, frozen=True):
    """Active probes and passive ejection (Envoy-style outlier detection)."""

    interval_s: Seconds = 5.0
    # How often the master reads each vLLM/TGI backend's own load (its /metrics: waiting and
    # running requests, KV-cache use) for /metrics and /admin/backends; 0 turns it off.
    engine_signals_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.25
    timeout_s: Seconds = 2.0
    # Passive: this many consecutive failures eject a backend for a cool-down that grows with
    # each ejection (base, doubling, capped); never more than this share of a pool at once.
    consecutive_failures: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 5
    ejection_base_s: Seconds = 10.0
    ejection_max_s: Seconds = 300.0
    max_ejected_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5


class SupervisorSection(Section, frozen=True):
    """How supervised backends (those with `command`) are started, restarted and stopped."""

    startup_timeout_s: Seconds = 600.0  # model loading can take minutes
    grace_s: Seconds = 10.0  # SIGTERM, then this long, then SIGKILL
    backoff_base_s: Seconds = 1.0
    backoff_max_s: Seconds = 60.0


Pick = Literal["prefix", "engine", "p2c"]
Weight = Annotated[float, msgspec.Meta(ge=0, le=1000)]


class RoutingSection(Section, frozen=True):
    """How a chat pool picks a replica (proxy.upstream.routing); other pools use "p2c"."""

    # "prefix": the least expected time to first token (the replica's wait plus the prefill of
    # what its prefix cache lacks); "engine": the lowest load by the engines' own figures;
    # "p2c": two random choices.
    pick: Pick = "prefix"
    models: dict[str, Pick] = {}  # per model, over `pick`
    # Hold requests beyond the engines' slots (each backend's `max_concurrency`, counted across
    # every worker and gateway host) in the gateway's queue, in tier order
    # (proxy.upstream.dispatch); off: each worker sends up to `max_concurrency` per backend and
    # answers 503 beyond it.
    dispatch: bool = True
    # With `dispatch`: requests a vLLM engine of a batch of at least 4 is sent beyond its batch,
    # to wait in its own queue, so that when one of its running requests ends the next is
    # already there (the gateway's hand-off, a give-back, a take and a new HTTP request, leaves
    # a batch place idle for a few milliseconds each time). A tier uses them only while no
    # higher tier has taken a slot of the pool for 30 s (proxy.upstream.slots.HIGHER_TIER_S),
    # so none of its requests waits in an engine ahead of a higher tier's. 0: none.
    engine_queue: Annotated[int, msgspec.Meta(ge=0, le=4)] = 1
    # "prefix": what prefilling 1,000 prompt tokens costs (on the fastest replica), against
    # a replica's wait; and the KV cache of an engine that does not report its own (vLLM's
    # `vllm:cache_config_info`), in tokens.
    prefill_ms_per_1k_tokens: Annotated[float, msgspec.Meta(ge=0, le=100_000)] = 60.0
    # Learn that price from each vLLM engine's own prefill figures (its fastest replica's),
    # the configured one standing until they show it (proxy.upstream.prefill_price).
    learn_prefill: bool = True
    cache_tokens: Annotated[int, msgspec.Meta(ge=1, le=1_000_000_000)] = 1_000_000
    # The engine load score: waiting, running, KV-cache use (0-1), and the requests this worker
    # sent since the last read of the engine's figures.
    waiting_weight: Weight = 1.0
    running_weight: Weight = 0.5
    kv_cache_weight: Weight = 4.0
    sent_weight: Weight = 1.0


class MediaSection(Section, frozen=True):
    """Where async tasks' audio, images and video are kept until they expire (proxy.blobs):
    never in the ledger's Redis."""

    # "files": a folder on this host (`path`, relative to data_dir), served by this host's
    # gateway only; "s3": an S3-compatible bucket shared by every gateway host.
    store: Literal["files", "s3"] = "files"
    path: NonEmpty = "media"
    # "s3": the server (unset: AWS itself), the bucket (it must exist) and a key prefix.
    # Credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, a
    # profile, an instance role), never from this file.
    endpoint_url: Annotated[str, msgspec.Meta(pattern="^https?://")] | None = None
    bucket: Annotated[str, msgspec.Meta(pattern="^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")] | None \
        = None
    region: NonEmpty = "us-east-1"
    prefix: Annotated[str, msgspec.Meta(pattern="^([A-Za-z0-9._-]+/)*$")] = "igw-media/"


class AlertsSection(Section, frozen=True):
    """Webhook deliveries of budget and balance alerts (proxy.credits.webhooks)."""

    # How often the fleet's sender (one process, leased) looks for alerts due.
    every_s: Seconds = 1.0
    # One attempt's deadline: connecting, sending and the receiver's answer.
    timeout_s: Seconds = 10.0
    # The waits between attempts; an alert no endpoint accepted after the last is given up.
    retry_s: Annotated[tuple[Seconds, ...], msgspec.Meta(min_length=1, max_length=20)] = (
        10.0, 60.0, 300.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0, 43200.0)


class TelemetrySection(Section, frozen=True):
    """OpenTelemetry traces (proxy.observe.tracing): on when the section is present. The
    exporter's credentials, if the backend wants any, come from the environment
    (OTEL_EXPORTER_OTLP_TRACES_HEADERS, read by the exporter), never from this file."""

    # The OTLP/HTTP (protobuf) traces endpoint, e.g. a collector's or Jaeger's /v1/traces.
    endpoint: Annotated[str, msgspec.Meta(pattern="^https?://[^\\x00-\\x20\\x7f]+$")]
    # Share of new traces kept (parent-based: a trusted caller's sampled flag decides for it).
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    # Keep whatever the ratio says: 5xx answers and streams that broke after their 200 ...
    keep_errors: bool = True
    # ... and requests slower than this (0: none).
    keep_slower_than_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 0.0
    # Continue a caller's W3C trace (traceparent/tracestate); else every request starts one.
    trust_client_context: bool = False
    # Put the prompt and the completion's text in the spans (personal data: off as shipped).
    capture_content: bool = False
    service_name: NonEmpty = "inference-gateway"
    # How often the batch exporter sends, and one export's deadline.
    export_every_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0
    timeout_s: Seconds = 10.0


class BackendsFile(Section, frozen=True):
    gateway: GatewaySection = GatewaySection()
    server: ServerSection = ServerSection()
    upstream: UpstreamSection = UpstreamSection()
    health: HealthSection = HealthSection()
    supervisor: SupervisorSection = SupervisorSection()
    routing: RoutingSection = RoutingSection()
    media: MediaSection = MediaSection()
    alerts: AlertsSection = AlertsSection()
    telemetry: TelemetrySection | None = None
    backends: list[BackendSpec] = []
