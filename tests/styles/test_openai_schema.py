"""Chat request schema, 422 details and the OpenAPI document (spec: chat table, 422, Limits)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import validate as validate_module
from proxy.app import openapi_document
from proxy.styles.openai_schema import ChatRequest, validate_chat
from proxy.validate import (
    MAX_ERRORS,
    RequestInvalid,
    schema_errors,
    validate,
)
from tests.support.chat_requests import (
    ACCEPTED,
    FIELD_DICTS,
    JSON_VALUES,
    PROPERTY,
    REJECTED,
    SPEC_FIELDS,
    body,
    err,
)


@pytest.mark.parametrize(("case", "payload"), ACCEPTED, ids=[c for c, _ in ACCEPTED])
def test_accepted(case: str, payload: dict[str, Any]) -> None:
    assert isinstance(validate_chat(payload), ChatRequest)


@pytest.mark.parametrize(("case", "payload", "expected"), REJECTED, ids=[c for c, *_ in REJECTED])
def test_rejected(case: str, payload: object, expected: list[dict[str, object]]) -> None:
    with pytest.raises(RequestInvalid) as info:
        validate_chat(payload)
    assert info.value.detail == expected


def test_every_spec_row_is_a_field_and_covered_by_the_table() -> None:
    info = msgspec.inspect.type_info(ChatRequest)
    assert isinstance(info, msgspec.inspect.StructType)
    assert [f.encode_name for f in info.fields] == SPEC_FIELDS
    cases = " ".join([c for c, _ in ACCEPTED] + [c for c, _, _ in REJECTED])
    assert all(name in cases for name in SPEC_FIELDS)


def test_valid_body_takes_only_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise AssertionError("slow path used for a valid body")

    monkeypatch.setattr(validate_module, "_explain", boom)
    req = validate_chat(body(async_=True, temperature=0.7))
    assert req.async_ is True
    assert req.temperature == 0.7


def test_error_count_is_capped() -> None:
    with pytest.raises(RequestInvalid) as info:
        validate_chat(body(messages=[1] * 10_000))
    assert len(info.value.detail) == MAX_ERRORS


# ---- the walker is generic: any later schema gets the same treatment --------------------------


class Text(msgspec.Struct, tag="text"):
    text: Annotated[str, msgspec.Meta(max_length=5)]


class Image(msgspec.Struct, tag="image"):
    url: Annotated[str, msgspec.Meta(pattern="^https://")]


class Other(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: Annotated[str, msgspec.Meta(min_length=1, max_length=3)]
    voice: Literal["Alice", "Brock"] | None = None
    blocks: list[Text | Image] = []
    ratio: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.5
    step: Annotated[int, msgspec.Meta(multiple_of=5)] = 5
    at: datetime | None = None


@pytest.mark.parametrize(("payload", "expected"), [
    ({"text": "abcd"}, [err(["text"], "String should have at most 3 characters",
                            "string_too_long")]),
    ({"text": "a", "voice": "Bob"}, [err(["voice"], "Input should be 'Alice' or 'Brock'",
                                         "literal_error")]),
    ({"text": "a", "ratio": 1}, [err(["ratio"], "Input should be less than 1", "less_than")]),
    ({"text": "a", "ratio": 0}, [err(["ratio"], "Input should be greater than 0",
                                     "greater_than")]),
    ({"text": "a", "step": 7}, [err(["step"], "Input should be a multiple of 5", "multiple_of")]),
    ({"text": "a", "blocks": [{"type": "text", "text": "toolong"}]},
     [err(["blocks", 0, "text"], "String should have at most 5 characters", "string_too_long")]),
    ({"text": "a", "blocks": [{"type": "image", "url": "http://x"}]},
     [err(["blocks", 0, "url"], "String should match pattern '^https://'",
          "string_pattern_mismatch")]),
    ({"text": "a", "blocks": [{"type": "video"}]},
     [err(["blocks", 0], "Input tag 'video' found using 'type' does not match any of the "
                         "expected tags: 'text', 'image'", "union_tag_invalid")]),
    ({"text": "a", "blocks": [{"url": "https://x"}]},
     [err(["blocks", 0], "Unable to extract tag using discriminator 'type'",
          "union_tag_not_found")]),
    # A type the walker does not model: msgspec's own verdict, at msgspec's path.
    ({"text": "a", "at": "yesterday"},
     [err(["at"], "Value error, Invalid RFC3339 encoded datetime", "value_error")]),
])
def test_generic_schema(payload: dict[str, Any], expected: list[dict[str, object]]) -> None:
    with pytest.raises(RequestInvalid) as info:
        validate(payload, Other)
    assert info.value.detail == expected


# ---- OpenAPI -----------------------------------------------------------------------------------


def chat_document() -> dict[str, Any]:
    return openapi_document()


def test_openapi_document_is_valid_3_1() -> None:
    doc = chat_document()
    assert doc["openapi"] == "3.1.0"
    orjson.dumps(doc)  # JSON-ready
    try:
        from openapi_spec_validator import validate as validate_spec
    except ImportError:  # pragma: no cover - structural checks only
        assert set(doc) >= {"openapi", "info", "paths", "components"}
    else:
        validate_spec(doc)


def test_openapi_chat_schema_carries_the_spec_bounds() -> None:
    doc = chat_document()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatRequest"]
    props = chat["properties"]

    def member(name: str) -> Any:
        kinds = [s for s in props[name]["anyOf"] if s.get("type") != "null"]
        assert len(kinds) == 1
        return kinds[0]

    assert list(props) == SPEC_FIELDS
    assert chat["required"] == ["model", "messages"]
    assert chat["additionalProperties"] is False
    assert member("temperature") == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    assert member("top_p")["maximum"] == 1.0
    assert member("max_completion_tokens") == {"type": "integer", "minimum": 1, "maximum": 128000}
    assert props["max_tokens"]["deprecated"] is True
    assert member("n") == {"type": "integer", "minimum": 1, "maximum": 10}
    assert member("top_logprobs") == {"type": "integer", "minimum": 0, "maximum": 20}
    assert {"type": "array", "items": {"type": "string"}, "maxItems": 4} in props["stop"]["anyOf"]
    assert member("mode") == {"enum": ["auto", "direct", "network"]}
    assert props["messages"]["minItems"] == 1
    assert "additionalProperties" not in schemas["ChatMessage"]  # messages may carry more

    post = doc["paths"]["/v2/compat/v1/chat/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatRequest"}
    responses = post["responses"]
    assert set(responses) == {"200", "202", "400", "401", "402", "403", "404", "409", "413",
                              "415", "422", "429", "502", "503", "504"}
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert responses["422"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ValidationErrorBody")
    assert "Retry-After" in responses["429"]["headers"]
    assert doc["components"]["securitySchemes"]["ApiKeyHeader"]["name"] == "X-API-Key"
    assert {"BearerAuth": []} in post["security"] and {} in post["security"]


# ---- properties: nothing a client sends escapes as anything but RequestInvalid ---------------

def assert_outcome(payload: object) -> None:
    try:
        assert isinstance(validate_chat(payload), ChatRequest)
    except RequestInvalid as exc:
        assert exc.detail
        for item in exc.detail:
            assert list(item) == ["loc", "msg", "type"]
            assert isinstance(item["loc"], list) and item["loc"][0] == "body"
            assert all(isinstance(part, str | int) for part in item["loc"])
            assert isinstance(item["msg"], str) and isinstance(item["type"], str)
        orjson.dumps(exc.detail)


@PROPERTY
@given(JSON_VALUES)
def test_any_json_value_is_accepted_or_refused_cleanly(payload: object) -> None:
    assert_outcome(payload)


@PROPERTY
@given(FIELD_DICTS)
def test_any_field_dict_is_accepted_or_refused_cleanly(payload: dict[str, Any]) -> None:
    assert_outcome(payload)


@PROPERTY
@given(FIELD_DICTS)
def test_walker_agrees_with_msgspec(payload: dict[str, Any]) -> None:
    """The walker finds a fault exactly when msgspec refuses: no fallback needed for chat."""
    try:
        msgspec.convert(payload, ChatRequest)
    except msgspec.ValidationError:
        assert schema_errors(payload, ChatRequest)
    else:
        assert schema_errors(payload, ChatRequest) == []


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(SPEC_FIELDS), st.floats() | st.integers() | JSON_VALUES))
def test_nan_infinity_and_huge_numbers_are_refused_cleanly(payload: dict[str, Any]) -> None:
    assert_outcome(payload)


MEDIA_PARTS = [
    {"type": "text", "text": "hi"}, {"image_pil": 1}, {"image_embeds": "e"},
    {"type": "prompt_embeds", "data": "e"}, {"image_url": "http://x"}, {"image_url": "data:,x"},
    {"image_url": {"url": "DATA:image/png;base64,AA=="}}, {"image_url": {"url": "https://a"}},
    {"file": {"file_id": "f"}}, {"file": {"file_id": "f", "file_data": "abc"}},
    {"input_audio": {"data": "abc", "format": "wav"}}, {"video_url": 5}, {"audio_url": {}},
    {"image_url": {"url": 3, "file_id": 1}}, {"audio_url": "ftp://x", "image_url": "data:,"},
]


@pytest.mark.parametrize("part", MEDIA_PARTS, ids=lambda part: orjson.dumps(part).decode())
def test_the_document_says_which_content_parts_the_gateway_refuses(part: dict[str, Any]
                                                                   ) -> None:
    """The published message schema and the media check (families/chat.check_media) accept
    the same content parts: embeddings, URLs the engine would fetch, file ids are refused by
    both (schemathesis found a part the document allowed and the gateway refused)."""
    from jsonschema import Draft202012Validator

    from proxy.credits.pricing import media_parts
    from proxy.families.chat import _unusable

    doc = chat_document()
    message = {"$ref": "#/components/schemas/ChatMessage", "components": doc["components"]}
    schema_ok = Draft202012Validator(message).is_valid({"role": "user", "content": [part]})
    body = {"messages": [{"role": "user", "content": [part]}]}
    assert schema_ok == all(_unusable(p) is None for p in media_parts(body))
