"""What crosses the gateway: forward rules never let credentials or framing through."""

from __future__ import annotations

from multidict import CIMultiDict

from proxy.headers import HeaderRule, request_id_from


def test_forward_rule_exact_and_prefix() -> None:
    rule = HeaderRule(["x-sim-*", "X-Trace"])
    headers = CIMultiDict({"X-Sim-Status": "500", "x-trace": "t1", "X-Other": "no"})
    assert rule.select(headers) == {"x-sim-status": "500", "x-trace": "t1"}


def test_secrets_and_framing_never_forwarded_even_by_wildcard() -> None:
    rule = HeaderRule(["*"])
    headers = CIMultiDict({
        "Authorization": "Bearer secret", "X-API-Key": "k", "Cookie": "c", "Host": "h",
        "Content-Length": "3", "Transfer-Encoding": "chunked", "Connection": "x-hidden",
        "X-Hidden": "nominated by Connection", "Keep-Alive": "1", "X-Fine": "yes",
    })
    assert rule.select(headers) == {"x-fine": "yes"}


def test_empty_rule_forwards_nothing() -> None:
    assert HeaderRule([]).select(CIMultiDict({"X-Sim-Status": "500"})) == {}


def test_request_id_kept_only_when_well_formed() -> None:
    assert request_id_from("abc-123", "fresh") == "abc-123"
    assert request_id_from("bad id\r\n", "fresh") == "fresh"
    assert request_id_from("x" * 65, "fresh") == "fresh"
    assert request_id_from(None, "fresh") == "fresh"
