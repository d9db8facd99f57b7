"""The bodies of the gateway's own answers as the OpenAPI document describes them (health,
readiness, keys, credits, account and usage, models, tasks, the ASR answer, the Anthropic and
Ollama shapes). Documentation only: extra properties are allowed everywhere. The request bodies
are the validators' own Structs (proxy/styles/, proxy/families/).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from proxy.api.doc_types import JSONObject


class Health(msgspec.Struct, kw_only=True):
    status: Literal["ok"]


class ReadyChecks(msgspec.Struct, kw_only=True):
    accepting: bool
    redis: bool
    backends: bool


class Ready(msgspec.Struct, kw_only=True):
    status: Literal["ready", "not ready"]
    checks: ReadyChecks


class Money(msgspec.Struct, kw_only=True):
    credits: Annotated[str, Meta(description="Decimal credits, 6 places")]
    micro_credits: int


class KeyView(msgspec.Struct, kw_only=True):
    id: Annotated[str, Meta(description="Key id (`key_` + 12 hex digits); never the key")]
    account: str
    tier: str
    status: Literal["active", "revoked"]
    label: str
    created: Annotated[int, Meta(description="Unix seconds")]


class CreatedKey(KeyView, kw_only=True):
    key: Annotated[str, Meta(description="The API key; shown this once only")]


class KeyList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[KeyView]


class AccountKeys(msgspec.Struct, kw_only=True):
    account: str
    keys: list[KeyView]


class CreditsAdded(msgspec.Struct, kw_only=True):
    account: str
    added: Money
    available: Money


class Reloaded(msgspec.Struct, kw_only=True):
    status: Literal["reloaded"]
    version: int


class TopSpender(msgspec.Struct, kw_only=True):
    account: str
    credits: Annotated[str, Meta(description="Decimal credits, 6 places")]
    micro_credits: int


class TopRefused(msgspec.Struct, kw_only=True):
    account: str
    refusals: Annotated[int, Meta(description="Answers 402, 403, 429 and 503 pool_saturated")]


class ErrorCount(msgspec.Struct, kw_only=True):
    count: int
    status: Annotated[int, Meta(description="The status it was answered with (most often)")]


class RecentError(msgspec.Struct, kw_only=True):
    ts: Annotated[float, Meta(description="Unix time of the answer")]
    status: int
    type: str
    route: Annotated[str, Meta(description="The route's template (\"unmatched\": none)")]
    model: Annotated[str | None, Meta(description="A model the router knows, once known")]
    request_id: Annotated[str, Meta(description="The answer's X-Request-Id")]


class ErrorsSeen(msgspec.Struct, kw_only=True):
    window_s: int
    by_type: Annotated[dict[str, ErrorCount], Meta(
        description="Error answers in the window by error type, most first")]
    recent: Annotated[list[RecentError], Meta(description="The last 50, newest first")]


class Overview(msgspec.Struct, kw_only=True):
    window_s: Annotated[int, Meta(description="What the top lists sum: this UTC hour and the "
                                              "23 before it")]
    top_spend: list[TopSpender]
    top_refused: list[TopRefused]
    errors: Annotated[ErrorsSeen, Meta(description="This minute and the 59 before it")]


class Balance(msgspec.Struct, kw_only=True):
    available: Money
    held: Money
    spent: Money
    credited: Money


class RateLimitView(msgspec.Struct, kw_only=True):
    limit: int
    remaining: int
    reset_s: int
    per: Literal["minute"]


class TokenWindow(msgspec.Struct, kw_only=True):
    group: Annotated[str | None, Meta(
        description="The model group it counts (null: the tier's, every model)")]
    kind: Annotated[Literal["tokens", "input_tokens", "output_tokens"], Meta(
        description="Prompt + completion tokens, or the prompt's or the completion's alone")]
    period: Literal["minute", "day"]
    limit: int
    used: Annotated[int, Meta(description="Reserved by requests in flight, or used")]
    remaining: int


class BudgetView(msgspec.Struct, kw_only=True):
    scope: Literal["account", "key"]
    key_id: str | None
    period: Literal["day", "week", "month"]
    limit: Money
    spent: Annotated[Money, Meta(description="Charged in this period")]
    held: Annotated[Money, Meta(description="Held by requests running now")]
    remaining: Money
    resets_at: Annotated[str, Meta(description="When the period ends (UTC, RFC 3339)")]


class AccountView(msgspec.Struct, kw_only=True):
    account: str
    tier: str
    key_id: str | None
    balance: Balance
    rate_limit: RateLimitView
    token_limits: Annotated[list[TokenWindow], Meta(
        description="The tier's chat token windows (empty when it has none)")]
    budgets: Annotated[list[BudgetView], Meta(
        description="Spend caps that reset each UTC day, week (from Monday) or month: the "
                    "account's and the calling key's")]
    postpaid: Annotated[bool, Meta(description="Runs on its budgets alone, no balance")]
    price_version: str


class BudgetsView(msgspec.Struct, kw_only=True):
    account: str
    postpaid: bool
    budgets: list[BudgetView]


class AlertSet(msgspec.Struct, kw_only=True):
    account: str
    below: Annotated[Money | None, Meta(description="null: no balance alert")]


class WebhookView(msgspec.Struct, kw_only=True):
    id: Annotated[str, Meta(description="`we_` + 16 hex digits")]
    url: str
    account: Annotated[str | None, Meta(description="null: every account's alerts")]
    created: Annotated[int, Meta(description="Unix seconds")]


class CreatedWebhook(WebhookView, kw_only=True):
    secret: Annotated[str, Meta(description="Signs every delivery (Igw-Signature); shown "
                                            "this once only")]


class WebhookList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[WebhookView]


class Delivery(msgspec.Struct, kw_only=True):
    state: Literal["pending", "delivered", "failed"]
    attempts: int
    last: Annotated[str | None, Meta(description="The last attempt's outcome: `HTTP 503`, "
                                                 "`timeout` ...")]


class AlertView(msgspec.Struct, kw_only=True):
    id: Annotated[str, Meta(description="The same on every delivery: receivers drop "
                                        "duplicates by it")]
    type: Literal["budget.threshold", "balance.low"]
    created: Annotated[int, Meta(description="Unix seconds")]
    account: str
    data: Annotated[JSONObject, Meta(description="docs/credits.md#alerts")]
    due: Annotated[bool, Meta(description="Still to be attempted")]
    deliveries: Annotated[dict[str, Delivery], Meta(description="Endpoint id -> its delivery")]


class AlertList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[AlertView]


class UsageTotals(msgspec.Struct, kw_only=True):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    characters: Annotated[int, Meta(description="Speech synthesis input")]
    audio_seconds: Annotated[float, Meta(description="Speech recognition input, decoded")]
    images: int
    video_seconds: float
    cost: Money


class JournalEntry(msgspec.Struct, kw_only=True):
    """One journal entry; the fields a charge carries, and more (route, mode, latency ...)."""

    id: Annotated[str, Meta(description="Its place in the journal: a `before` for paging")]
    type: Annotated[str, Meta(description="`charge` (a hold ended), `credit`, `usage` (guests)")]
    cost: Annotated[int | None, Meta(description="Micro-credits charged")] = None
    held: Annotated[int | None, Meta(description="Micro-credits the request held")] = None
    status: Annotated[str | None, Meta(description="How the request ended")] = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    estimated: Annotated[bool | None, Meta(description="Counted by the gateway (a cut "
                                                       "stream), not reported upstream")] = None
    request_id: str | None = None
    model: str | None = None


class Usage(msgspec.Struct, kw_only=True):
    account: str
    totals: UsageTotals
    by_model: dict[str, UsageTotals]
    by_day: Annotated[dict[str, UsageTotals], Meta(description="Keyed by UTC date, YYYY-MM-DD")]
    entries: Annotated[list[JournalEntry], Meta(description="Journal entries, newest first")]
    next_before: Annotated[str | None, Meta(description="`before` for the next page; null at "
                                                        "the end")]


class ModelInfo(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"]
    owned_by: str
    resource: Annotated[str, Meta(description="`mode.source.model` (its first mode)")]
    resources: Annotated[list[str], Meta(description="One per mode it is offered in")]
    task_family: str
    modes: list[str]
    tiers: Annotated[dict[str, list[str]], Meta(description="Mode -> tiers that may use it")]
    price: JSONObject
    healthy: bool


class AsrSegment(msgspec.Struct, kw_only=True):
    id: int
    start: float
    end: float
    text: str


class AsrWord(msgspec.Struct, kw_only=True):
    word: str
    start: float
    end: float


class AsrAnswer(msgspec.Struct, kw_only=True):
    """The spec's ASR response, plus segments or words when `return_timestamps` asks."""

    text: str
    language: Annotated[str, Meta(description="ISO 639-1 code")]
    duration: Annotated[float, Meta(description="Seconds of audio (as the gateway decoded it)")]
    segments: Annotated[list[AsrSegment] | None,
                        Meta(description="With return_timestamps: true")] = None
    words: Annotated[list[AsrWord] | None,
                     Meta(description="With return_timestamps: \"word\"")] = None
    words_estimated: Annotated[bool | None, Meta(
        description="true: the server gave segments only; word times are spread over each "
                    "segment by character offset")] = None


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[ModelInfo]


class AnthropicMessage(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: Annotated[list[JSONObject], Meta(description="text, thinking and tool_use blocks")]
    stop_reason: str | None
    usage: JSONObject
    task_id: Annotated[str, Meta(description="`direct:<uuid>` or `network:<uuid>`")]


class ResponseObject(msgspec.Struct, kw_only=True):
    """A Responses API `response` (proxy.styles.responses)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: Annotated[list[JSONObject], Meta(
        description="reasoning, message (output_text) and function_call items")]
    usage: JSONObject | None
    incomplete_details: JSONObject | None = None
    task_id: Annotated[str, Meta(description="`direct:<uuid>` or `network:<uuid>`")]


class OllamaAnswer(msgspec.Struct, kw_only=True):
    model: str
    created_at: str
    message: JSONObject
    done: Literal[True]
    done_reason: str
    task_id: Annotated[str, Meta(description="`direct:<uuid>` or `network:<uuid>`")]


class OllamaVersion(msgspec.Struct, kw_only=True):
    version: str


class OllamaModels(msgspec.Struct, kw_only=True):
    models: list[JSONObject]


class TaskError(msgspec.Struct, kw_only=True):
    type: str
    message: str
    status: int


class TaskRecord(msgspec.Struct, kw_only=True):
    """A task as its owner polls it."""

    task_id: str
    status: Literal["running", "completed", "failed"]
    result: Annotated[Any, Meta(description="completed: what the synchronous call answers; "
                                            "audio and video as {media_key, media_url, "
                                            "content_type, bytes}")] = None
    error: Annotated[TaskError | None, Meta(description="failed: why")] = None
    created_at: int
    updated_at: int


class EmbeddingItem(msgspec.Struct, kw_only=True):
    object: Literal["embedding"]
    embedding: Annotated[list[float] | str, Meta(
        description="The vector; with encoding_format base64, its little-endian float32 bytes "
                    "in base64")]
    index: Annotated[int, Meta(ge=0, description="Which input it is for")]


class EmbeddingsUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: Annotated[int, Meta(ge=0, description="Input tokens, as the server counted "
                                                         "them; what is charged")]
    total_tokens: Annotated[int, Meta(ge=0)]


class EmbeddingsAnswer(msgspec.Struct, kw_only=True):
    """OpenAI's CreateEmbeddingResponse."""

    object: Literal["list"]
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingsUsage
