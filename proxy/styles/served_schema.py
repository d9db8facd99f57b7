"""The vLLM-style chat request (the served route): the spec's chat fields plus vLLM's extensions
(protocols.md §3.1). Unknown top-level fields are still refused: vLLM would silently ignore a
misspelt sampling parameter, and a caller deserves to know."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from proxy.styles.openai_schema import JSON_INT_MAX, ChatRequest, JsonInt

JSONObject = dict[str, Any]


class ServedResponseFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["json_object", "text", "json_schema"]
    json_schema: JSONObject | None = None


class ServedChatRequest(ChatRequest, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """POST /v2/served/v1/chat/completions."""

    # vLLM also takes json_schema; msgspec lets a subclass redefine a field, mypy does not.
    response_format: ServedResponseFormat | None = None  # type: ignore[assignment]
    # OpenAI fields vLLM honours
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = None
    # Sampling
    top_k: Annotated[int, Meta(ge=-1, le=JSON_INT_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=2)] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=128000)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[JsonInt] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=1, le=JSON_INT_MAX)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    allowed_token_ids: list[JsonInt] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    # Chat template
    chat_template: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    documents: list[JSONObject] | None = None
    echo: bool | None = None
    # Other
    structured_outputs: JSONObject | None = None
    priority: JsonInt | None = None
    request_id: Annotated[str, Meta(max_length=128)] | None = None
    mm_processor_kwargs: JSONObject | None = None
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool | None = None
    include_reasoning: bool | None = None
