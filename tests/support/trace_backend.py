"""Fixtures (a pytest plugin): a real OpenTelemetry trace backend for the session, Arize Phoenix,
that tests (and the processes they start) send spans to over OTLP/HTTP, and read back.

Phoenix (PyPI "arize-phoenix") is installed once, outside the clone, in its own venv under
$REAL_ENGINES_DIR/phoenix (default ~/.cache/real-engines; ~1.7 min and ~850 MB the first time)
by scripts/trace-backend/install-phoenix.sh, and run by serve-phoenix.sh beside it: in a new
session (its own process group), on free loopback ports, its spans in an in-memory SQLite
database; it is stopped with its group at the session's end. It answers /readyz in ~10-15 s
alone (~25 s beside two vLLM replicas starting) and holds ~420 MB. An install or a start that
fails FAILS the tests that use it, with the reason and the log's tail: they are never skipped.

What Phoenix keeps of a span, and what it does not. Its REST API (GET /v1/projects/NAME/spans)
gives the name, ids, parent id, times (to the microsecond), status, attributes and events. Its
OTLP decoder throws away the span's kind and its links (they are in neither the REST nor the
GraphQL API, nor its database), and the resource's attributes: it keeps only the project name
(the OTLP request's `x-project-name` header, else the resource's `openinference.project.name`,
else "default"). So `otlp_url` is not Phoenix's own /v1/traces but a relay in this process: it
reads each OTLP request on its way through (with the OTLP protobuf classes), keeps the kind and
links of every span in it, and hands the same bytes (and headers) to Phoenix, answering with
Phoenix's answer. `spans()` is Phoenix's REST answer, with the kind and links the relay saw.
Phoenix also adds the OpenInference attributes it derives from `gen_ai.*` ones, those the span
has not set itself (`openinference.span.kind`, `llm.token_count.*`, `llm.invocation_parameters`,
...): `attributes` holds those too, as Phoenix stores them.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import quote

import httpx
import pytest
from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

from tests.support.processes import free_ports, stop_group, tail

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "trace-backend"
INSTALL = SCRIPTS / "install-phoenix.sh"
SERVE = SCRIPTS / "serve-phoenix.sh"  # Phoenix's settings: loopback, in-memory, no extras
# The same cache as the vLLM venv (tests/support/real_engines.py).
CACHE = Path(os.environ.get("REAL_ENGINES_DIR") or "~/.cache/real-engines").expanduser()
INSTALL_TIMEOUT_S = 20 * 60  # a first install is ~1.5 min; a slow mirror gets room
START_TIMEOUT_S = 180  # ~15 s alone; more beside two vLLM replicas starting on two cores
STOP_GRACE_S = 10  # it stops in ~2 s
PORT_RETRIES = 3  # starts on other ports when another process took the one chosen
PAGE = 1000  # the REST API's largest page
FORWARD_TIMEOUT_S = 10.0  # the OTLP exporters' own default timeout
# Request headers the relay does not pass on (httpx sets its own).
HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                        "accept-encoding", "te", "upgrade", "proxy-connection"})


class TraceBackendError(Exception):
    """The trace backend cannot run: install or start failed (the message says why)."""


class SpanEvent(TypedDict):
    name: str
    attributes: dict[str, Any]
    time: datetime


class SpanLink(TypedDict):
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits


class SpanRecord(TypedDict):
    """One span as the backend has it."""

    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str | None  # 16 hex digits, None for a root span
    kind: str | None  # "SERVER", "CLIENT", "INTERNAL", "PRODUCER", "CONSUMER", "UNSPECIFIED";
    # None for a span that did not come through `otlp_url`
    start_time: datetime  # aware (UTC), to the microsecond
    end_time: datetime
    attributes: dict[str, Any]  # flat: {"http.request.method": "POST", ...}
    events: list[SpanEvent]
    links: list[SpanLink]  # [] also for a span that did not come through `otlp_url`
    status: str  # "UNSET", "OK" or "ERROR"
    status_message: str


class _Relay(ThreadingHTTPServer):
    """OTLP/HTTP in, the same request to Phoenix out; keeps each span's kind and links."""

    daemon_threads = True

    def __init__(self, target: str) -> None:
        super().__init__(("127.0.0.1", 0), _RelayHandler)
        self.target = target  # Phoenix's base URL
        self.seen: dict[tuple[str, str], tuple[str, list[SpanLink]]] = {}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, body: bytes, encoding: str | None) -> None:
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(gzip.decompress(body) if encoding == "gzip" else body)
        except (DecodeError, OSError, EOFError):
            return  # not OTLP protobuf (JSON?): Phoenix answers for it
        seen = {}
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    kind = OtlpSpan.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_")
                    links = [SpanLink(trace_id=link.trace_id.hex(), span_id=link.span_id.hex())
                             for link in span.links]
                    seen[(span.trace_id.hex(), span.span_id.hex())] = (kind, links)
        with self.lock:
            self.seen.update(seen)

    def kind_and_links(self, trace_id: str, span_id: str) -> tuple[str | None, list[SpanLink]]:
        with self.lock:
            kind, links = self.seen.get((trace_id, span_id), (None, []))
        return kind, list(links)


class _RelayHandler(BaseHTTPRequestHandler):
    server: _Relay
    protocol_version = "HTTP/1.1"  # keep-alive, as the exporters' sessions expect

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.partition("?")[0] == "/v1/traces":
            self.server.record(body, self.headers.get("Content-Encoding"))
        headers = {name: value for name, value in self.headers.items()
                   if name.lower() not in HOP_BY_HOP}  # x-project-name too: Phoenix reads it
        try:
            answer = httpx.post(self.server.target + self.path, content=body, headers=headers,
                                timeout=FORWARD_TIMEOUT_S)
            status, content = answer.status_code, answer.content
            content_type = answer.headers.get("Content-Type", "application/x-protobuf")
        except httpx.HTTPError as exc:  # not up yet, or gone: the exporter retries a 503
            status, content, content_type = 503, f"trace backend: {exc}".encode(), "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: Phoenix's log has every request


class TraceBackend:
    """Phoenix in its own process group, and the relay in front of its OTLP receiver.

    `start()` = `launch()` (install if missing, start the relay and Phoenix) + `wait_ready()`;
    a caller with other processes to start may launch, start them, then wait (they may send
    spans meanwhile: the relay answers 503 until Phoenix is up, and the exporters retry).
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log = workdir / "phoenix.log"
        self.port, self.grpc_port = free_ports(2)  # Phoenix binds gRPC on every interface
        self.proc: subprocess.Popen[bytes] | None = None
        self.install_s = 0.0  # how long the install (or its check) took
        self.started_s = 0.0  # from launch to the /readyz 200 that wait_ready saw
        self._relay: _Relay | None = None
        self._relay_thread: threading.Thread | None = None
        self._t0 = 0.0
        self._ready = False
        self._log_from = 0  # where the last start's lines begin in the log

    @property
    def url(self) -> str:
        """Phoenix itself: REST at /v1, GraphQL at /graphql, the UI at /."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def otlp_url(self) -> str:
        """Where to send spans: OTLP/HTTP (protobuf), the relay in front of Phoenix."""
        if self._relay is None:
            raise TraceBackendError("the trace backend is not started")
        return self._relay.url + "/v1/traces"

    def install(self) -> Path:
        """Phoenix's venv: install-phoenix.sh prints its path (installing it first)."""
        started = time.monotonic()
        env = {**os.environ, "REAL_ENGINES_DIR": str(CACHE)}
        with self.log.open("ab") as out:
            try:
                done = subprocess.run(["bash", str(INSTALL)], stdout=subprocess.PIPE,
                                      stderr=out, env=env, timeout=INSTALL_TIMEOUT_S,
                                      check=False)
            except subprocess.TimeoutExpired:
                raise TraceBackendError(f"installing Phoenix took over {INSTALL_TIMEOUT_S} s; "
                                        f"log {self.log}:\n{tail(self.log)}") from None
        self.install_s = time.monotonic() - started
        if done.returncode != 0:
            raise TraceBackendError(f"installing Phoenix failed (exit {done.returncode}); "
                                    f"log {self.log}:\n{tail(self.log)}")
        return Path(done.stdout.decode().strip().splitlines()[-1])

    def launch(self) -> None:
        """Install Phoenix if missing, start the relay and Phoenix; do not wait for it."""
        self.install()  # here, under a timeout; serve-phoenix.sh then only checks (~0.1 s)
        self._relay = _Relay(self.url)
        self._relay_thread = threading.Thread(target=self._relay.serve_forever,
                                              name="otlp-relay", daemon=True)
        self._relay_thread.start()
        self._spawn()
        self._t0 = time.monotonic()

    def _spawn(self) -> None:
        home = self.workdir / "phoenix"
        home.mkdir(exist_ok=True)
        env = {name: value for name, value in os.environ.items()
               if not name.startswith(("PHOENIX_", "OTEL_"))}  # serve-phoenix.sh's settings
        env.update(REAL_ENGINES_DIR=str(CACHE), HOST="127.0.0.1", PHOENIX_WORKING_DIR=str(home))
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                ["bash", str(SERVE), str(self.port), str(self.grpc_port)], cwd=home, env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _port_was_taken(self) -> bool:
        """Phoenix's last start lost its port to another process (free_ports cannot reserve
        one, and Phoenix binds seconds after its imports): it may try again on others."""
        with self.log.open("rb") as log:
            log.seek(self._log_from)
            return b"address already in use" in log.read()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until /readyz answers 200 (TraceBackendError if Phoenix exits or takes too long)."""
        if self._ready:
            return
        if self.proc is None:
            raise TraceBackendError("the trace backend is not started")
        deadline = self._t0 + timeout
        retries = PORT_RETRIES
        while not self._ready:
            if self.proc.poll() is not None and retries and self._port_was_taken():
                retries -= 1
                self.port, self.grpc_port = free_ports(2)
                if self._relay is not None:
                    self._relay.target = self.url
                self._spawn()
                continue
            if self.proc.poll() is not None:
                raise TraceBackendError(f"Phoenix exited during startup (exit "
                                        f"{self.proc.returncode}); log {self.log}:\n"
                                        f"{tail(self.log)}")
            with contextlib.suppress(httpx.HTTPError):
                self._ready = httpx.get(self.url + "/readyz", timeout=2).status_code == 200
            if not self._ready:
                if time.monotonic() > deadline:
                    raise TraceBackendError(f"Phoenix not ready after {timeout} s; log "
                                            f"{self.log}:\n{tail(self.log)}")
                time.sleep(0.1)
        self.started_s = time.monotonic() - self._t0

    def start(self) -> None:
        """Install if missing, start, and wait until ready; stopped again if that fails."""
        try:
            self.launch()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Phoenix's whole process group (SIGTERM, grace, SIGKILL), then the relay."""
        if self.proc is not None:
            stop_group(self.proc, STOP_GRACE_S)
            self.proc = None
        if self._relay is not None:
            self._relay.shutdown()
            self._relay.server_close()
            self._relay = None
        if self._relay_thread is not None:
            self._relay_thread.join()
            self._relay_thread = None
        self._ready = False

    def spans(self, project: str = "default", *, trace_id: str | None = None) -> list[SpanRecord]:
        """Every span Phoenix has in `project` (of one trace, with `trace_id`), oldest first;
        [] for a project that does not exist (yet)."""
        params: dict[str, str | int] = {"limit": PAGE, "sort": "start_time", "order": "asc"}
        if trace_id is not None:
            params["trace_id"] = trace_id
        url = f"{self.url}/v1/projects/{quote(project, safe='')}/spans"
        found: list[SpanRecord] = []
        cursor: str | None = None
        while True:
            try:
                answer = httpx.get(url, params={**params, **({"cursor": cursor} if cursor else {})},
                                   timeout=10)
            except httpx.HTTPError as exc:
                raise TraceBackendError(f"Phoenix does not answer ({exc}); log {self.log}:\n"
                                        f"{tail(self.log)}") from exc
            if answer.status_code == 404:
                return []
            if answer.status_code != 200:
                raise TraceBackendError(f"GET {answer.url}: {answer.status_code} {answer.text}")
            page = answer.json()
            found.extend(self._record(item) for item in page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return found

    def trace(self, trace_id: str, *, project: str = "default", timeout: float = 10.0,
              at_least: int = 1, names: Collection[str] = ()) -> list[SpanRecord]:
        """The spans of one trace, oldest first, once at least `at_least` of them and one of
        each of `names` (twice for a name given twice) are there; AssertionError (with what is
        there) after `timeout` s."""
        wanted = Counter(names)
        deadline = time.monotonic() + timeout
        while True:
            found = self.spans(project, trace_id=trace_id)
            if len(found) >= at_least and not wanted - Counter(s["name"] for s in found):
                return found
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"trace {trace_id} in project {project!r}: after {timeout} s "
                    f"{len(found)} span(s) {sorted(s['name'] for s in found)}; wanted at least "
                    f"{at_least}" + (f" with {sorted(wanted.elements())}" if wanted else ""))
            time.sleep(0.1)

    def _record(self, item: dict[str, Any]) -> SpanRecord:
        trace_id = item["context"]["trace_id"].lower()
        span_id = item["context"]["span_id"].lower()
        kind, links = ((None, []) if self._relay is None
                       else self._relay.kind_and_links(trace_id, span_id))
        parent = item.get("parent_id")
        return SpanRecord(
            name=item["name"], trace_id=trace_id, span_id=span_id,
            parent_id=parent.lower() if parent else None, kind=kind,
            start_time=datetime.fromisoformat(item["start_time"]),
            end_time=datetime.fromisoformat(item["end_time"]),
            attributes=dict(item.get("attributes") or {}),
            events=[SpanEvent(name=event["name"], attributes=dict(event.get("attributes") or {}),
                              time=datetime.fromisoformat(event["timestamp"]))
                    for event in item.get("events") or ()],
            links=links, status=item["status_code"],
            status_message=item.get("status_message") or "")


@pytest.fixture(scope="session")
def trace_backend_starting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TraceBackend]:
    """Phoenix launched (installed first if missing), perhaps not ready yet: for a fixture that
    starts processes exporting to it meanwhile, and then calls `wait_ready()` (the real-engine
    tier's `engines`). A test asks for `trace_backend`. Usually launched already, as the session
    began (`pytest_collection_finish`)."""
    if _EARLY:
        backend = _EARLY.pop()
    else:
        backend = TraceBackend(tmp_path_factory.mktemp("trace-backend"))
        try:
            backend.launch()
        except TraceBackendError as exc:
            backend.stop()
            pytest.fail(f"the trace backend cannot run: {exc}", pytrace=False)
    try:
        yield backend
    finally:
        backend.stop()


# Launched when the tests are collected, if any of them needs the backend: its ~12 s start then
# overlaps the tests that run first. The fixture takes it over; the session's end stops one
# nobody took (an interrupted run).
_EARLY: list[TraceBackend] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any("trace_backend_starting" in getattr(item, "fixturenames", ())
               for item in session.items):
        return
    folder = Path(tempfile.mkdtemp(prefix="trace-backend-"))
    backend = TraceBackend(folder)
    try:
        backend.launch()
    except TraceBackendError:  # the fixture tries again, and fails the tests with the reason
        backend.stop()
        shutil.rmtree(folder, ignore_errors=True)
        return
    _EARLY.append(backend)


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _EARLY:
        _EARLY.pop().stop()


@pytest.fixture(scope="session")
def trace_backend(trace_backend_starting: TraceBackend) -> TraceBackend:
    """A real trace backend for the session, ready: send spans to `otlp_url`, read them back
    with `spans()` or `trace()`."""
    try:
        trace_backend_starting.wait_ready()
    except TraceBackendError as exc:
        pytest.fail(f"the trace backend cannot run: {exc}", pytrace=False)
    return trace_backend_starting
