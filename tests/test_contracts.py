"""The private names of third-party libraries the gateway relies on, each in one list (`CONTRACT`)
with where it is used and why no public API does; checked against the installed libraries on
real objects, so an upgrade that removes or changes one fails here, naming it (pyproject.toml
bounds these libraries until it passes). A scan of proxy/ fails on any private name of a library
that is not in the list: a private module imported, an attribute `obj._name` whose name the
gateway defines nowhere itself, or, in a class deriving from a library's class, a private name
of that class used or overridden.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib
import inspect
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CollectorRegistry, Histogram
from redis.asyncio import Redis
from redis.exceptions import AskError, ClusterDownError, NoScriptError, TryAgainError

from proxy.observe.metrics import LATENCY_BUCKETS, bucket_bounds
from proxy.store.redis_process import RedisProcess

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "proxy"

Probe = Callable[[str], Awaitable[None]]  # given a live redis-server's URL


@dataclass(frozen=True)
class Private:
    """A library's private name the gateway uses."""

    library: str  # the distribution, as pyproject.toml names it
    name: str  # where the library defines it, dotted
    where: str  # the gateway's module using it
    use: str  # what uses it there
    why: str  # why no public API does instead
    probe: Probe  # raises (AttributeError, ImportError, AssertionError) if it is gone or changed


# ---- probes: each looks at the name on real objects of the installed library -----------------


async def _answer(request: web.BaseRequest) -> web.Response:
    return web.Response()


async def _request_count(_: str) -> None:
    handler = web.Server(_answer)()  # a connection's handler, as aiohttp's Server makes one
    assert handler._request_count == 0
    handler.data_received(b"GET / HTTP/1.1\r\nHo")
    assert handler._request_count == 0, "counted a head before it was complete"
    handler.data_received(b"st: x\r\n\r\n")
    assert handler._request_count == 1, "a complete head was not counted"


async def _waiter(_: str) -> None:
    server = web.Server(_answer)
    listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection(*listener.sockets[0].getsockname()[:2])
    try:
        async with asyncio.timeout(5):
            while not server.connections or server.connections[0]._waiter is None:  # noqa: ASYNC110
                await asyncio.sleep(0.01)  # aiohttp tells nothing when it starts waiting
        waiter = server.connections[0]._waiter
        assert isinstance(waiter, asyncio.Future) and not waiter.done(), \
            "no pending _waiter while the connection waits for a request"
    finally:
        writer.close()
        await server.shutdown(1)
        listener.close()
        await listener.wait_closed()


async def _force_close(_: str) -> None:
    handler = web.Server(_answer)()
    assert handler._force_close is False
    handler.force_close()
    assert handler._force_close is True


async def _make_server(_: str) -> None:
    made: list[web.Server] = []

    class Runner(web.AppRunner):
        async def _make_server(self) -> web.Server:
            server = await super()._make_server()
            made.append(server)
            return server

    runner = Runner(web.Application())
    await runner.setup()  # calls _make_server once the app has started
    try:
        assert made and runner.server is made[0]
    finally:
        await runner.cleanup()


async def _server_kwargs(_: str) -> None:
    runner = web.AppRunner(web.Application(), keepalive_timeout=15, max_line_size=8192)
    await runner.setup()
    try:
        assert runner.server is not None
        kwargs = runner.server._kwargs
        assert kwargs["keepalive_timeout"] == 15 and kwargs["max_line_size"] == 8192
        handler = RequestHandler(runner.server, loop=asyncio.get_running_loop(), **kwargs)
        assert handler.keepalive_timeout == 15  # what GatewayServer makes connections with
    finally:
        await runner.cleanup()


async def _parse_error(_: str) -> None:
    base_parser = importlib.import_module("redis._parsers").BaseParser
    for reply, error in (("NOSCRIPT No matching script", NoScriptError),
                         ("ASK 3999 127.0.0.1:6381", AskError),
                         ("CLUSTERDOWN The cluster is down", ClusterDownError),
                         ("TRYAGAIN Multiple keys request during rehashing", TryAgainError)):
        assert isinstance(base_parser.parse_error(reply), error), reply


async def _writer(redis_url: str) -> None:
    redis = Redis.from_url(redis_url)
    pool = redis.connection_pool
    conn = pool.connection_class(**pool.connection_kwargs)
    try:
        await conn.connect()  # type: ignore[no-untyped-call]
        transport = conn._writer.transport  # type: ignore[union-attr]
        assert isinstance(conn._writer, asyncio.StreamWriter)
        assert callable(transport.set_protocol) and callable(transport.write)
    finally:
        await conn.disconnect()
        await redis.aclose()


def _histogram() -> tuple[Histogram, Any]:
    """A histogram with the gateway's latency buckets, and one child of it."""
    histogram = Histogram("probe_seconds", "", ("backend",), buckets=LATENCY_BUCKETS,
                          registry=CollectorRegistry())
    return histogram, histogram.labels("b0")


def _collected(histogram: Histogram) -> dict[tuple[str, str | None], float]:
    """The exposed samples: (suffix, le) -> value."""
    return {(s.name.removeprefix("probe_seconds"), s.labels.get("le")): s.value
            for family in histogram.collect() for s in family.samples}


async def _histogram_sum(_: str) -> None:
    histogram, child = _histogram()
    child._sum.inc(1.5)
    assert _collected(histogram)[("_sum", None)] == 1.5


async def _histogram_buckets(_: str) -> None:
    histogram, child = _histogram()
    buckets = child._buckets
    assert len(buckets) == len(bucket_bounds(LATENCY_BUCKETS)), "buckets no longer end at +Inf"
    buckets[0].inc(2)  # one value per bucket, not cumulative: the exposition adds them up
    buckets[-1].inc(1)
    got = _collected(histogram)
    assert got[("_bucket", "0.005")] == 2 and got[("_bucket", "+Inf")] == 3
    assert got[("_count", None)] == 3


CONTRACT: tuple[Private, ...] = (
    Private("aiohttp", "aiohttp.web_protocol.RequestHandler._request_count",
            "proxy/http/server.py", "GatewayProtocol.data_received",
            "the request heads parsed so far (a parse error counts): a change across aiohttp's "
            "data_received means a whole head arrived and its deadline is met; aiohttp calls "
            "nothing when a head is parsed",
            _request_count),
    Private("aiohttp", "aiohttp.web_protocol.RequestHandler._waiter",
            "proxy/http/server.py", "GatewayProtocol._awaiting_request",
            "pending only while a kept-alive connection waits for its next request: bytes then "
            "start a head, whose deadline starts; no public state tells it",
            _waiter),
    Private("aiohttp", "aiohttp.web_protocol.RequestHandler._force_close",
            "proxy/http/server.py", "GatewayProtocol._head_expired",
            "a connection aiohttp already closes (shutdown, error, keep-alive off) gets no 408; "
            "aiohttp sets the flag in several places, not only through force_close()",
            _force_close),
    Private("aiohttp", "aiohttp.web_runner.AppRunner._make_server",
            "proxy/http/server.py", "GatewayRunner._make_server (overrides it, calls it)",
            "the one step between the app's startup and serving: AppRunner's Server is "
            "wrapped in GatewayServer (its connection class, the connection cap, expect_later)",
            _make_server),
    Private("aiohttp", "aiohttp.web_server.Server._kwargs",
            "proxy/http/server.py", "GatewayRunner._make_server",
            "the connection options AppRunner assembled (keep-alive, line limits, access log, "
            "the app's handler_args) for GatewayServer's connections; no public accessor",
            _server_kwargs),
    Private("redis", "redis._parsers.BaseParser.parse_error",
            "proxy/store/script_pipe.py", "_Link: hiredis.Reader(replyError=...)",
            "error replies become redis-py's own exceptions (NOSCRIPT, ASK/MOVED, CLUSTERDOWN, "
            "TRYAGAIN ...) as its hiredis parser makes them; callers catch those classes",
            _parse_error),
    Private("redis", "redis.asyncio.connection.AbstractConnection._writer",
            "proxy/store/script_pipe.py", "_Link.__init__: conn._writer.transport",
            "after redis-py's handshake (TLS, AUTH, SELECT, HELLO) the pipe takes over the "
            "connection's transport; redis-py exposes no transport",
            _writer),
    Private("prometheus-client", "prometheus_client.metrics.Histogram._sum",
            "proxy/observe/metrics.py", "Metrics.flush",
            "a second's tallied observations added to the sum at once: prometheus-client has "
            "no observe-many, and each write is a locked write to a mapped file under serve",
            _histogram_sum),
    Private("prometheus-client", "prometheus_client.metrics.Histogram._buckets",
            "proxy/observe/metrics.py", "Metrics.flush",
            "the tallied counts added per bucket (one per bound, then +Inf, as bucket_bounds "
            "counts them); same reason as _sum",
            _histogram_buckets),
)


@pytest.mark.parametrize("entry", CONTRACT, ids=[entry.name for entry in CONTRACT])
async def test_each_private_name_is_still_there(entry: Private,
                                                redis_server: RedisProcess) -> None:
    try:
        await entry.probe(redis_server.url)
    except (AttributeError, ImportError, KeyError, TypeError, AssertionError) as exc:
        pytest.fail(f"{entry.name} ({entry.library} {version(entry.library)}) is gone or "
                    f"changed: {exc!r}. {entry.where} uses it ({entry.use}) because "
                    f"{entry.why}. Replace that use, or keep the library at a version that "
                    f"has it (pyproject.toml).", pytrace=False)


# ---- the scan: no private name of a library outside the list ----------------------------------

# Underscore names the standard library documents as public API (namedtuple's).
DOCUMENTED = frozenset({"_asdict", "_field_defaults", "_fields", "_make", "_replace"})


@dataclass(frozen=True, order=True)
class Use:
    """A private name of a library used in the gateway's source."""

    path: str  # e.g. proxy/store/script_pipe.py
    line: int
    name: str  # the private attribute (`_writer`) or the module or name imported

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name}"

    def listed(self, contract: Iterable[Private]) -> bool:
        return any(entry.where == self.path and f".{self.name}." in f".{entry.name}."
                   for entry in contract)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return bool(top) and top not in sys.stdlib_module_names and top not in ("proxy", "__future__")


def defined_names(trees: Iterable[ast.Module]) -> set[str]:
    """Every private name the code defines itself: functions, methods and classes, attributes
    it assigns (`self._queue = ...`), module and class attributes (dataclass and msgspec fields
    among them), slots, names it imports under."""
    names: set[str] = set()
    for tree in trees:
        scopes: list[ast.Module | ast.ClassDef] = [tree]
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                scopes.append(node)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
                names.add(node.attr)
        for scope in scopes:
            for stmt in scope.body:
                if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    found = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                    names |= found
                    if "__slots__" in found and stmt.value is not None:
                        names |= {c.value for c in ast.walk(stmt.value)
                                  if isinstance(c, ast.Constant) and isinstance(c.value, str)}
                elif isinstance(stmt, ast.Import | ast.ImportFrom):
                    names |= {a.asname or a.name.split(".")[0] for a in stmt.names}
    return {name for name in names if _private(name)}


def _imports(tree: ast.Module) -> dict[str, str]:
    """The module's names bound by imports -> what they are, dotted (`web` -> `aiohttp.web`)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _dotted(node: ast.expr, bound: Mapping[str, str]) -> str | None:
    """`web.Server` -> `aiohttp.web.Server` when `web` was imported; None for anything else."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, bound)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _resolve(dotted: str) -> object:
    """The object a dotted name names (its longest importable module, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            found = getattr(found, part)
        return found
    raise ImportError(dotted)


@functools.cache
def _assigned_to_self_in(path: str) -> dict[str, frozenset[str]]:
    """Per class of a library's module: the private attributes its methods assign to `self`."""
    found: dict[str, set[str]] = {}
    for cls in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"))):
        if isinstance(cls, ast.ClassDef):
            found.setdefault(cls.name, set()).update(
                node.attr for stmt in cls.body for node in ast.walk(stmt)
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"
                and _private(node.attr))
    return {name: frozenset(attrs) for name, attrs in found.items()}


def _assigned_to_self(klass: type) -> frozenset[str]:
    """The private attributes `klass`'s methods assign to `self`, read from its source."""
    try:
        path = inspect.getsourcefile(klass)
    except TypeError:  # compiled: its vars() are all there is
        return frozenset()
    return _assigned_to_self_in(path).get(klass.__name__, frozenset()) if path else frozenset()


@functools.cache
def library_private_names(cls: type) -> frozenset[str]:
    """The private names a library's class (and its library bases) define: methods, class
    attributes, slots, and the attributes its methods assign to `self`."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if _third_party(klass.__module__):
            names |= {name for name in vars(klass) if _private(name)}
            names |= _assigned_to_self(klass)
    return frozenset(names)


def _is_self_or_super(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "self") or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _subclass_uses(path: str, tree: ast.Module, bound: Mapping[str, str]) -> Iterator[Use]:
    """In a class deriving from a library's class: the base's private names it uses through
    `self` or `super()`, and those it overrides."""
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        theirs: set[str] = set()
        for base in cls.bases:
            dotted = _dotted(base, bound)
            if dotted is not None and _third_party(dotted):
                resolved = _resolve(dotted)
                if isinstance(resolved, type):
                    theirs |= library_private_names(resolved)
        if not theirs:
            continue
        for stmt in cls.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name in theirs:
                yield Use(path, stmt.lineno, stmt.name)
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and node.attr in theirs
                    and _is_self_or_super(node.value)):
                yield Use(path, node.lineno, node.attr)


def scan(sources: Mapping[str, str], defined: set[str]) -> set[Use]:
    """The private names of libraries `sources` (path -> code) use; `defined`: the private
    names the code defines itself (see `defined_names`)."""
    found: set[Use] = set()
    for path, source in sources.items():
        tree = ast.parse(source)
        bound = _imports(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {Use(path, node.lineno, a.name) for a in node.names
                          if _third_party(a.name) and any(map(_private, a.name.split(".")))}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if not _third_party(node.module):
                    continue
                if any(map(_private, node.module.split("."))):
                    found.add(Use(path, node.lineno, node.module))
                found |= {Use(path, node.lineno, f"{node.module}.{a.name}") for a in node.names
                          if _private(a.name)}
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = _dotted(node.value, bound)
                if owner is not None:  # a module's or an imported class's own attribute
                    if _third_party(owner):
                        found.add(Use(path, node.lineno, f"{owner}.{node.attr}"))
                elif node.attr not in defined and node.attr not in DOCUMENTED:
                    found.add(Use(path, node.lineno, node.attr))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and _private(node.args[1].value)
                  and node.args[1].value not in defined):
                found.add(Use(path, node.lineno, node.args[1].value))
        found |= set(_subclass_uses(path, tree, bound))
    return found


def _gateway_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PROXY.rglob("*.py"))}


@functools.cache
def _gateway_uses() -> frozenset[Use]:
    sources = _gateway_sources()
    return frozenset(scan(sources, defined_names(ast.parse(code) for code in sources.values())))


def test_no_private_name_of_a_library_outside_the_contract() -> None:
    unlisted = sorted(use for use in _gateway_uses() if not use.listed(CONTRACT))
    assert not unlisted, (
        "private names of libraries, not in tests/test_contracts.py CONTRACT (use a public API, "
        "or add each with where and why, a probe, and an upper bound in pyproject.toml):\n"
        + "\n".join(f"  {use}" for use in unlisted))


def test_every_contract_entry_is_still_used() -> None:
    """A use that went away takes its entry (and maybe a version bound) with it."""
    uses = _gateway_uses()
    stale = [entry.name for entry in CONTRACT if not any(use.listed([entry]) for use in uses)]
    assert not stale, f"listed but no longer used: {stale}"


SYNTHETIC = '''
import os
import redis._parsers
from aiohttp.web_protocol import RequestHandler
from redis.asyncio.connection import _AsyncHiredisParser


class Queue:
    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._queue: list[int] = []
        self._items = ()

    def size(self) -> int:
        return len(self._queue) + len(self._items) + len(self.__class__.__name__)


def transport_of(conn):
    return conn._writer.transport


def leave() -> None:
    os._exit(0)  # the standard library's: not a third-party name


class Handler(RequestHandler):
    def waiting(self) -> bool:
        return self._waiter is not None

    def _own(self) -> None:
        self._mine = getattr(self, "_hidden", None)
'''


def test_the_scan_flags_private_names_of_libraries() -> None:
    tree = ast.parse(SYNTHETIC)
    found = {(use.line, use.name) for use in scan({"synthetic.py": SYNTHETIC},
                                                  defined_names([tree]))}
    line = {text.strip(): n for n, text in enumerate(SYNTHETIC.splitlines(), 1)}
    assert found == {
        (line["import redis._parsers"], "redis._parsers"),
        (line["from redis.asyncio.connection import _AsyncHiredisParser"],
         "redis.asyncio.connection._AsyncHiredisParser"),
        (line["return conn._writer.transport"], "_writer"),
        (line["return self._waiter is not None"], "_waiter"),  # a RequestHandler's own
        (line['self._mine = getattr(self, "_hidden", None)'], "_hidden"),
    }
