"""Embeddings: OpenAI's request (`client.embeddings.create`), its bounds and usage rules, the
bodies an embedding server gets (vLLM's and OpenAI's `/v1/embeddings`, text-embeddings-
inference's `/embed`), and OpenAI's answer built from what they send. Pure.

`input` is a text, a list of texts, a list of token ids, or a list of token-id lists, as
OpenAI's API takes it; every text and list must be non-empty. The hold is a bound on the input
tokens: a text's UTF-8 bytes (no tokenizer makes more tokens than bytes) plus `OVERHEAD` for the
special tokens a model adds, a token list's length plus the same. The charge is the server's own
count (vLLM's `usage.prompt_tokens`, TEI's `x-compute-tokens` header), never above the hold.

Vectors are relayed in the encoding asked for: vLLM and OpenAI encode base64 themselves; TEI
sends floats, which the gateway encodes as OpenAI does (little-endian float32, base64).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from proxy.validate import ErrorItem, validate_with, value_error, whole_numbers

EMBEDDINGS_PATH = "/v1/embeddings"  # vLLM, OpenAI
TEI_PATH = "/embed"  # text-embeddings-inference's own route
OVERHEAD = 8  # special tokens a model may add to one input ([CLS], [SEP], BOS, EOS ...)
TOKEN_ID_MAX = 2**31 - 1
MAX_INPUTS = 2048  # requests.toml [embed] max_inputs as shipped (the served document: its own)

_INPUT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1, "description": "One text"},
    {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS,
     "items": {"type": "string", "minLength": 1}, "description": "Texts"},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                               "maximum": TOKEN_ID_MAX},
     "description": "One input as token ids"},
    {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": {
        "type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                  "maximum": TOKEN_ID_MAX}},
     "description": "Inputs as token ids"},
]}


class EmbeddingsRequest(msgspec.Struct, kw_only=True, omit_defaults=True,
                        forbid_unknown_fields=True):
    """OpenAI's CreateEmbeddingRequest."""

    input: Annotated[str | list[Any], Meta(
        description="A text, texts, token ids, or lists of token ids (none empty); at most "
                    "requests.toml [embed] max_inputs of them")]
    model: Annotated[str, Meta(min_length=1)]
    encoding_format: Annotated[Literal["float", "base64"] | None, Meta(
        description="float (the default) or base64 (little-endian float32)")] = None
    dimensions: Annotated[int, Meta(ge=1, le=65536, description="Fewer dimensions, for models "
                                    "trained for it (Matryoshka)")] | None = None
    user: Annotated[str, Meta(max_length=256, description="Not sent on")] | None = None

    # parse_embeddings's reading of `input`, as the OpenAPI document states it.
    json_schema_rules: ClassVar[dict[str, Any]] = {"allOf": [
        {"description": "input: a non-empty text, or a non-empty list of non-empty texts, of "
                        "token ids, or of non-empty token-id lists",
         "properties": {"input": _INPUT_SCHEMA}}]}


@dataclass(frozen=True, slots=True)
class Embeddings:
    """An embeddings request as the gateway reads it: its inputs, one per vector."""

    req: EmbeddingsRequest
    inputs: list[str] | list[list[int]]
    single: bool  # `input` was one item (a text, or one list of token ids)

    @property
    def base64(self) -> bool:
        return self.req.encoding_format == "base64"


def parse_embeddings(body: object, max_inputs: int) -> Embeddings:
    """422 (RequestInvalid) for a body off the table, an empty or mixed input, or too many."""
    found: list[Embeddings] = []

    def rules(req: EmbeddingsRequest) -> list[ErrorItem]:
        value = whole_numbers(req.input)  # JSON's 7.0 is the token id 7
        if isinstance(value, str):
            if not value:
                return [_empty(("body", "input"))]
            found.append(Embeddings(req, [value], True))
            return []
        if not value:
            return [_empty(("body", "input"))]
        if all(_token_id(item) for item in value):  # one input as token ids
            found.append(Embeddings(req, [value], True))
            return []
        faults: list[ErrorItem] = []
        kind = str if isinstance(value[0], str) else list
        for i, item in enumerate(value):
            loc = ("body", "input", i)
            if isinstance(item, kind) and (kind is str or all(map(_token_id, item))):
                if not item:
                    faults.append(_empty(loc))
            else:
                faults.append(value_error(loc, "input must be a text, a list of texts, a list "
                                               "of token ids or a list of token-id lists"))
        if len(value) > max_inputs:
            faults.append({"loc": ["body", "input"], "type": "too_long",
                           "msg": f"List should have at most {max_inputs} items"})
        if not faults:
            found.append(Embeddings(req, value, False))
        return faults

    validate_with(body, EmbeddingsRequest, rules)
    return found[0]


def _token_id(item: object) -> bool:
    return type(item) is int and 0 <= item <= TOKEN_ID_MAX


def _empty(loc: tuple[str | int, ...]) -> ErrorItem:
    return value_error(loc, "an input must not be empty")


def worst_tokens(inputs: list[str] | list[list[int]]) -> int:
    """The most input tokens the server can count (the hold and the token limits)."""
    return sum((len(item.encode()) if isinstance(item, str) else len(item)) + OVERHEAD
               for item in inputs)


def batches(inputs: list[Any], size: int | None) -> Iterator[list[Any]]:
    """`inputs` in pieces of at most `size` (all at once when None)."""
    step = size or len(inputs)
    for start in range(0, len(inputs), step):
        yield inputs[start:start + step]


def openai_body(emb: Embeddings, inputs: list[Any], model: str) -> dict[str, Any]:
    """vLLM's (and OpenAI's) `/v1/embeddings` request for `inputs` (all or a batch)."""
    body: dict[str, Any] = {"model": model, "input": inputs[0] if emb.single else inputs,
                            "encoding_format": emb.req.encoding_format or "float"}
    if emb.req.dimensions is not None:
        body["dimensions"] = emb.req.dimensions
    return body


def tei_body(emb: Embeddings, inputs: list[Any]) -> dict[str, Any]:
    """text-embeddings-inference's `/embed` request: normalized vectors (as its OpenAI route
    and vLLM send them), a too-long input refused rather than cut."""
    body: dict[str, Any] = {"inputs": inputs, "normalize": True, "truncate": False}
    if emb.req.dimensions is not None:
        body["dimensions"] = emb.req.dimensions
    return body


class BadAnswer(Exception):
    """The server's answer is not the vectors asked for."""


def openai_vectors(answer: object, count: int, encoded: bool) -> tuple[list[Any], int | None]:
    """The vectors of a `/v1/embeddings` answer, in input order, and its prompt tokens."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or len(data) != count:
        raise BadAnswer("not one vector per input")
    vectors: list[Any] = [None] * count
    for item in data:
        index = item.get("index") if isinstance(item, dict) else None
        vector = item.get("embedding") if isinstance(item, dict) else None
        if type(index) is not int or not 0 <= index < count or vectors[index] is not None:
            raise BadAnswer("the vectors' indexes are not the inputs'")
        if not (isinstance(vector, str) if encoded else _floats(vector)):
            raise BadAnswer("a vector is not in the encoding asked for")
        vectors[index] = vector
    usage = answer.get("usage") if isinstance(answer, dict) else None
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return vectors, tokens if type(tokens) is int and tokens >= 0 else None


def tei_vectors(answer: object, count: int, encoded: bool) -> list[Any]:
    """The vectors of an `/embed` answer (lists of floats), base64-encoded when asked."""
    if not isinstance(answer, list) or len(answer) != count or not all(map(_floats, answer)):
        raise BadAnswer("not one vector per input")
    return [encode(vector) for vector in answer] if encoded else answer


_NUMBERS = frozenset({float, int})


def _floats(vector: object) -> bool:
    """A non-empty list of numbers (the types gathered in C: a 1,024-float vector in ~10 µs)."""
    return isinstance(vector, list) and bool(vector) and set(map(type, vector)) <= _NUMBERS


def encode(vector: list[float]) -> str:
    """A vector as OpenAI's base64 encoding: little-endian float32."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def answer_body(vectors: list[Any], model: str, tokens: int) -> dict[str, Any]:
    """OpenAI's CreateEmbeddingResponse."""
    return {"object": "list",
            "data": [{"object": "embedding", "embedding": vector, "index": i}
                     for i, vector in enumerate(vectors)],
            "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
