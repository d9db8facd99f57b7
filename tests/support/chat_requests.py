"""The chat request table's cases (spec: chat table, 422): bodies the validator accepts, bodies
it refuses with their exact 422 details, and hypothesis strategies that draw bodies from those
values (tests/styles/test_openai_schema.py, and the OpenAPI schema's agreement in tests/api)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# The rows of the spec's chat request table, in order.
SPEC_FIELDS = [
    "model", "messages", "max_completion_tokens", "max_tokens", "temperature", "top_p",
    "frequency_penalty", "presence_penalty", "stop", "stream", "response_format", "seed", "n",
    "logprobs", "top_logprobs", "tools", "tool_choice", "stream_options", "store", "user",
    "chat_template_kwargs", "mode", "async",
]
USER = {"role": "user", "content": "hi"}
BASE: dict[str, Any] = {"model": "acme/small-chat", "messages": [USER]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def body(**fields: Any) -> dict[str, Any]:
    """BASE with fields set (a value of ... removes the field); `async_` spells `async`."""
    out = {**BASE, **{k.rstrip("_"): v for k, v in fields.items()}}
    return {k: v for k, v in out.items() if v is not ...}


def err(loc: list[str | int], msg: str, type_: str) -> dict[str, object]:
    return {"loc": ["body", *loc], "msg": msg, "type": type_}


def gte(loc: list[str | int], bound: str) -> dict[str, object]:
    return err(loc, f"Input should be greater than or equal to {bound}", "greater_than_equal")


def lte(loc: list[str | int], bound: str) -> dict[str, object]:
    return err(loc, f"Input should be less than or equal to {bound}", "less_than_equal")


INT = "Input should be a valid integer"
FRACTION = "Input should be a valid integer, got a number with a fractional part"
NUMBER, STRING, BOOL = ("Input should be a valid number", "Input should be a valid string",
                        "Input should be a valid boolean")
REQUIRED = "Field required"


def model_type(loc: list[str | int], name: str) -> dict[str, object]:
    return err(loc, f"Input should be a valid dictionary or instance of {name}", "model_type")


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("minimal", body()),
    ("model one char", body(model="m")),
    ("message extra properties", body(messages=[{**USER, "reasoning_content": "x", "x": [1]}])),
    ("content parts", body(messages=[{"role": "user", "content": [{"type": "text"}]}])),
    ("empty string content", body(messages=[{"role": "system", "content": ""}])),
    ("assistant with tool_calls only",
     body(messages=[USER, {"role": "assistant", "tool_calls": [{"id": "c1"}]}])),
    ("tool message", body(messages=[{"role": "tool", "content": "x", "tool_call_id": "c1"}])),
    *[(f"{f} {v}", body(**{f: v})) for f in ("max_completion_tokens", "max_tokens")
      for v in (1, 128_000, 100.0, None)],
    *[(f"temperature {v}", body(temperature=v)) for v in (0, 0.0, 1, 2, 2.0, None)],
    *[(f"top_p {v}", body(top_p=v)) for v in (0, 0.5, 1.0)],
    *[(f"{f} {v}", body(**{f: v})) for f in ("frequency_penalty", "presence_penalty")
      for v in (-2, -2.0, 0, 2.0)],
    *[(f"stop {v!r}", body(stop=v)) for v in ("END", [], ["a", "b", "c", "d"], None)],
    *[(f"stream {v}", body(stream=v)) for v in (True, False, None)],
    ("stream in direct mode", body(stream=True, mode="direct")),
    ("stream in auto mode", body(stream=True, mode="auto")),
    ("stream false with async", body(stream=False, async_=True)),
    *[(f"response_format {t}", body(response_format={"type": t})) for t in ("json_object", "text")],
    *[(f"seed {v}", body(seed=v)) for v in (0, -1, 2**63 - 1, -(2**63), 1e18, None)],
    *[(f"n {v}", body(n=v)) for v in (1, 10)],
    *[(f"logprobs {v}", body(logprobs=v)) for v in (True, False)],
    *[(f"top_logprobs {v}", body(top_logprobs=v, logprobs=True)) for v in (0, 20)],
    ("tools", body(tools=[TOOL])),
    ("tool without parameters, with description",
     body(tools=[{"type": "function", "function": {"name": "f", "description": "d"}}])),
    *[(f"tool_choice {v}", body(tools=[TOOL], tool_choice=v))
      for v in ("auto", "none", "required")],
    ("tool_choice none without tools", body(tool_choice="none")),
    ("tool_choice object", body(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})),
    ("stream_options", body(stream=True, stream_options={"include_usage": True})),
    ("stream_options empty", body(stream_options={})),
    ("store", body(store=True)),
    ("user", body(user="end-user-7")),
    ("chat_template_kwargs", body(chat_template_kwargs={"enable_thinking": True})),
    *[(f"mode {m}", body(mode=m)) for m in ("auto", "network", "direct")],
    ("async", body(async_=True)),
    ("every optional field null", body(**{f: None for f in SPEC_FIELDS[2:]})),
]


REJECTED: list[tuple[str, dict[str, Any], list[dict[str, object]]]] = [
    ("model missing", body(model=...), [err(["model"], REQUIRED, "missing")]),
    ("model empty", body(model=""),
     [err(["model"], "String should have at least 1 character", "string_too_short")]),
    ("model not a string", body(model=5), [err(["model"], STRING, "string_type")]),
    ("model null", body(model=None), [err(["model"], STRING, "string_type")]),
    ("messages missing", body(messages=...), [err(["messages"], REQUIRED, "missing")]),
    ("messages empty", body(messages=[]),
     [err(["messages"], "List should have at least 1 item after validation, not 0", "too_short")]),
    ("messages not a list", body(messages={"role": "user"}),
     [err(["messages"], "Input should be a valid list", "list_type")]),
    ("message not an object", body(messages=["hi"]), [model_type(["messages", 0], "ChatMessage")]),
    ("message role unknown", body(messages=[USER, {"role": "developer", "content": "x"}]),
     [err(["messages", 1, "role"], "Input should be 'system', 'user', 'assistant' or 'tool'",
          "literal_error")]),
    ("message role missing", body(messages=[{"content": "x"}]),
     [err(["messages", 0, "role"], REQUIRED, "missing")]),
    ("message content a number", body(messages=[{"role": "user", "content": 5}]),
     [err(["messages", 0, "content"], "Input should be a valid string or a valid list",
          "union_type")]),
    ("message content part not an object", body(messages=[{"role": "user", "content": ["x"]}]),
     [err(["messages", 0, "content", 0], "Input should be a valid dictionary", "dict_type")]),
    *[(f"{f} {v}", body(**{f: v}), [e]) for f in ("max_completion_tokens", "max_tokens")
      for v, e in ((0, gte([f], "1")), (128_001, lte([f], "128000")),
                   (1.5, err([f], FRACTION, "int_from_float")), (1e19, err([f], INT, "int_type")),
                   (1e6, lte([f], "128000")), ("100", err([f], INT, "int_type")),
                   (True, err([f], INT, "int_type")))],
    ("temperature below", body(temperature=-0.1), [gte(["temperature"], "0")]),
    ("temperature above", body(temperature=2.01), [lte(["temperature"], "2")]),
    ("temperature string", body(temperature="hot"), [err(["temperature"], NUMBER, "float_type")]),
    ("temperature bool", body(temperature=True), [err(["temperature"], NUMBER, "float_type")]),
    ("top_p below", body(top_p=-0.01), [gte(["top_p"], "0")]),
    ("top_p above", body(top_p=1.01), [lte(["top_p"], "1")]),
    *[(f"{f} {v}", body(**{f: v}), [e]) for f in ("frequency_penalty", "presence_penalty")
      for v, e in ((-2.01, gte([f], "-2")), (2.01, lte([f], "2")),
                   ([1], err([f], NUMBER, "float_type")))],
    ("stop 5 items", body(stop=list("abcde")),
     [err(["stop"], "List should have at most 4 items after validation, not 5", "too_long")]),
    ("stop item not a string", body(stop=["a", 1]), [err(["stop", 1], STRING, "string_type")]),
    ("stop a number", body(stop=5),
     [err(["stop"], "Input should be a valid string or a valid list", "union_type")]),
    ("stream string", body(stream="yes"), [err(["stream"], BOOL, "bool_type")]),
    ("stream int", body(stream=1), [err(["stream"], BOOL, "bool_type")]),
    ("response_format type unknown", body(response_format={"type": "json_schema"}),
     [err(["response_format", "type"], "Input should be 'json_object' or 'text'",
          "literal_error")]),
    ("response_format type missing", body(response_format={}),
     [err(["response_format", "type"], REQUIRED, "missing")]),
    ("response_format a string", body(response_format="json"),
     [model_type(["response_format"], "ResponseFormat")]),
    ("seed fractional", body(seed=1.5), [err(["seed"], FRACTION, "int_from_float")]),
    ("seed over 64 bits", body(seed=2**63), [lte(["seed"], "9223372036854775807")]),
    ("seed string", body(seed="42"), [err(["seed"], INT, "int_type")]),
    ("n 0", body(n=0), [gte(["n"], "1")]),
    ("n 11", body(n=11), [lte(["n"], "10")]),
    ("logprobs string", body(logprobs="true"), [err(["logprobs"], BOOL, "bool_type")]),
    ("top_logprobs -1", body(top_logprobs=-1, logprobs=True), [gte(["top_logprobs"], "0")]),
    ("top_logprobs 21", body(top_logprobs=21, logprobs=True), [lte(["top_logprobs"], "20")]),
    ("tools not a list", body(tools=TOOL), [err(["tools"], "Input should be a valid list",
                                                "list_type")]),
    ("tool type unknown", body(tools=[{**TOOL, "type": "code"}]),
     [err(["tools", 0, "type"], "Input should be 'function'", "literal_error")]),
    ("tool function missing", body(tools=[{"type": "function"}]),
     [err(["tools", 0, "function"], REQUIRED, "missing")]),
    ("tool function name missing", body(tools=[{"type": "function", "function": {}}]),
     [err(["tools", 0, "function", "name"], REQUIRED, "missing")]),
    ("tool parameters not an object",
     body(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     [err(["tools", 0, "function", "parameters"], "Input should be a valid dictionary",
          "dict_type")]),
    *[(f"tool_choice {v} without tools", body(tool_choice=v, tools=t),
       [err(["tool_choice"], "Value error, tool_choice needs tools", "value_error")])
      for v in ("auto", "required", {"type": "function", "function": {"name": "f"}})
      for t in (..., None, [])],
    ("tool_choice unknown word", body(tool_choice="any"),
     [err(["tool_choice"], "Input should be 'auto', 'none' or 'required'", "literal_error")]),
    ("tool_choice a number", body(tool_choice=1),
     [err(["tool_choice"], "Input should be 'auto', 'none' or 'required' or a valid dictionary",
          "union_type")]),
    ("tool_choice object without function", body(tool_choice={"type": "function"}),
     [err(["tool_choice", "function"], REQUIRED, "missing")]),
    ("stream_options include_usage string", body(stream_options={"include_usage": "yes"}),
     [err(["stream_options", "include_usage"], BOOL, "bool_type")]),
    ("stream_options a list", body(stream_options=[]),
     [model_type(["stream_options"], "StreamOptions")]),
    ("store string", body(store="no"), [err(["store"], BOOL, "bool_type")]),
    ("user number", body(user=7), [err(["user"], STRING, "string_type")]),
    ("chat_template_kwargs list", body(chat_template_kwargs=[]),
     [err(["chat_template_kwargs"], "Input should be a valid dictionary", "dict_type")]),
    ("mode unknown", body(mode="fast"),
     [err(["mode"], "Input should be 'auto', 'network' or 'direct'", "literal_error")]),
    ("async string", body(async_="yes"), [err(["async"], BOOL, "bool_type")]),
    ("python field name is not a wire name", {**BASE, "async_": True},
     [err(["async_"], "Extra inputs are not permitted", "extra_forbidden")]),
    ("unknown top-level field", body(api_base="http://169.254.169.254"),
     [err(["api_base"], "Extra inputs are not permitted", "extra_forbidden")]),
    ("body not an object", ["hi"], [model_type([], "ChatRequest")]),  # type: ignore[list-item]
    # usage rules (spec: Errors; DESIGN §6 modes), checked once the schema passes
    ("stream with async", body(stream=True, async_=True),
     [err(["stream"], "Value error, stream cannot be combined with async", "value_error")]),
    ("stream in network mode", body(stream=True, mode="network"),
     [err(["stream"], "Value error, stream is only available in direct mode", "value_error")]),
    *[(f"top_logprobs with logprobs {lp}", body(top_logprobs=2, logprobs=lp),
       [err(["top_logprobs"], "Value error, top_logprobs requires logprobs: true",
            "value_error")]) for lp in (..., False, None)],
    *[(f"{role} content {how}", body(messages=[USER, {"role": role, **extra}]),
       [err(["messages", 1, "content"], REQUIRED, "missing")])
      for role in ("system", "user")
      for how, extra in (("missing", {}), ("null", {"content": None}))],
    ("tool content missing", body(messages=[{"role": "tool", "tool_call_id": "c1"}]),
     [err(["messages", 0, "content"], REQUIRED, "missing")]),
    ("assistant without content or tool_calls", body(messages=[USER, {"role": "assistant"}]),
     [err(["messages", 1, "content"],
          "Value error, an assistant message needs content or tool_calls", "value_error")]),
    ("tool without tool_call_id", body(messages=[{"role": "tool", "content": "42"}]),
     [err(["messages", 0, "tool_call_id"], "Value error, a tool message needs tool_call_id",
          "value_error")]),
    ("three schema faults, in field order", body(model=..., temperature=3, n=0),
     [err(["model"], REQUIRED, "missing"), lte(["temperature"], "2"), gte(["n"], "1")]),
    ("three usage faults", body(stream=True, async_=True, mode="network", top_logprobs=1),
     [err(["stream"], "Value error, stream cannot be combined with async", "value_error"),
      err(["stream"], "Value error, stream is only available in direct mode", "value_error"),
      err(["top_logprobs"], "Value error, top_logprobs requires logprobs: true", "value_error")]),
]


# Every value the tables use, and any JSON, as hypothesis strategies.

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=6),
    max_leaves=12,
)


def table_values() -> dict[str, list[Any]]:
    """Every value the tables above use per field: edge values, valid and not, for hypothesis."""
    seen: dict[str, list[Any]] = {name: [] for name in SPEC_FIELDS}
    for _, payload, *_ in [*ACCEPTED, *REJECTED]:
        if isinstance(payload, dict):
            for name, value in payload.items():
                if name in seen and value not in seen[name]:
                    seen[name].append(value)
    return seen


FIELD_VALUES = {name: st.sampled_from(values) | JSON_VALUES
                for name, values in table_values().items()}
FIELD_VALUES["junk"] = JSON_VALUES
ANY_FIELDS = st.fixed_dictionaries({}, optional=FIELD_VALUES)
# A body from the tables with zero to two fields replaced: reaches acceptance and the
# usage rules far more often than independent random fields do.
CHANGE = st.sampled_from(sorted(FIELD_VALUES)).flatmap(
    lambda name: FIELD_VALUES[name].map(lambda value: (name, value)))
NEAR_VALID = st.builds(lambda base, changes: {**base, **dict(changes)},
                       st.sampled_from([p for _, p, *_ in [*ACCEPTED, *REJECTED]
                                        if isinstance(p, dict)]),
                       st.lists(CHANGE, max_size=2))
FIELD_DICTS = ANY_FIELDS | NEAR_VALID
PROPERTY = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
