"""The OpenAPI document against the code it describes, without a network: every route is an
operation, each request schema accepts exactly what its validator accepts (usage rules
included), and each route family's error bodies match the schema its responses name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given
from jsonschema import Draft202012Validator

from proxy.app import ROUTES, openapi_document
from proxy.errors import ErrorKind, GatewayError, validation_failed
from proxy.styles.anthropic import AnthropicStyle
from proxy.styles.anthropic_schema import MessagesRequest
from proxy.styles.anthropic_schema import usage_rules as anthropic_rules
from proxy.styles.base import ChatStyle
from proxy.styles.ollama import OllamaStyle
from proxy.styles.ollama_schema import OllamaChatRequest
from proxy.styles.ollama_schema import usage_rules as ollama_rules
from proxy.styles.openai import OpenAIStyle
from proxy.styles.openai_schema import ChatRequest, chat_usage_rules
from proxy.styles.served_schema import ServedChatRequest
from proxy.validate import RequestInvalid, validate_with
from tests.support.chat_requests import FIELD_DICTS, PROPERTY

DOC = openapi_document()
MODEL = "acme/small-chat"
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def schema_of(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                 "components": DOC["components"]})


def accepts(schema: type, rules: Callable[[Any], list[dict[str, object]]], body: object) -> bool:
    try:
        validate_with(body, schema, rules)
    except RequestInvalid:
        return False
    return True


def test_every_route_is_one_operation() -> None:
    documented = {(method.upper(), path) for path, item in DOC["paths"].items()
                  for method in item}
    assert documented == {(r.method, r.path) for r in ROUTES}
    assert len(documented) == len(ROUTES)


# ---- the request schemas say what the validators do -----------------------------------------

COMPAT_CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("minimal", {"messages": [USER]}, True),
    ("tool message without tool_call_id", {"messages": [{"role": "tool", "content": "x"}]},
     False),
    ("tool message with a null tool_call_id",
     {"messages": [{"role": "tool", "content": "x", "tool_call_id": None}]}, False),
    ("tool message", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, True),
    ("user message without content", {"messages": [{"role": "user"}]}, False),
    ("system message with null content", {"messages": [{"role": "system", "content": None}]},
     False),
    ("assistant with tool_calls only",
     {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, True),
    ("assistant with neither", {"messages": [{"role": "assistant", "tool_calls": []}]}, False),
    ("assistant with null tool_calls", {"messages": [{"role": "assistant", "tool_calls": None}]},
     False),
    ("stream with async", {"messages": [USER], "stream": True, "async": True}, False),
    ("stream false with async", {"messages": [USER], "stream": False, "async": True}, True),
    ("stream in network mode", {"messages": [USER], "stream": True, "mode": "network"}, False),
    ("stream in direct mode", {"messages": [USER], "stream": True, "mode": "direct"}, True),
    ("top_logprobs without logprobs", {"messages": [USER], "top_logprobs": 2}, False),
    ("top_logprobs with logprobs false",
     {"messages": [USER], "top_logprobs": 2, "logprobs": False}, False),
    ("top_logprobs with logprobs", {"messages": [USER], "top_logprobs": 2, "logprobs": True},
     True),
    ("top_logprobs null", {"messages": [USER], "top_logprobs": None}, True),
    ("tool_choice without tools", {"messages": [USER], "tool_choice": "auto"}, False),
    ("tool_choice with empty tools", {"messages": [USER], "tool_choice": "required",
                                      "tools": []}, False),
    ("tool_choice none without tools", {"messages": [USER], "tool_choice": "none"}, True),
    ("tool_choice with tools", {"messages": [USER], "tool_choice": "auto", "tools": [TOOL]},
     True),
    ("integral float for an integer", {"messages": [USER], "max_tokens": 64.0}, True),
    ("seed beyond 64 bits", {"messages": [USER], "seed": 2**63}, False),
]


@pytest.mark.parametrize(("case", "fields", "valid"), COMPAT_CASES,
                         ids=[c for c, _, _ in COMPAT_CASES])
@pytest.mark.parametrize("name", ["ChatRequest", "ServedChatRequest"])
def test_chat_schemas_and_validators_agree(name: str, case: str, fields: dict[str, Any],
                                           valid: bool) -> None:
    body = {"model": MODEL, **fields}
    struct = ChatRequest if name == "ChatRequest" else ServedChatRequest
    assert schema_of(name).is_valid(body) is valid
    assert accepts(struct, chat_usage_rules, body) is valid


@given(FIELD_DICTS)
@PROPERTY
def test_compat_schema_accepts_exactly_what_the_validator_accepts(payload: dict[str, Any]
                                                                  ) -> None:
    assert schema_of("ChatRequest").is_valid(payload) is \
        accepts(ChatRequest, chat_usage_rules, payload)


TEXT = {"type": "text", "text": "x"}
TOOL_USE = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
MESSAGES_CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("minimal", {}, True),
    ("system blocks", {"system": [TEXT]}, True),
    ("system block without type", {"system": [{"text": "x"}]}, False),
    ("tool_use in a user message", {"messages": [{"role": "user", "content": [TOOL_USE]}]},
     False),
    ("tool_use in an assistant message",
     {"messages": [USER, {"role": "assistant", "content": [TEXT, TOOL_USE]}]}, True),
    ("image in an assistant message", {"messages": [USER, {"role": "assistant", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, False),
    ("stream with async", {"stream": True, "async": True}, False),
    ("stream in network mode", {"stream": True, "mode": "network"}, False),
    ("tool_choice any without tools", {"tool_choice": {"type": "any"}}, False),
    ("tool_choice auto without tools", {"tool_choice": {"type": "auto"}}, True),
    ("tool_choice tool with tools", {"tool_choice": {"type": "tool", "name": "f"},
                                     "tools": [{"name": "f", "input_schema": {}}]}, True),
]


@pytest.mark.parametrize(("case", "fields", "valid"), MESSAGES_CASES,
                         ids=[c for c, _, _ in MESSAGES_CASES])
def test_messages_schema_and_validator_agree(case: str, fields: dict[str, Any],
                                             valid: bool) -> None:
    body = {"model": MODEL, "max_tokens": 16, "messages": [USER], **fields}
    assert schema_of("MessagesRequest").is_valid(body) is valid
    assert accepts(MessagesRequest, anthropic_rules, body) is valid


OLLAMA_CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("minimal", {"messages": [USER]}, True),
    ("no messages", {}, False),
    ("empty messages", {"messages": []}, False),
    ("unknown fields", {"messages": [USER], "truncate": True}, True),
    ("streaming in network mode", {"messages": [USER], "mode": "network"}, False),
    ("not streaming in network mode", {"messages": [USER], "mode": "network", "stream": False},
     True),
    ("top_logprobs without logprobs", {"messages": [USER], "top_logprobs": 1}, False),
    ("images on an assistant message",
     {"messages": [USER, {"role": "assistant", "content": "", "images": ["aGk="]}]}, False),
    ("images on a user message",
     {"messages": [{"role": "user", "content": "", "images": ["aGk="]}]}, True),
    ("tool_calls on a user message", {"messages": [
        {"role": "user", "content": "", "tool_calls": [{"function": {"name": "f"}}]}]}, False),
    ("seed below 64 bits", {"messages": [USER], "options": {"seed": -(2**63) - 1}}, False),
]


@pytest.mark.parametrize(("case", "fields", "valid"), OLLAMA_CASES,
                         ids=[c for c, _, _ in OLLAMA_CASES])
def test_ollama_schema_and_validator_agree(case: str, fields: dict[str, Any],
                                           valid: bool) -> None:
    body = {"model": MODEL, **fields}
    assert schema_of("OllamaChatRequest").is_valid(body) is valid
    assert accepts(OllamaChatRequest, ollama_rules, body) is valid


# ---- each family's error bodies are the ones documented ---------------------------------------

ERRORS = [GatewayError(ErrorKind.INVALID_API_KEY, "bad key"),
          GatewayError(ErrorKind.INVALID_JSON, "not JSON"),
          GatewayError(ErrorKind.RATE_LIMITED, "slow down", headers={"Retry-After": "1"}),
          GatewayError(ErrorKind.UPSTREAM_ERROR, "the model server failed"),
          validation_failed([{"loc": ["body", "model"], "msg": "Field required",
                              "type": "missing"}])]
FAMILIES: list[tuple[str, ChatStyle]] = [
    ("/v2/compat/v1/chat/completions", OpenAIStyle()),
    ("/v2/messages/v1/messages", AnthropicStyle()),
    ("/v2/native/api/chat", OllamaStyle()),
]


@pytest.mark.parametrize(("path", "style"), FAMILIES, ids=[p for p, _ in FAMILIES])
@pytest.mark.parametrize("error", ERRORS, ids=[e.kind.type for e in ERRORS])
def test_error_bodies_match_the_documented_family(path: str, style: ChatStyle,
                                                  error: GatewayError) -> None:
    response = DOC["paths"][path]["post"]["responses"][str(error.status)]
    schema = response["content"]["application/json"]["schema"]
    validator = Draft202012Validator({**schema, "components": DOC["components"]})
    body = orjson.loads(style.error_body(error))
    assert validator.is_valid(body), list(validator.iter_errors(body))
    # ... and not the other families' shapes (the schemas tell the families apart).
    for other_path, other in FAMILIES:
        if other_path != path:
            other_body = orjson.loads(other.error_body(error))
            assert not validator.is_valid(other_body), other_path


@pytest.mark.parametrize(("status", "kind"), [(503, ErrorKind.UNAVAILABLE),
                                              (400, ErrorKind.INVALID_REQUEST)])
def test_the_middlewares_refusals_are_documented_in_each_routes_shape(
    status: int, kind: ErrorKind
) -> None:
    # The middleware refuses before the route runs (draining: 503; an underscore in a header
    # name: 400), in the route's own error shape (the route table says whose).
    refusal = GatewayError(kind, "refused")
    for route in ROUTES:
        operation = DOC["paths"][route.path][route.method.lower()]
        if status == 503 and not route.doc.drains:  # health probes and scrapes go on
            continue
        body = orjson.loads(route.style.error_body(refusal) if route.style else refusal.json())
        response = operation["responses"][str(status)]
        if status == 503:
            assert response["headers"]["Retry-After"]["required"] is True
        schema = response["content"]["application/json"]["schema"]
        validator = Draft202012Validator({**schema, "components": DOC["components"]})
        assert validator.is_valid(body), operation["operationId"]
