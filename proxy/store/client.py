"""The gateway's state store: one Redis, a Redis Cluster, or the primary Sentinels watch.

    redis://[user:pass@]host:port/db, rediss://…, unix:///path     one server
    redis+cluster://[user:pass@]host:port[,host:port…]              a Redis Cluster: any of
    rediss+cluster://…                                                its nodes will do
    redis+sentinel://[user:pass@]host:port[,host:port…]/service[/db]  the primary Sentinels
    rediss+sentinel://…                                               name for `service`

`connect_redis` makes the client every ordinary command goes through; with a Cluster, redis-py
routes each command to its slot's primary and follows moved slots and failovers. Every script and
multi-key step of the gateway keeps its keys under one hash tag, so it stays in one slot.

`Primaries` says which server holds a key, for the two paths that write over one connection of
one server themselves: admission's pipelined scripts (runtime.script_pipe) and the settler's
batches, which a `WAIT` on the same connection can make wait for replicas
(`[gateway] ledger_ack_replicas`): a write a replica has acknowledged survives the primary's
failover.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import (
    BlockingConnectionPool,
    Redis,
    RedisCluster,
    Sentinel,
    SentinelConnectionPool,
)
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, ClusterPipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    MaxConnectionsError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.config import Config

Store: TypeAlias = Redis | RedisCluster

POOL_SIZE = 64  # per client and worker: requests share them, settlements go as one pipeline
POOL_WAIT_S = 2.0
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
ACK_TIMEOUT_MS = 1000  # how long a WAIT for replicas may hold a settlement batch or a top-up
MARKER_MS = 60_000  # the replication marker's lifetime (replica_wait)
FOLLOW_S = 0.5  # how often a Sentinel client asks the Sentinels which server is the primary
RATE_LIMIT_URL_ENV = "GATEWAY_RATELIMIT_REDIS_URL"


class StoreBusy(RedisConnectionError):
    """Every pooled connection stayed in use for the pool's whole wait: the store is busy, not
    down (callers must not fail open on it)."""


class _Pool(BlockingConnectionPool):
    """A bounded pool whose callers wait a little for a free connection, and say so if none
    frees up (redis-py's default pool fails at once past its size, looking like an outage)."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except RedisConnectionError as exc:
            if isinstance(exc.__cause__, TimeoutError):
                raise StoreBusy("no Redis connection free") from exc
            raise


async def _waiting(command: Callable[[], Awaitable[Any]]) -> Any:
    """Run `command`, waiting up to POOL_WAIT_S for a free connection as `_Pool` does: the
    Cluster's and the Sentinel primary's pools fail at once past their size (redis-py's
    MaxConnectionsError, a ConnectionError: it would pass for an outage under a burst)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + POOL_WAIT_S
    while True:
        try:
            return await command()
        except MaxConnectionsError as exc:
            if loop.time() >= deadline:
                raise StoreBusy("no Redis connection free") from exc
            await asyncio.sleep(0.002)


class _Cluster(RedisCluster):
    """redis-py's Cluster client, whose "no node reachable" is a connection error like any
    other store outage (it raises a bare RedisClusterException, which no caller expects), and
    whose callers wait for a free connection."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        command = super().execute_command
        try:
            # Mapped once, under its lock, before any command runs (a no-op once mapped): a
            # burst of first commands would each remap it.
            await self.initialize()
            return await _waiting(lambda: command(*args, **kwargs))
        except RedisClusterException as exc:
            raise RedisConnectionError("no Redis Cluster node reachable") from exc

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None
                 ) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]


class _ClusterPipeline(ClusterPipeline):
    """redis-py's Cluster pipeline, whose "no node reachable" (raised as it maps the slots,
    or sends) is a connection error as well: callers handle RedisError, and a worker's task
    that reads the fleet's state died of the bare RedisClusterException."""

    async def initialize(self) -> ClusterPipeline:
        try:
            return await super().initialize()
        except RedisClusterException as exc:
            raise RedisConnectionError("no Redis Cluster node reachable") from exc

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True
                      ) -> list[Any]:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except RedisClusterException as exc:
            raise RedisConnectionError("no Redis Cluster node reachable") from exc


class _SentinelPool(SentinelConnectionPool):
    """The Sentinels' primary's pool, which never hands out a connection to a server they no
    longer name. redis-py asks only when a connection is made, so a pooled connection would
    stay with the old primary; and after a second, hasty failover that server can still be up
    and a primary for seconds, taking writes that are discarded once it becomes a replica."""

    async def ensure_connection(self, connection: Any) -> None:
        if (self.master_address is not None and connection.is_connected
                and (connection.host, connection.port) != self.master_address):
            await connection.disconnect()
        await super().ensure_connection(connection)


async def follow_primary(store: Store) -> None:
    """Forever (a background task): ask the Sentinels every FOLLOW_S which server is the
    primary; when it changes, every connection to the old one is dropped before its next
    command (here, in `_SentinelPool`, and in the script pipes). No-op for other stores."""
    pool = store.connection_pool if isinstance(store, Redis) else None
    if not isinstance(pool, SentinelConnectionPool):
        return
    while True:
        # A failed ask changes nothing: no Sentinel answering is the next command's error.
        with contextlib.suppress(RedisError, OSError):
            await pool.get_master_address()  # type: ignore[no-untyped-call]
        await asyncio.sleep(FOLLOW_S)


def primary_address(store: Redis) -> Callable[[], tuple[str, int] | None]:
    """The address of the server the Sentinels last named primary (None: not a Sentinel
    client, or not asked yet), as `follow_primary` keeps it."""
    pool = store.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        return lambda: pool.master_address
    return lambda: None


class _SentinelPrimary(Redis):
    """The Sentinels' primary, whose callers wait for a free connection, and whose aclose()
    also closes its connections to the Sentinels."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        command = super().execute_command
        return await _waiting(lambda: command(*args, **options))  # type: ignore[no-untyped-call]

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        pool = self.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            for sentinel in pool.sentinel_manager.sentinels:
                await sentinel.aclose()


def store_kind(url: str) -> str:
    """"cluster", "sentinel" or "single"."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in CLUSTER_SCHEMES:
        return "cluster"
    return "sentinel" if scheme in SENTINEL_SCHEMES else "single"


def _retry() -> dict[str, Any]:
    # The asyncio `Retry`: redis-py accepts the sync one here too, but then never retries.
    return {"retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError]}


def _hosts(netloc: str) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """(credentials, [(host, port), …]) of `user:pass@h1:p1,h2:p2`."""
    credentials: dict[str, Any] = {}
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        credentials = {"username": unquote(user) or None, "password": unquote(password) or None}
    hosts = []
    for part in netloc.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store address {part.strip()!r} is not host:port")
        hosts.append((host.strip("[]"), int(port)))
    return credentials, hosts


def connect_redis(url: str, *, timeout_s: float = 2.0) -> Store:
    """The one way the gateway makes a Redis client: bounded connections, short timeouts, and a
    command whose connection dropped, was refused or timed out retried twice (0.1 s, then 0.2 s
    later): enough to ride out a restart of the embedded Redis (about 0.1 s). A Cluster client
    also re-reads the slot map when a node fails, and a Sentinel client asks the Sentinels for
    the primary again.

    A retried write may run twice if Redis died after running it but before answering: the
    ledger's scripts make that harmless (hold ids, settle-once, credit ids)."""
    timeouts: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": 2.0}
    kind = store_kind(url)
    if kind == "single":
        pool = _Pool.from_url(url, max_connections=POOL_SIZE, timeout=POOL_WAIT_S, **timeouts,
                              **_retry())
        return Redis.from_pool(pool)  # owns the pool: aclose() closes its connections
    parts = urlsplit(url)
    credentials, hosts = _hosts(parts.netloc)
    tls: dict[str, Any] = {"ssl": True} if parts.scheme.lower().startswith("rediss") else {}
    if kind == "cluster":
        return _Cluster(startup_nodes=[ClusterNode(h, p) for h, p in hosts],
                        max_connections=POOL_SIZE, **credentials, **tls, **timeouts, **_retry())
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path:
        raise ValueError("a redis+sentinel:// URL names the service: …/<service>[/<db>]")
    query = parse_qs(parts.query)
    sentinel_auth = {"password": query["sentinel_password"][0]} \
        if "sentinel_password" in query else {}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        hosts, sentinel_kwargs={**timeouts, **sentinel_auth, **tls, **_retry()},
        **credentials, **tls, **timeouts, **_retry())
    db = int(path[1]) if len(path) > 1 else 0
    primary: Redis = sentinel.master_for(path[0], db=db, max_connections=POOL_SIZE,
                                         redis_class=_SentinelPrimary,
                                         connection_pool_class=_SentinelPool)
    return primary


def replica_wait(key: str, replicas: int) -> list[tuple[str | int | bytes, ...]]:
    """The commands that end a pipeline of writes whose first key is `key`, so they are done
    only once `replicas` replicas have them (at most ACK_TIMEOUT_MS): a marker write that
    always replicates, in `key`'s Cluster slot, then WAIT (its reply, the replicas that
    confirmed, is the pipeline's last). WAIT counts its own connection's writes, up to its
    last one that replicated: the marker makes that this pipeline's, even when every other
    write in it changed nothing (sent again, already done), and so covers whatever the primary
    took before it. None without `replicas`."""
    if not replicas:
        return []
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    tag = key[start + 1:end] if end > start + 1 else key  # Redis' hash tag rule
    return [("SET", f"igw:{{{tag}}}:replicated", b"1", "PX", MARKER_MS),
            ("WAIT", replicas, ACK_TIMEOUT_MS)]


def failing_over(exc: RedisError) -> bool:
    """An answer that means the primary is failing over, so a write may or may not have run:
    a lost connection or no reply, READONLY (it is a replica now), or a WAIT the server ended
    as it became one ("UNBLOCKED")."""
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | ReadOnlyError) or \
        "UNBLOCKED" in str(exc)


def wait_for_replicas(pipe: Pipeline, key: str, replicas: int) -> None:
    """End `pipe` (writes whose first key is `key`) with `replica_wait`'s commands."""
    for command in replica_wait(key, replicas):
        pipe.execute_command(*command)


def url_problem(url: str) -> str | None:
    """What is wrong with a store URL, without connecting; None when it can be used."""
    try:
        connect_redis(url)  # builds the client only: nothing connects before a command
    except ValueError as exc:
        return str(exc)
    return None


def rate_limit_redis_url(config: Config, default: str) -> str:
    """Where rate-limit counters live: their own Redis if one is named, else `default`."""
    return os.environ.get(RATE_LIMIT_URL_ENV) or config.gateway.rate_limit_redis_url or default


def node_client(node: ClusterNode) -> Redis:
    """A plain client of one Cluster node, made like the Cluster client's own connections."""
    kwargs = {k: v for k, v in node.connection_kwargs.items() if k != "retry"}
    pool = _Pool(max_connections=POOL_SIZE, timeout=POOL_WAIT_S,
                 connection_class=node.connection_class, **kwargs, **_retry())
    return Redis.from_pool(pool)


async def listener_client(store: Store, turn: int) -> Redis:
    """A client to subscribe with. A Cluster relays every published message to every node, so
    any node will do: each turn takes the next one it knows (a dead one fails, and the caller's
    next turn tries another). The caller closes what it gets unless it is `store` itself."""
    if not isinstance(store, RedisCluster):
        return store
    if not store.nodes_manager.nodes_cache:
        await store.initialize()  # the client reads the map at its first command
    nodes = sorted(store.nodes_manager.nodes_cache.values(), key=lambda n: n.name)
    return node_client(nodes[turn % len(nodes)])


class Primaries:
    """The plain client of the primary that holds a key (one per server, made as needed), for
    writes that must share one connection of that server. One server (or a Sentinel's
    primary): always the store's own client."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.kind = "cluster" if isinstance(store, RedisCluster) else (
            "sentinel" if isinstance(store.connection_pool, SentinelConnectionPool) else "single")
        self._clients: dict[str, Redis] = {}

    @property
    def failover(self) -> bool:
        """Whether a primary can move (Cluster, Sentinel): a failed write may succeed when
        sent again to where it moved."""
        return self.kind != "single"

    def client_for(self, key: str) -> Redis:
        if not isinstance(self.store, RedisCluster):
            return self.store
        try:
            node = self.store.nodes_manager.get_node_from_slot(self.store.keyslot(key))
        except (RedisClusterException, KeyError) as exc:  # the slot map lost it mid-failover,
            # or has not been read yet
            raise RedisConnectionError("no primary known for the key's slot") from exc
        client = self._clients.get(node.name)
        if client is None:
            client = self._clients[node.name] = node_client(node)
        return client

    async def refresh(self) -> None:
        """A slot moved or a primary failed: read the Cluster's slot map again."""
        if isinstance(self.store, RedisCluster):
            # No node answering is the caller's next error; the map is read again next time.
            with contextlib.suppress(RedisError, RedisClusterException, OSError):
                await self.store.nodes_manager.initialize()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


__all__ = ["RATE_LIMIT_URL_ENV", "Primaries", "Store", "StoreBusy",
           "connect_redis", "failing_over", "follow_primary", "listener_client", "node_client",
           "primary_address", "rate_limit_redis_url", "replica_wait",
           "store_kind", "url_problem", "wait_for_replicas"]
