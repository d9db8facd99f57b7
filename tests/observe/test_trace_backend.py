"""The trace backend the tests read spans from (tests/support/trace_backend.py: a real Phoenix
behind an OTLP relay): spans the real OpenTelemetry SDK exports over OTLP/HTTP come back with
their ids, parent, kind, attributes, events, links and status; a failed install says why."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from tests.support import trace_backend as backends
from tests.support.trace_backend import TraceBackend

# Setup installs Phoenix on a new machine (~1.5 min) and starts it (~15 s): not the test's time.
pytestmark = pytest.mark.timeout(60, func_only=True)


def test_spans_come_back_with_parent_kind_attributes_events_and_links(
        trace_backend: TraceBackend) -> None:
    project = f"harness-{uuid.uuid4().hex[:12]}"  # this test's spans only
    provider = TracerProvider(resource=Resource.create(
        {"service.name": "trace-harness", "openinference.project.name": project}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
        endpoint=trace_backend.otlp_url)))
    tracer = provider.get_tracer("tests.observe")
    try:
        with tracer.start_as_current_span("earlier", kind=SpanKind.INTERNAL) as earlier:
            pass
        with tracer.start_as_current_span("POST /v1/chat/completions", kind=SpanKind.SERVER,
                                          attributes={"http.request.method": "POST",
                                                      "gateway.tier": "max"}) as server:
            server.set_attribute("gateway.attempts", 2)
            with tracer.start_as_current_span(
                    "upstream", kind=SpanKind.CLIENT,
                    links=[Link(earlier.get_span_context(), {"reason": "retry-of"})],
                    attributes={"server.port": 8081, "gen_ai.request.model": "acme/tiny"},
            ) as client:
                client.add_event("first_token", {"gateway.queued_ms": 12.5})
                client.set_status(Status(StatusCode.ERROR, "upstream 503"))
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()

    trace_id = format(server.get_span_context().trace_id, "032x")
    server_id = format(server.get_span_context().span_id, "016x")
    client_id = format(client.get_span_context().span_id, "016x")
    spans = trace_backend.trace(trace_id, project=project, timeout=10,
                                names=["POST /v1/chat/completions", "upstream"])
    assert [s["name"] for s in spans] == ["POST /v1/chat/completions", "upstream"]
    parent, child = spans

    assert (parent["trace_id"], parent["span_id"], parent["parent_id"]) == (trace_id, server_id,
                                                                             None)
    assert parent["kind"] == "SERVER"
    assert parent["attributes"] == {"http.request.method": "POST", "gateway.tier": "max",
                                    "gateway.attempts": 2}
    assert parent["events"] == [] and parent["links"] == []
    assert parent["status"] == "UNSET"
    assert parent["start_time"] <= child["start_time"] <= child["end_time"] <= parent["end_time"]

    assert (child["trace_id"], child["span_id"], child["parent_id"]) == (trace_id, client_id,
                                                                         server_id)
    assert child["kind"] == "CLIENT"
    assert child["attributes"]["server.port"] == 8081
    assert child["attributes"]["gen_ai.request.model"] == "acme/tiny"
    [event] = child["events"]
    assert (event["name"], event["attributes"]) == ("first_token", {"gateway.queued_ms": 12.5})
    assert child["start_time"] <= event["time"] <= child["end_time"]
    earlier_trace = format(earlier.get_span_context().trace_id, "032x")
    earlier_id = format(earlier.get_span_context().span_id, "016x")
    assert earlier_trace != trace_id
    assert child["links"] == [{"trace_id": earlier_trace, "span_id": earlier_id}]
    assert (child["status"], child["status_message"]) == ("ERROR", "upstream 503")

    # The linked span is a trace of its own; the project holds these three spans and no others.
    [linked] = trace_backend.trace(earlier_trace, project=project, timeout=5)
    assert (linked["name"], linked["kind"], linked["parent_id"]) == ("earlier", "INTERNAL", None)
    assert sorted(s["span_id"] for s in trace_backend.spans(project)) == sorted(
        [server_id, client_id, earlier_id])
    assert trace_backend.spans(f"{project}-none") == []


def test_a_project_named_in_the_request_header(trace_backend: TraceBackend) -> None:
    """Phoenix files a span under the OTLP request's x-project-name header, before its resource's
    project name (the relay passes the header on)."""
    project = f"header-{uuid.uuid4().hex[:12]}"
    provider = TracerProvider(resource=Resource.create(
        {"openinference.project.name": f"{project}-resource"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
        endpoint=trace_backend.otlp_url, headers={"x-project-name": project})))
    try:
        with provider.get_tracer("tests.observe").start_as_current_span("one") as span:
            pass
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()
    [found] = trace_backend.trace(format(span.get_span_context().trace_id, "032x"),
                                  project=project, timeout=10)
    assert (found["name"], found["kind"]) == ("one", "INTERNAL")
    assert trace_backend.spans(f"{project}-resource") == []


def test_a_failed_install_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "CACHE", tmp_path / "cache")  # empty: it must install
    monkeypatch.setenv("PYTHON", "/nonexistent/python3.11")  # and cannot make its venv
    backend = TraceBackend(tmp_path)
    with pytest.raises(backends.TraceBackendError) as failed:
        backend.start()
    assert "installing Phoenix failed" in str(failed.value)
    assert "/nonexistent/python3.11" in str(failed.value)  # the log's tail: the reason itself
    assert backend.proc is None


@pytest.mark.timeout(300)  # two Phoenix starts, beside whatever else the machine runs
def test_a_port_taken_before_phoenix_binds_it_is_traded_for_another(tmp_path: Path) -> None:
    backend = TraceBackend(tmp_path)
    with socket.socket() as squatter:  # what another test's server did to the suite once
        squatter.bind(("127.0.0.1", backend.port))
        squatter.listen()
        taken = backend.port
        try:
            backend.start()
            assert backend.port != taken
            assert httpx.get(backend.url + "/readyz", timeout=5).status_code == 200
            assert b"address already in use" in backend.log.read_bytes()
        finally:
            backend.stop()
