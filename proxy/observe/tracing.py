"""OpenTelemetry traces ([telemetry] in backends.toml): one trace per request, exported over
OTLP/HTTP (protobuf) by the SDK's batch processor, in a thread of its own.

A request's spans are not opened and closed as it runs: its `Trace` (proxy.observe.trace) notes
each stage's times as they pass, and `finish` turns them into the SDK's `ReadableSpan`s after
the answer, only for a trace that is kept. So a request pays a few clock reads whether or not
it is sampled, and the span objects are made for the kept ones only.

Which traces are kept: the head decision is the SDK's parent-based ratio sampler (a trusted
caller's sampled flag wins; otherwise `sample_ratio` of new trace ids), made when the request
arrives and passed to the engines in `traceparent`. Because the spans are made after the answer,
the gateway can also keep what the head decision dropped: every 5xx answer and every stream that
broke after its 200 (`keep_errors`), and every request slower than `keep_slower_than_s`. The
engines' own spans follow the head decision only (they were told before the outcome was known).

Attributes follow OpenTelemetry's HTTP and GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.usage.input_tokens` ...) plus the gateway's own (`igw.tier`,
`igw.credits`, `igw.outcome`); never a key, an account, a header or anything from a body, unless
`capture_content` puts the prompt and the completion's text in (off as shipped).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import orjson
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy import __version__
from proxy.config import TelemetrySection
from proxy.observe.metrics import Metrics
from proxy.observe.trace import Spans, Trace, new_span_id
from proxy.outcome import Outcome

EXPORT_BATCH = 64  # spans per export
_BROKEN = frozenset({Outcome.CUT, Outcome.TIMEOUT, Outcome.FAILED})
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class Tracing:
    """The process's exporter and sampler (in `app[TRACING]` when [telemetry] is set)."""

    def __init__(self, settings: TelemetrySection, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self._ratio = TraceIdRatioBased(settings.sample_ratio)
        self._sampler = ParentBased(self._ratio)
        self._ids = RandomIdGenerator()
        self._propagator = TraceContextTextMapPropagator()
        self._resource = Resource.create({
            "service.name": settings.service_name, "service.version": __version__,
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"})
        self._scope = InstrumentationScope("inference-gateway", __version__)
        # Small batches: the exporter's thread encodes a batch holding the GIL, and the event
        # loop waits that long (a 512-span batch, the SDK's default, stalled it ~20 ms).
        exporter = OTLPSpanExporter(endpoint=settings.endpoint, timeout=settings.timeout_s)
        self._processor = BatchSpanProcessor(
            _Counted(exporter, metrics) if metrics is not None else exporter,
            schedule_delay_millis=settings.export_every_s * 1000,
            max_export_batch_size=EXPORT_BATCH)

    def shutdown(self) -> None:
        """Export what is queued (the SDK waits up to its export timeout), then stop."""
        self._processor.shutdown()  # type: ignore[no-untyped-call]

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self._processor.force_flush(int(timeout_s * 1000))

    # --- a request's trace -------------------------------------------------------------------

    def begin(self, headers: Mapping[str, str]) -> Spans:
        """A request's place: under a trusted caller's `traceparent`, or a new trace."""
        if not (self.settings.trust_client_context and "traceparent" in headers):
            # A new trace: the ratio sampler's own test on its id, without the SDK's call
            # (3 µs of context lookups and result objects, on every request).
            trace_id = self._ids.generate_trace_id()
            return Spans(trace_id, new_span_id(), None,
                         trace_id & TraceIdRatioBased.TRACE_ID_LIMIT < self._ratio.bound,
                         capture=self.settings.capture_content)
        context = self._propagator.extract(headers)
        parent = get_current_span(context).get_span_context()
        if not parent.is_valid:  # garbled: a new trace after all
            return self.begin({})
        decision = self._sampler.should_sample(context, parent.trace_id, "request")
        return Spans(parent.trace_id, new_span_id(), parent.span_id,
                     decision.decision.is_sampled(),  # type: ignore[no-untyped-call]
                     parent.trace_state.to_header(), capture=self.settings.capture_content)

    def link(self, spans: Spans, traceparent: str | None) -> None:
        """Link `spans` to the trace a W3C `traceparent` names (an async task's submitter)."""
        if traceparent:
            found = get_current_span(self._propagator.extract(
                {"traceparent": traceparent})).get_span_context()
            if found.is_valid:
                spans.links.append((found.trace_id, found.span_id))

    def keeps(self, trace: Trace, status: int, seconds: float) -> bool:
        """Whether the finished request's trace is exported (see the module's text)."""
        spans = trace.spans
        if spans is None:
            return False
        if spans.sampled:
            return True
        if self.settings.keep_errors and (status >= 500 or trace.outcome in _BROKEN):
            return True
        slow = self.settings.keep_slower_than_s
        return 0 < slow <= seconds

    def finish(self, trace: Trace, status: int, method: str | None) -> bool:
        """Export the request's spans if its trace is kept; whether it was. `method` None: an
        async task's run (a consumer of the queue, named by its route), not an HTTP request."""
        ended = time.monotonic()
        if not self.keeps(trace, status, ended - trace.started):
            return False
        spans = trace.spans
        assert spans is not None
        spans.kept = True
        offset = time.time_ns() - time.monotonic_ns()  # this request's clocks, read once

        def ns(moment: float) -> int:
            return int(moment * 1e9) + offset

        operation = trace.operation
        model = trace.model
        server = SpanContext(spans.trace_id, spans.span_id, False, _SAMPLED)
        parent = (SpanContext(spans.trace_id, spans.parent_id, True, _SAMPLED)
                  if spans.parent_id is not None else None)
        attributes = self._request_attributes(trace, status, method, operation)
        failed = status >= 500 or trace.outcome in _BROKEN
        out = [ReadableSpan(
            f"{method} {trace.route}" if method else trace.route, context=server, parent=parent,
            resource=self._resource, attributes=attributes,
            kind=SpanKind.SERVER if method else SpanKind.CONSUMER, start_time=ns(trace.started),
            end_time=ns(ended), instrumentation_scope=self._scope,
            links=[Link(SpanContext(t, s, True, _SAMPLED)) for t, s in spans.links],
            status=Status(StatusCode.ERROR) if failed else Status(StatusCode.UNSET))]
        first_token = (trace.started + trace.first_byte_s
                       if trace.first_byte_s is not None else None)
        calls = [stage for stage in spans.stages if stage.client]
        for stage in spans.stages:
            stage_attributes = dict(stage.attrs)
            events = [Event(name, timestamp=ns(at)) for name, at in stage.events]
            if stage.client:
                name = f"{operation} {model}" if operation and model else stage.name
                if operation:
                    stage_attributes["gen_ai.operation.name"] = operation
                if model:
                    stage_attributes["gen_ai.request.model"] = model
                if first_token is not None and stage.start <= first_token <= stage.end:
                    events.append(Event("gen_ai.first_token", timestamp=ns(first_token)))
                if stage is calls[-1]:  # what was relayed came from the last exchange
                    stage_attributes.update(_usage(trace))
            else:
                name = stage.name
            bad = "error.type" in stage_attributes
            out.append(ReadableSpan(
                name, context=SpanContext(spans.trace_id, stage.span_id or new_span_id(),
                                          False, _SAMPLED),
                parent=server, resource=self._resource, attributes=stage_attributes,
                events=events, kind=SpanKind.CLIENT if stage.client else SpanKind.INTERNAL,
                start_time=ns(stage.start), end_time=ns(stage.end),
                instrumentation_scope=self._scope,
                status=Status(StatusCode.ERROR) if bad else Status(StatusCode.UNSET)))
        for span in out:
            self._processor.on_end(span)
        return True

    def _request_attributes(self, trace: Trace, status: int, method: str | None,
                            operation: str | None) -> dict[str, Any]:
        attributes: dict[str, Any] = {"http.route": trace.route,
                                      "http.response.status_code": status}
        if method:
            attributes["http.request.method"] = method
        if operation:
            attributes["gen_ai.operation.name"] = operation
        if trace.model:
            attributes["gen_ai.request.model"] = trace.model
            if status < 400:
                attributes["gen_ai.response.model"] = trace.model
        if trace.tier:
            attributes["igw.tier"] = trace.tier
        if trace.backend:
            attributes["igw.backend"] = trace.backend
        if trace.error:
            attributes["error.type"] = trace.error
        if trace.outcome:
            attributes["igw.outcome"] = str(trace.outcome)
        if trace.credits:
            attributes["igw.credits"] = trace.credits
        if trace.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = trace.finish_reasons
        if trace.prompt is not None:  # capture_content: as the GenAI conventions' JSON strings
            attributes["gen_ai.input.messages"] = trace.prompt.decode()
        if trace.answer is not None:
            attributes["gen_ai.output.messages"] = orjson.dumps([{
                "role": "assistant", "parts": [{"type": "text", "content": "".join(trace.answer)}],
                **({"finish_reason": trace.finish_reasons[0]} if trace.finish_reasons else {})
            }]).decode()
        attributes.update(_usage(trace))
        return attributes


class _Counted(SpanExporter):
    """The OTLP exporter, counting what it sent and what it gave up on (after its own retries)
    in `igw_trace_spans_total`: a backend that is down shows there, not only in the log."""

    def __init__(self, inner: SpanExporter, metrics: Metrics) -> None:
        self._inner = inner
        self._counter = metrics.trace_spans

    def export(self, spans: Any) -> SpanExportResult:
        result = self._inner.export(spans)
        ok = result is SpanExportResult.SUCCESS
        self._counter.labels("sent" if ok else "failed").inc(len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def _usage(trace: Trace) -> dict[str, Any]:
    units = trace.units
    found: dict[str, Any] = {}
    if "prompt_tokens" in units:
        found["gen_ai.usage.input_tokens"] = units["prompt_tokens"]
    if "completion_tokens" in units:
        found["gen_ai.usage.output_tokens"] = units["completion_tokens"]
    for name, value in units.items():
        if not name.endswith("_tokens"):
            found[f"igw.usage.{name}"] = value
    return found

