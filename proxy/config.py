"""backends.toml and policies/*.toml, parsed once into frozen, typed objects.

Strict: an unknown key, an unknown policy file or a value of the wrong type is an error naming the
file and the key (``backends.toml: backends[0].modles: Extra inputs are not permitted``), and every
error in a file is reported, not just the first. The same msgspec Structs describe the files and
check them, through the collector the request validator uses.
"""

from __future__ import annotations

import ipaddress
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec

from proxy.headers import NEVER_FORWARDED
from proxy.validate import RequestInvalid, validate

BackendKind = Literal["tgi", "vllm", "openai", "ollama", "whisper", "tts", "image", "video"]

Family = Literal["chat", "tts", "asr", "image", "video"]
# How a request is run (DESIGN §6 "Modes"): on one backend of the model's direct pool, or
# redundantly on several of its network pool, the answer a quorum agrees on returned.
Mode = Literal["direct", "network"]

# Backend kinds that serve OpenAI-compatible `/v1/chat/completions` (vLLM, TGI's Messages API,
# OpenAI itself, Ollama's OpenAI dialect).
CHAT_KINDS: frozenset[str] = frozenset({"tgi", "vllm", "openai", "ollama"})
FAMILY_OF_KIND: dict[str, Family] = {
    "tgi": "chat", "vllm": "chat", "openai": "chat", "ollama": "chat",
    "whisper": "asr", "tts": "tts", "image": "image", "video": "video"}
# The spec's TTS voice presets (what `preset_voice` may name).
VOICE_PRESETS = ("Alice", "Avery", "Brock", "Chloe", "Ella", "Emma", "Grace", "Karen", "Kevin",
                 "Lucas", "Matt", "William")

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


def _direct_only() -> list[Mode]:
    return ["direct"]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base for every config table: immutable, keyword-only, unknown keys refused."""


class GatewaySection(_Section, frozen=True):
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
    # every admission the wait behind an fsync on Redis' main thread (DESIGN §4; README).
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


class ServerSection(_Section, frozen=True):
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


class UpstreamSection(_Section, frozen=True):
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


class BackendSpec(_Section, frozen=True):
    name: NonEmpty
    kind: BackendKind
    url: NonEmpty
    models: Annotated[list[NonEmpty], msgspec.Meta(min_length=1)]
    max_concurrency: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 64
    # The pools this backend is in: "direct" (one backend answers) and/or "network" (the request
    # runs on several backends of the network pool and a quorum must agree); a backend may be in
    # both. Network replicas must answer alike, so list only servers of the same weights there.
    modes: Annotated[list[Mode], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=_direct_only)
    weight: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1
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


class HealthSection(_Section, frozen=True):
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


class SupervisorSection(_Section, frozen=True):
    """How supervised backends (those with `command`) are started, restarted and stopped."""

    startup_timeout_s: Seconds = 600.0  # model loading can take minutes
    grace_s: Seconds = 10.0  # SIGTERM, then this long, then SIGKILL
    backoff_base_s: Seconds = 1.0
    backoff_max_s: Seconds = 60.0


Pick = Literal["prefix", "engine", "p2c"]
Weight = Annotated[float, msgspec.Meta(ge=0, le=1000)]


class RoutingSection(_Section, frozen=True):
    """How a chat pool picks a replica (proxy.upstream.routing); other pools use "p2c"."""

    # "prefix": one replica per shared prefix (warm prefix cache), within the load bound;
    # "engine": the lowest load by the engines' own figures; "p2c": two random choices.
    pick: Pick = "prefix"
    models: dict[str, Pick] = {}  # per model, over `pick`
    # "prefix" passes over a replica above (1 + load_bound) x the pool's mean load.
    load_bound: Annotated[float, msgspec.Meta(ge=0, le=10)] = 0.25
    # The engine load score: waiting, running, KV-cache use (0-1), and the requests this worker
    # sent since the last read of the engine's figures.
    waiting_weight: Weight = 1.0
    running_weight: Weight = 0.5
    kv_cache_weight: Weight = 4.0
    sent_weight: Weight = 1.0


class BackendsFile(_Section, frozen=True):
    gateway: GatewaySection = GatewaySection()
    server: ServerSection = ServerSection()
    upstream: UpstreamSection = UpstreamSection()
    health: HealthSection = HealthSection()
    supervisor: SupervisorSection = SupervisorSection()
    routing: RoutingSection = RoutingSection()
    backends: list[BackendSpec] = []


class ChatRequestPolicy(_Section, frozen=True):
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=64 * 1024 * 1024)] = 1024 * 1024


Bytes = Annotated[int, msgspec.Meta(ge=1024, le=1024 * 1024 * 1024)]


class TtsRequestPolicy(_Section, frozen=True):
    # The spec's schema says 10,000 characters, another of its statements 2,000: choose here
    # (at most the schema's 10,000).
    max_characters: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 10_000
    default_model: NonEmpty = "acme/csm-1b"
    max_body_bytes: Bytes = 256 * 1024
    # Largest audio a TTS server may answer with (it is checked, and converted when needed).
    max_audio_bytes: Bytes = 128 * 1024 * 1024


class AsrRequestPolicy(_Section, frozen=True):
    default_model: NonEmpty = "acme/large-v3"
    max_body_bytes: Bytes = 64 * 1024
    # Longest audio accepted; a request holds this many seconds' price until it is measured.
    max_audio_s: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 600


class FetchPolicy(_Section, frozen=True):
    """Audio the gateway fetches for a client (`audio_url`, `custom_voice.url`): SSRF rules."""

    max_bytes: Bytes = 25 * 1024 * 1024
    connect_timeout_s: Seconds = 3.0
    timeout_s: Seconds = 20.0  # the whole fetch, redirects and body included
    max_redirects: Annotated[int, msgspec.Meta(ge=0, le=10)] = 3
    ports: list[Port] = msgspec.field(default_factory=lambda: [80, 443])
    # Networks fetched from although not public (e.g. ["10.1.2.0/24"] for an internal media
    # host). Everything else that is not a global address is refused.
    allow_networks: list[NonEmpty] = []


class GenerationRequestPolicy(_Section, frozen=True):
    """Image and video requests (bodies go to the provider as they are)."""

    max_body_bytes: Bytes = 1024 * 1024
    max_images: Annotated[int, msgspec.Meta(ge=1, le=100)] = 10  # `n` of one image request
    # Longest video one request may ask for; held until the answer is measured.
    max_video_s: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 20
    max_media_bytes: Bytes = 256 * 1024 * 1024  # largest answer a provider may send


class TasksPolicy(_Section, frozen=True):
    """Async tasks (`async: true`): the queue every worker runs, the results it keeps."""

    # Tasks one account may have submitted and not yet ended; past it, 429.
    max_open_per_account: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 20
    # How long a finished task's result (and its media) can be polled.
    result_ttl_s: Annotated[int, msgspec.Meta(ge=60, le=30 * 86400)] = 86_400
    # A task whose worker stopped (crashed) is taken over by another after this long.
    claim_idle_s: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 30.0
    # Tasks one worker process runs at once.
    runners_per_worker: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8
    # Longest a task may wait and run before its record expires as lost.
    max_run_s: Annotated[int, msgspec.Meta(ge=60, le=7 * 86400)] = 3600


Replicas = Annotated[int, msgspec.Meta(ge=2, le=9)]


class NetworkPolicy(_Section, frozen=True):
    """Network mode (DESIGN §6): each request runs on `replicas` distinct backends of the
    model's network pool, and an answer counts only when `quorum` of them agree on it."""

    # Backends one request runs on; the network pool needs at least this many (check-config).
    replicas: Replicas = 2
    # Identical answers needed; unset: a majority (replicas // 2 + 1). At most `replicas`.
    quorum: Annotated[int, msgspec.Meta(ge=1, le=9)] | None = None
    # Sent as `seed` to chat backends, so sampling replicas can agree at any temperature.
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0

    @property
    def needed(self) -> int:
        """The quorum in force: `quorum`, or a majority of `replicas`."""
        return self.quorum if self.quorum is not None else self.replicas // 2 + 1


class RequestsPolicy(_Section, frozen=True):
    """policies/requests.toml: caps on what a request may carry."""

    chat: ChatRequestPolicy = ChatRequestPolicy()
    tts: TtsRequestPolicy = TtsRequestPolicy()
    asr: AsrRequestPolicy = AsrRequestPolicy()
    fetch: FetchPolicy = FetchPolicy()
    generation: GenerationRequestPolicy = GenerationRequestPolicy()
    tasks: TasksPolicy = TasksPolicy()
    network: NetworkPolicy = NetworkPolicy()


class KeysPolicy(_Section, frozen=True):
    # Keys look like `<prefix>_sk_<random><checksum>`; the prefix makes leaked keys easy to scan.
    prefix: Annotated[str, msgspec.Meta(pattern="^[a-z][a-z0-9]{1,15}$")] = "igw"
    # How long a worker trusts its cached copy of a key record; revocations are pushed at once.
    cache_ttl_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0


class JwtPolicy(_Section, frozen=True):
    """Signed bearer tokens. Off unless `algorithms` is set; the algorithms are pinned here."""

    algorithms: list[Literal["HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "ES256",
                             "ES384", "PS256"]] = []
    secret_env: str | None = None  # HS*: environment variable holding the shared secret
    public_key_file: str | None = None  # RS*/ES*/PS*: PEM file (relative to the config folder)
    jwks_file: str | None = None  # RS*/ES*/PS*: a JWKS file; the token's `kid` picks the key
    issuer: str | None = None
    audience: str | None = None
    leeway_s: Annotated[float, msgspec.Meta(ge=0, le=300)] = 30.0
    account_claim: str = "sub"
    tier_claim: str = "tier"
    role_claim: str = "role"


class ClientsPolicy(_Section, frozen=True):
    # X-Forwarded-For is believed only when the connection comes from one of these networks.
    trusted_proxies: list[str] = []
    # Guests are told apart by address; an IPv6 client owns a whole prefix (a /64 is one
    # subscriber's LAN), so it is bucketed by this many leading bits.
    ipv6_guest_prefix: Annotated[int, msgspec.Meta(ge=32, le=128)] = 64
    # Unknown API keys a client address may try per minute (per worker) before its lookups get
    # 429 without asking Redis: minted well-formed keys cannot make one Redis call each.
    key_lookups_per_minute: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 60


class AuthPolicy(_Section, frozen=True):
    """policies/auth.toml: API keys, JWT bearer tokens, how guests are told apart."""

    keys: KeysPolicy = KeysPolicy()
    jwt: JwtPolicy = JwtPolicy()
    clients: ClientsPolicy = ClientsPolicy()


PerMinute = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
STANDARD_GROUP = "standard"  # the group of every model no `[groups]` entry names
ANY_GROUP = "*"


class TierPolicy(_Section, frozen=True):
    requests_per_minute: PerMinute
    families: list[Family]
    # model group (or "*") -> the modes this tier may use its models in
    models: dict[str, list[Mode]]
    # Largest completion a request may ask for; a request that names none gets this as its cap.
    max_tokens_per_request: Annotated[int, msgspec.Meta(ge=1, le=128_000)] | None = None
    # When Redis is unreachable: "open" admits up to the per-process fallback rate, "closed"
    # answers 503 with Retry-After.
    store_down: Literal["open", "closed"] = "open"
    fallback_requests_per_minute: PerMinute = 5
    # Backpressure: refused (503 pool_saturated, nothing held) while the model's engines have
    # this many requests waiting per replica, or more; unset: never refused for that.
    queue_budget: Annotated[int, msgspec.Meta(ge=0, le=100_000)] | None = None


_ALL_FAMILIES: list[Family] = ["chat", "tts", "asr", "image", "video"]
_BOTH_MODES: list[Mode] = ["direct", "network"]


def _default_tiers() -> dict[str, TierPolicy]:
    """DESIGN.md §6: the spec's tier table, and guests on every model at a strict rate."""
    basic: dict[str, list[Mode]] = {STANDARD_GROUP: _BOTH_MODES}
    pro: dict[str, list[Mode]] = {**basic, "large-chat": ["direct"]}
    return {
        "guest": TierPolicy(requests_per_minute=3, families=_ALL_FAMILIES,
                            models={ANY_GROUP: _BOTH_MODES}, max_tokens_per_request=512,
                            fallback_requests_per_minute=1),
        "basic": TierPolicy(requests_per_minute=20, families=["chat", "tts", "asr"],
                            models=basic),
        "pro": TierPolicy(requests_per_minute=60, families=["chat", "tts", "asr", "image"],
                          models=pro),
        "max": TierPolicy(requests_per_minute=130, families=_ALL_FAMILIES,
                          models={**pro, "large-chat": _BOTH_MODES}),
    }


class TiersPolicy(_Section, frozen=True):
    """policies/tiers.toml: what each tier may do, and how fast."""

    # group name -> models in it; a model in no group is in "standard".
    groups: dict[str, list[NonEmpty]] = msgspec.field(
        default_factory=lambda: {"large-chat": ["acme/gpt-oss-120b"]}
    )
    tiers: dict[str, TierPolicy] = msgspec.field(default_factory=_default_tiers)

    def group_of(self, model: str) -> str:
        for group, models in self.groups.items():
            if model in models:
                return group
        return STANDARD_GROUP


MicroCredits = Annotated[int, msgspec.Meta(ge=0, le=10**12)]


class Rates(_Section, frozen=True):
    """Prices in micro-credits (1 credit = 1,000,000 micro-credits); integers, never floats."""

    prompt_per_1k_tokens: MicroCredits = 0
    # Prompt tokens the engine found in its prefix cache (vLLM reports them with
    # --enable-prompt-tokens-details); unset: the prompt price.
    cached_prompt_per_1k_tokens: MicroCredits | None = None
    completion_per_1k_tokens: MicroCredits = 0
    per_1k_characters: MicroCredits = 0  # TTS input
    per_audio_second: MicroCredits = 0  # ASR
    per_image: MicroCredits = 0
    per_video_second: MicroCredits = 0


class ModelPrice(Rates, frozen=True):
    network: Rates | None = None  # network mode's own price, when it differs


class PricesPolicy(_Section, frozen=True):
    """policies/prices.toml: what each model costs; every charge records `version`."""

    version: NonEmpty = "default"
    default: ModelPrice = ModelPrice()
    models: dict[str, ModelPrice] = {}
    # The worst case held for a request that names no completion cap (and whose tier sets none).
    default_max_tokens: Annotated[int, msgspec.Meta(ge=1, le=128_000)] = 4096
    # A hold left by a crashed worker is released after this long: longer than any request
    # (check-config holds it above 2 x (connect + first byte) + max_stream_s of [upstream]).
    hold_ttl_s: Annotated[int, msgspec.Meta(ge=1, le=7 * 86400)] = 3600
    # Journal retention: money entries kept per account (older ones fold into a checkpoint
    # that reconcile still adds up); guests' usage entries, kept fewer and for less long.
    journal_max_entries: Annotated[int, msgspec.Meta(ge=100, le=10_000_000)] = 100_000
    guest_journal_max_entries: Annotated[int, msgspec.Meta(ge=10, le=1_000_000)] = 1000
    guest_journal_ttl_s: Annotated[int, msgspec.Meta(ge=60, le=365 * 86400)] = 7 * 86400

    def for_model(self, model: str, mode: str) -> Rates:
        price = self.models.get(model, self.default)
        if mode == "network" and price.network is not None:
            return price.network
        return price


class Policies(_Section, frozen=True):
    requests: RequestsPolicy = RequestsPolicy()
    auth: AuthPolicy = AuthPolicy()
    tiers: TiersPolicy = TiersPolicy()
    prices: PricesPolicy = PricesPolicy()


# policies/<name>.toml -> the field of `Policies` it fills.
POLICY_FILES: dict[str, type[msgspec.Struct]] = {
    "requests.toml": RequestsPolicy,
    "auth.toml": AuthPolicy,
    "tiers.toml": TiersPolicy,
    "prices.toml": PricesPolicy,
}


class Config(_Section, frozen=True):
    root: str
    gateway: GatewaySection
    server: ServerSection
    upstream: UpstreamSection
    health: HealthSection
    supervisor: SupervisorSection
    routing: RoutingSection
    backends: tuple[BackendSpec, ...]
    policies: Policies

    @property
    def data_dir(self) -> Path:
        return Path(self.root) / self.gateway.data_dir


class ConfigError(Exception):
    """Every problem found in the config folder, one `file: key: message` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


S = TypeVar("S", bound=msgspec.Struct)


def load_config(folder: str | Path = ".") -> Config:
    """Read backends.toml and policies/*.toml from `folder`; ConfigError lists every fault."""
    root = Path(folder).resolve()
    problems: list[str] = []

    backends_path = root / "backends.toml"
    backends = _load_file(backends_path, "backends.toml", BackendsFile, problems)
    if backends is not None:
        problems.extend(_check_backends(backends))

    policies: dict[str, Any] = {}
    policy_dir = root / "policies"
    if policy_dir.is_dir():
        for path in sorted(policy_dir.glob("*.toml")):
            label = f"policies/{path.name}"
            schema = POLICY_FILES.get(path.name)
            if schema is None:
                known = ", ".join(sorted(POLICY_FILES))
                problems.append(f"{label}: unknown policy file (known: {known})")
                continue
            loaded = _load_file(path, label, schema, problems)
            if loaded is not None:
                policies[path.stem] = loaded

    if "tiers" in policies:
        problems.extend(_check_tiers(policies["tiers"]))
    if "requests" in policies:
        problems.extend(_check_networks(policies["requests"].fetch))
        problems.extend(_check_network_mode(policies["requests"].network))
    if backends is not None:
        problems.extend(_check_network_pools(
            backends.backends, policies.get("requests", RequestsPolicy()).network))
        problems.extend(_check_routing(backends))
    if "auth" in policies:
        from proxy.identity.jwt import check_jwt_policy  # it imports this module

        problems.extend(f"policies/auth.toml: jwt: {p}"
                        for p in check_jwt_policy(policies["auth"].jwt, root))
    if backends is not None:
        problems.extend(_check_request_life(backends.upstream,
                                            policies.get("prices", PricesPolicy())))
    if problems or backends is None:
        raise ConfigError(problems)
    return Config(
        root=str(root),
        gateway=backends.gateway,
        server=backends.server,
        upstream=backends.upstream,
        health=backends.health,
        supervisor=backends.supervisor,
        routing=backends.routing,
        backends=tuple(backends.backends),
        policies=Policies(**policies),
    )


def _load_file(path: Path, label: str, schema: type[S], problems: list[str]) -> S | None:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(f"{label}: file not found in {path.parent}")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{label}: cannot read: {exc.__class__.__name__}")
        return None
    except tomllib.TOMLDecodeError as exc:
        problems.append(f"{label}: not valid TOML: {exc}")
        return None
    try:
        return validate(data, schema)
    except RequestInvalid as exc:
        for item in exc.detail:
            problems.append(f"{label}: {_key_path(item['loc'])}: {item['msg']}")
        return None


def _key_path(loc: object) -> str:
    parts = list(loc) if isinstance(loc, list | tuple) else []
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _check_backends(file: BackendsFile) -> list[str]:
    """Rules that span fields: unique names, usable URLs, readable key variables."""
    problems: list[str] = []
    seen: set[str] = set()
    for i, backend in enumerate(file.backends):
        where = f"backends.toml: backends[{i}]"
        if backend.name in seen:
            problems.append(f"{where}.name: duplicate backend name {backend.name!r}")
        seen.add(backend.name)
        url = urlsplit(backend.url)
        if url.scheme not in ("http", "https") or not url.hostname:
            problems.append(f"{where}.url: must be an http:// or https:// URL with a host")
        elif url.query or url.fragment or url.username or url.password:
            problems.append(f"{where}.url: must not carry a query, fragment or credentials")
        for name in backend.forward_headers:
            if name.rstrip("*").lower() in NEVER_FORWARDED | {""}:
                problems.append(f"{where}.forward_headers: {name!r} may never be forwarded")
        for preset in backend.voices:
            if preset not in VOICE_PRESETS:
                problems.append(f"{where}.voices: {preset!r} is not a preset "
                                f"({', '.join(VOICE_PRESETS)})")
        problems.extend(_check_modes(backend, where))
        if backend.health_path and not backend.health_path.startswith("/"):
            problems.append(f"{where}.health_path: must start with '/' (or be \"\" for none)")
        problems.extend(_check_supervised(backend, where))
    problems.extend(_check_fleet_sections(file))
    return problems


def _check_modes(backend: BackendSpec, where: str) -> list[str]:
    problems = []
    if len(set(backend.modes)) != len(backend.modes):
        problems.append(f"{where}.modes: lists a mode twice")
    if "network" in backend.modes and FAMILY_OF_KIND[backend.kind] == "asr":
        problems.append(f"{where}.modes: speech recognition is direct-only (DESIGN §6)")
    return problems


def _check_supervised(backend: BackendSpec, where: str) -> list[str]:
    if backend.command is None:
        if backend.env or backend.cwd is not None:
            return [f"{where}: env and cwd apply only to a backend with a command"]
        return []
    problems = []
    if not backend.command:
        problems.append(f"{where}.command: must name the program to run")
    for key in backend.env:
        if not key or "=" in key or "\0" in key:
            problems.append(f"{where}.env: {key!r} is not an environment variable name")
    return problems


def _check_fleet_sections(file: BackendsFile) -> list[str]:
    problems = []
    if file.health.ejection_base_s > file.health.ejection_max_s:
        problems.append("backends.toml: health.ejection_base_s: must not exceed ejection_max_s")
    if file.supervisor.backoff_base_s > file.supervisor.backoff_max_s:
        problems.append("backends.toml: supervisor.backoff_base_s: must not exceed backoff_max_s")
    # A port two supervised backends both listen on: one of them could never start.
    started: dict[tuple[str | None, int], str] = {}
    for i, backend in enumerate(file.backends):
        if backend.command is None:
            continue
        url = urlsplit(backend.url)
        address = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
        if address in started:
            problems.append(f"backends.toml: backends[{i}].url: the same address as "
                            f"{started[address]!r}, also started by the gateway")
        started.setdefault(address, backend.name)
    return problems


def _check_network_mode(network: NetworkPolicy) -> list[str]:
    if network.quorum is not None and network.quorum > network.replicas:
        return [f"policies/requests.toml: network.quorum: must not exceed network.replicas "
                f"({network.quorum} > {network.replicas}): no answer could ever be agreed"]
    return []


def _check_network_pools(specs: list[BackendSpec], network: NetworkPolicy) -> list[str]:
    """A network pool smaller than `replicas` could never run a request: every one would 503."""
    serving: dict[str, list[str]] = {}
    for spec in specs:
        if "network" in spec.modes:
            for model in spec.models:
                serving.setdefault(model, []).append(spec.name)
    return [f"backends.toml: model {model!r} is offered in network mode by {len(names)} "
            f"backend(s) ({', '.join(names)}), fewer than policies/requests.toml "
            f"network.replicas ({network.replicas})"
            for model, names in serving.items() if len(names) < network.replicas]


def _check_routing(backends: BackendsFile) -> list[str]:
    """A per-model pick must name a chat model some backend serves (a typo would do nothing)."""
    chat = {m for s in backends.backends if FAMILY_OF_KIND[s.kind] == "chat" for m in s.models}
    return [f"backends.toml: routing.models: {model!r} is not a chat model of any backend"
            for model in backends.routing.models if model not in chat]


def _check_request_life(upstream: UpstreamSection, prices: PricesPolicy) -> list[str]:
    """A request must end before its hold can expire: the sweeper would release a hold whose
    stream is still running, and that stream would be free."""
    longest = upstream.longest_request_s
    if longest >= prices.hold_ttl_s:
        return [f"policies/prices.toml: hold_ttl_s: must exceed the longest a request may run, "
                f"2 x (connect_timeout_s + first_byte_timeout_s) + max_stream_s from "
                f"backends.toml [upstream] ({longest:.0f} s)"]
    return []


def _check_networks(fetch: FetchPolicy) -> list[str]:
    problems = []
    for network in fetch.allow_networks:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError:
            problems.append(f"policies/requests.toml: fetch.allow_networks: {network!r} is not "
                            "a network (e.g. 10.1.2.0/24)")
    return problems


def _check_tiers(tiers: TiersPolicy) -> list[str]:
    where = "policies/tiers.toml"
    problems: list[str] = []
    if "guest" not in tiers.tiers:
        problems.append(f"{where}: tiers.guest: the guest tier is required (callers without keys)")
    known = set(tiers.groups) | {STANDARD_GROUP, ANY_GROUP}
    for name, tier in tiers.tiers.items():
        for group in tier.models:
            if group not in known:
                problems.append(f"{where}: tiers.{name}.models.{group}: unknown model group")
    owner: dict[str, str] = {}
    for group, models in tiers.groups.items():
        if group in (STANDARD_GROUP, ANY_GROUP):
            problems.append(f"{where}: groups.{group}: reserved group name")
        for model in models:
            if model in owner:
                problems.append(f"{where}: groups.{group}: {model!r} is already in "
                                f"{owner[model]!r}")
            owner[model] = group
    return problems
