"""policies/*.toml: what a request may carry (requests.toml), who is who (auth.toml), what each
tier may do (tiers.toml) and what it costs (prices.toml); `Policies` holds all four.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from proxy.config.vocabulary import Family, Mode, NonEmpty, Port, Seconds, Section


class ChatRequestPolicy(Section, frozen=True):
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=64 * 1024 * 1024)] = 1024 * 1024
    # Media parts (images, audio, video, files) one chat request may carry, inline as data:
    # URLs or base64 (a URL to fetch is refused): how many, how large each, how large in all.
    max_media_parts: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 8
    max_media_part_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1024 * 1024 * 1024)] = \
        10 * 1024 * 1024
    max_media_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1024 * 1024 * 1024)] = \
        20 * 1024 * 1024


Bytes = Annotated[int, msgspec.Meta(ge=1024, le=1024 * 1024 * 1024)]


class TtsRequestPolicy(Section, frozen=True):
    # The spec's schema says 10,000 characters, another of its statements 2,000: choose here
    # (at most the schema's 10,000).
    max_characters: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 10_000
    default_model: NonEmpty = "acme/csm-1b"
    max_body_bytes: Bytes = 256 * 1024
    # Largest audio a TTS server may answer with (it is checked, and converted when needed).
    max_audio_bytes: Bytes = 128 * 1024 * 1024
    # A cloned voice's sample (`custom_voice.url`): fetched no further than this many bytes,
    # refused when longer than this many seconds (measured by what it carries), and priced as
    # this many characters of text a second (held at the longest; charged as measured).
    max_voice_sample_bytes: Bytes = 2 * 1024 * 1024
    max_voice_sample_s: Annotated[int, msgspec.Meta(ge=1, le=600)] = 30
    voice_sample_characters_per_s: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 15


class AsrRequestPolicy(Section, frozen=True):
    default_model: NonEmpty = "acme/large-v3"
    max_body_bytes: Bytes = 64 * 1024
    # Longest audio accepted; a request holds this many seconds' price until it is measured.
    max_audio_s: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 600


class FetchPolicy(Section, frozen=True):
    """Audio the gateway fetches for a client (`audio_url`, `custom_voice.url`): SSRF rules."""

    max_bytes: Bytes = 25 * 1024 * 1024
    connect_timeout_s: Seconds = 3.0
    timeout_s: Seconds = 20.0  # the whole fetch, redirects and body included
    max_redirects: Annotated[int, msgspec.Meta(ge=0, le=10)] = 3
    ports: list[Port] = msgspec.field(default_factory=lambda: [80, 443])
    # Networks fetched from although not public (e.g. ["10.1.2.0/24"] for an internal media
    # host). Everything else that is not a global address is refused.
    allow_networks: list[NonEmpty] = []


class GenerationRequestPolicy(Section, frozen=True):
    """Image and video requests (bodies go to the provider as they are)."""

    max_body_bytes: Bytes = 1024 * 1024
    max_images: Annotated[int, msgspec.Meta(ge=1, le=100)] = 10  # `n` of one image request
    # Longest video one request may ask for; held until the answer is measured.
    max_video_s: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 20
    max_media_bytes: Bytes = 256 * 1024 * 1024  # largest answer a provider may send


class EmbedRequestPolicy(Section, frozen=True):
    """Embeddings (`/v2/compat/v1/embeddings`)."""

    max_body_bytes: Bytes = 2 * 1024 * 1024
    # Texts (or token lists) in one request; OpenAI's own limit is 2,048. A server that takes
    # fewer at once (backends.toml `max_batch_inputs`) gets them in batches.
    max_inputs: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 2048
    max_answer_bytes: Bytes = 256 * 1024 * 1024  # largest answer a server may send


class TasksPolicy(Section, frozen=True):
    """Async tasks (`async: true`): the queue every worker runs, the results it keeps."""

    # Tasks one account may have submitted and not yet ended; past it, 429.
    max_open_per_account: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 20
    # How long a finished task's result (and its media) can be polled.
    result_ttl_s: Annotated[int, msgspec.Meta(ge=60, le=30 * 86400)] = 86_400
    # The media (audio, images, video) one account may keep at once, in bytes: a task whose
    # media would pass it fails (not charged), and while an account is at it, its async
    # requests get 429 until older media expires.
    max_media_bytes_per_account: Annotated[int, msgspec.Meta(ge=1, le=1 << 50)] = 512 << 20
    # A task whose worker stopped (crashed) is taken over by another after this long.
    claim_idle_s: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 30.0
    # Tasks one worker process runs at once.
    runners_per_worker: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8
    # Longest a task may wait and run before its record expires as lost.
    max_run_s: Annotated[int, msgspec.Meta(ge=60, le=7 * 86400)] = 3600


Replicas = Annotated[int, msgspec.Meta(ge=2, le=9)]


class NetworkPolicy(Section, frozen=True):
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


class RequestsPolicy(Section, frozen=True):
    """policies/requests.toml: caps on what a request may carry."""

    chat: ChatRequestPolicy = ChatRequestPolicy()
    tts: TtsRequestPolicy = TtsRequestPolicy()
    asr: AsrRequestPolicy = AsrRequestPolicy()
    fetch: FetchPolicy = FetchPolicy()
    generation: GenerationRequestPolicy = GenerationRequestPolicy()
    embed: EmbedRequestPolicy = EmbedRequestPolicy()
    tasks: TasksPolicy = TasksPolicy()
    network: NetworkPolicy = NetworkPolicy()


class KeysPolicy(Section, frozen=True):
    # Keys look like `<prefix>_sk_<random><checksum>`; the prefix makes leaked keys easy to scan.
    prefix: Annotated[str, msgspec.Meta(pattern="^[a-z][a-z0-9]{1,15}$")] = "igw"
    # How long a worker trusts its cached copy of a key record; revocations are pushed at once.
    cache_ttl_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0


class JwtPolicy(Section, frozen=True):
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


class ClientsPolicy(Section, frozen=True):
    # X-Forwarded-For is believed only when the connection comes from one of these networks.
    trusted_proxies: list[str] = []
    # Guests are told apart by address; an IPv6 client owns a whole prefix (a /64 is one
    # subscriber's LAN), so it is bucketed by this many leading bits.
    ipv6_guest_prefix: Annotated[int, msgspec.Meta(ge=32, le=128)] = 64
    # Unknown API keys a client address may try per minute (per worker) before its lookups get
    # 429 without asking Redis: minted well-formed keys cannot make one Redis call each.
    key_lookups_per_minute: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 60


class AuthPolicy(Section, frozen=True):
    """policies/auth.toml: API keys, JWT bearer tokens, how guests are told apart."""

    keys: KeysPolicy = KeysPolicy()
    jwt: JwtPolicy = JwtPolicy()
    clients: ClientsPolicy = ClientsPolicy()


PerMinute = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
STANDARD_GROUP = "standard"  # the group of every model no `[groups]` entry names
ANY_GROUP = "*"


TokensPerMinute = Annotated[int, msgspec.Meta(ge=1, le=10**10)] | None
TokensPerDay = Annotated[int, msgspec.Meta(ge=1, le=10**12)] | None


class TokenLimits(Section, frozen=True):
    """Chat tokens in any minute and any day, across every gateway: prompt + completion,
    and the prompt's (input) and the completion's (output) on their own. A request reserves
    its worst case at admission and the engine's count replaces it at settlement
    (proxy.credits.token_windows). Unset: no such limit."""

    tokens_per_minute: TokensPerMinute = None
    tokens_per_day: TokensPerDay = None
    input_tokens_per_minute: TokensPerMinute = None
    input_tokens_per_day: TokensPerDay = None
    output_tokens_per_minute: TokensPerMinute = None
    output_tokens_per_day: TokensPerDay = None


class TierPolicy(TokenLimits, frozen=True, kw_only=True):
    """A tier; its token limits (TokenLimits' fields) count its requests to every model, and
    `group_tokens` adds limits on one model group's."""

    requests_per_minute: PerMinute
    families: list[Family]
    # model group (or "*") -> the modes this tier may use its models in
    models: dict[str, list[Mode]]
    # Largest completion a request may ask for; a request that names none gets this as its cap.
    max_tokens_per_request: Annotated[int, msgspec.Meta(ge=1, le=128_000)] | None = None
    # model group -> token limits on its models alone, on top of the tier's own
    group_tokens: dict[str, TokenLimits] = {}
    # When Redis is unreachable: "open" admits up to the per-process fallback rate, "closed"
    # answers 503 with Retry-After.
    store_down: Literal["open", "closed"] = "open"
    fallback_requests_per_minute: PerMinute = 5
    # Backpressure: refused (503 pool_saturated, nothing held) while the model's engines have
    # this many requests waiting per replica, or more; unset: never refused for that.
    queue_budget: Annotated[int, msgspec.Meta(ge=0, le=100_000)] | None = None
    # The gateway's queue (backends.toml [routing] dispatch): when a pool's engine slots are
    # all taken, a higher priority always runs first; a request that would wait longer than
    # max_queue_wait_s gets 503 pool_saturated with Retry-After at once, and one that waited
    # that long gets it then.
    priority: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0
    max_queue_wait_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0
    # The share of each pool's slots this tier's requests leave free for the tiers above it
    # (rounded down: a pool of one slot keeps none), so that a request of a higher tier finds
    # a slot at once rather than after the next one frees.
    headroom: Annotated[float, msgspec.Meta(ge=0, le=0.9)] = 0.0


_ALL_FAMILIES: list[Family] = ["chat", "tts", "asr", "image", "video", "embed"]
_BOTH_MODES: list[Mode] = ["direct", "network"]


def _default_tiers() -> dict[str, TierPolicy]:
    """DESIGN.md §6: the spec's tier table, and guests on every model at a strict rate."""
    basic: dict[str, list[Mode]] = {STANDARD_GROUP: _BOTH_MODES}
    pro: dict[str, list[Mode]] = {**basic, "large-chat": ["direct"]}
    return {
        "guest": TierPolicy(requests_per_minute=3, families=_ALL_FAMILIES,
                            models={ANY_GROUP: _BOTH_MODES}, max_tokens_per_request=512,
                            tokens_per_minute=6_000, tokens_per_day=60_000,
                            fallback_requests_per_minute=1, priority=0, max_queue_wait_s=2),
        "basic": TierPolicy(requests_per_minute=20, families=["chat", "tts", "asr", "embed"],
                            models=basic, tokens_per_minute=100_000,
                            tokens_per_day=1_000_000, priority=1, max_queue_wait_s=5),
        "pro": TierPolicy(requests_per_minute=60, families=["chat", "tts", "asr", "image", "embed"],
                          models=pro, priority=2, max_queue_wait_s=15),
        "max": TierPolicy(requests_per_minute=130, families=_ALL_FAMILIES,
                          models={**pro, "large-chat": _BOTH_MODES}, priority=3,
                          max_queue_wait_s=30),
    }


class TiersPolicy(Section, frozen=True):
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


class Rates(Section, frozen=True):
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


class PricesPolicy(Section, frozen=True):
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


class Policies(Section, frozen=True):
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
