"""The SSE decoder against the WHATWG rules and every upstream dialect, fed in any split."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.http.sse import DONE_FRAME, Event, SSEDecoder, frame


def decode_all(*chunks: bytes) -> list[Event]:
    decoder = SSEDecoder()
    events: list[Event] = []
    for chunk in chunks:
        events.extend(decoder.feed(chunk))
    return events + decoder.finish()


def test_openai_dialect() -> None:
    events = decode_all(b'data: {"a":1}\n\ndata: [DONE]\n\n')
    assert [e.data for e in events] == [b'{"a":1}', b"[DONE]"]


def test_tgi_dialect_no_space_and_keepalive_comments() -> None:
    events = decode_all(b'data:{"a":1}\n\n:\n\ndata:{"b":2}\n\ndata:[DONE]\n\n')
    assert [e.data for e in events] == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


def test_anthropic_named_events() -> None:
    events = decode_all(b'event: ping\ndata: {"type":"ping"}\n\nevent: message_stop\ndata: {}\n\n')
    assert [(e.event, e.data) for e in events] == [("ping", b'{"type":"ping"}'),
                                                   ("message_stop", b"{}")]


def test_line_endings_crlf_cr_and_split_crlf() -> None:
    assert [e.data for e in decode_all(b"data: a\r\n\r\ndata: b\r\rdata: c\n\n")] == [
        b"a", b"b", b"c"]
    # A CRLF split across two reads is one line ending, not two.
    assert [e.data for e in decode_all(b"data: a\r", b"\n\r\ndata: b\r\n\r\n")] == [b"a", b"b"]


def test_multiline_data_bom_and_empty_events() -> None:
    events = decode_all(b"\xef\xbb\xbfdata: one\ndata: two\n\nevent: x\n\ndata\n\n")
    # An event with no data is not dispatched; a bare `data` line is an empty data field.
    assert [e.data for e in events] == [b"one\ntwo", b""]


def test_unterminated_final_event_is_discarded() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a":1}\n\ndata: {"cut') == [Event(b'{"a":1}')]
    assert decoder.finish() == []


def test_frame_round_trips() -> None:
    assert frame(b'{"x":1}') == b'data: {"x":1}\n\n'
    assert frame(b"a\nb", "message_start") == b"event: message_start\ndata: a\ndata: b\n\n"
    assert DONE_FRAME == b"data: [DONE]\n\n"


payloads = st.lists(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")),
    min_size=1, max_size=8,
)


@given(payloads=payloads, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
       newline=st.sampled_from([b"\n", b"\r\n", b"\r"]), space=st.booleans())
def test_any_split_of_any_dialect_gives_the_same_events(
    payloads: list[bytes], cuts: list[int], newline: bytes, space: bool
) -> None:
    sep = b"data: " if space else b"data:"
    stream = b"".join(sep + p + newline + newline for p in payloads)
    points = sorted({min(c, len(stream)) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    got = [e.data for e in decode_all(*pieces)]
    # One leading space is stripped by the rules, so a payload that starts with a space loses it
    # only when there was no separator space.
    want = [p if space or not p.startswith(b" ") else p[1:] for p in payloads]
    assert got == want
