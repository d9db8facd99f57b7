"""The embeddings request as the gateway reads it, the bodies servers get, the answers they send
(proxy.families.embed, pure): every fault named, nothing else raised, the hold a bound."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.families import embed
from proxy.simulators.vectors import input_tokens
from proxy.validate import RequestInvalid


def faults(body: Any, max_inputs: int = 8) -> list[tuple[Any, ...]]:
    with pytest.raises(RequestInvalid) as caught:
        embed.parse_embeddings(body, max_inputs)
    return [tuple(d["loc"]) for d in caught.value.detail]  # type: ignore[arg-type]


def test_each_spelling_of_input() -> None:
    one = embed.parse_embeddings({"model": "m", "input": "hi"}, 8)
    assert (one.inputs, one.single) == (["hi"], True)
    texts = embed.parse_embeddings({"model": "m", "input": ["a", "b"]}, 8)
    assert (texts.inputs, texts.single) == (["a", "b"], False)
    ids = embed.parse_embeddings({"model": "m", "input": [1, 2.0, 3]}, 8)  # 2.0 is JSON's 2
    assert (ids.inputs, ids.single) == ([[1, 2, 3]], True)
    lists = embed.parse_embeddings({"model": "m", "input": [[1], [2, 3]]}, 8)
    assert (lists.inputs, lists.single) == ([[1], [2, 3]], False)
    coded = embed.parse_embeddings({"model": "m", "input": "x", "encoding_format": "base64",
                                    "dimensions": 8}, 8)
    assert coded.base64 and coded.req.dimensions == 8


def test_every_fault_is_named() -> None:
    assert faults({"model": "m", "input": ""}) == [("body", "input")]
    assert faults({"model": "m", "input": []}) == [("body", "input")]
    assert faults({"model": "m", "input": ["a", "", 3]}) == [("body", "input", 1),
                                                             ("body", "input", 2)]
    assert faults({"model": "m", "input": [[1], [], [True]]}) == [("body", "input", 1),
                                                                  ("body", "input", 2)]
    assert faults({"model": "m", "input": [1, -1]}) == [("body", "input", 0),
                                                        ("body", "input", 1)]
    assert faults({"model": "m", "input": ["a"] * 9}) == [("body", "input")]
    assert faults({"model": "m", "input": 5}) == [("body", "input")]
    assert faults({"input": "a"}) == [("body", "model")]
    assert faults({"model": "m", "input": "a", "dimensions": 0}) == [("body", "dimensions")]
    assert faults({"model": "m", "input": "a", "encoding_format": "int8"}) == [
        ("body", "encoding_format")]
    assert faults({"model": "m", "input": "a", "extra": 1}) == [("body", "extra")]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=10)


@given(st.dictionaries(st.sampled_from(["model", "input", "encoding_format", "dimensions",
                                        "user", "x"]), json_values, max_size=5))
def test_any_body_is_read_or_refused_and_the_hold_bounds_it(body: dict[str, Any]) -> None:
    try:
        emb = embed.parse_embeddings(body, 3)
    except RequestInvalid as exc:
        assert exc.detail
        return
    assert 1 <= len(emb.inputs) <= 3 and all(emb.inputs)
    # The hold is above what any tokenizer makes: UTF-8 bytes (and the ids) plus specials.
    tokens = sum(len(input_tokens(i)) + 2 for i in emb.inputs)
    assert embed.worst_tokens(emb.inputs) >= tokens


def test_the_bodies_servers_get() -> None:
    emb = embed.parse_embeddings({"model": "client-name", "input": ["a", "b", "c"],
                                  "dimensions": 4, "encoding_format": "base64",
                                  "user": "u"}, 8)
    assert [len(b) for b in embed.batches(emb.inputs, 2)] == [2, 1]
    assert list(embed.batches(emb.inputs, None)) == [["a", "b", "c"]]
    assert embed.openai_body(emb, ["a", "b"], "served") == {
        "model": "served", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 4}
    assert embed.tei_body(emb, ["c"]) == {"inputs": ["c"], "normalize": True, "truncate": False,
                                          "dimensions": 4}
    one = embed.parse_embeddings({"model": "m", "input": [7, 8]}, 8)
    assert embed.openai_body(one, one.inputs, "m")["input"] == [7, 8]  # one input, as sent


def test_answers_are_checked_and_encoded_as_openai_does() -> None:
    floats = [0.5, -0.25, 1.0]
    coded = embed.encode(floats)
    assert struct.unpack("<3f", base64.b64decode(coded)) == (0.5, -0.25, 1.0)
    assert embed.tei_vectors([floats, floats], 2, True) == [coded, coded]
    answer = {"data": [{"index": 1, "embedding": [1.0]}, {"index": 0, "embedding": [2.0]}],
              "usage": {"prompt_tokens": 9}}
    assert embed.openai_vectors(answer, 2, False) == ([[2.0], [1.0]], 9)
    for bad in ({"data": [{"index": 0, "embedding": [1.0]}]},
                {"data": [{"index": 0, "embedding": [1.0]}, {"index": 0, "embedding": [1.0]}]},
                {"data": [{"index": 0, "embedding": "AAAA"}, {"index": 1, "embedding": [1]}]}):
        with pytest.raises(embed.BadAnswer):
            embed.openai_vectors(bad, 2, False)
    with pytest.raises(embed.BadAnswer):
        embed.tei_vectors([[1.0], []], 2, False)
    assert embed.answer_body(["x"], "m", 3) == {
        "object": "list", "data": [{"object": "embedding", "embedding": "x", "index": 0}],
        "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3}}
