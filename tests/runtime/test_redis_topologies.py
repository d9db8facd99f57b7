"""The test topologies in tests.support.redis_topologies are real: keys spread over a cluster's
masters, and a SIGKILLed master (cluster or Sentinel) is replaced with its acknowledged writes
intact."""

from __future__ import annotations

from pathlib import Path

from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from tests.support.redis_topologies import ClusterProcesses, SentinelProcesses


def addresses(url: str) -> list[tuple[str, int]]:
    """host:port pairs of a redis+cluster:// or redis+sentinel:// URL."""
    hosts = url.split("://", 1)[1].split("/", 1)[0]
    return [(host, int(port)) for host, _, port in (a.rpartition(":") for a in hosts.split(","))]


def cluster_client(url: str) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in addresses(url)],
                        decode_responses=True, socket_timeout=2.0)


def test_cluster_spreads_keys_and_promotes_the_replica_of_a_killed_master(tmp_path: Path) -> None:
    with ClusterProcesses(tmp_path) as cluster:
        keys = [f"{{tag-{i}}}:balance" for i in range(200)]
        client = cluster_client(cluster.url)
        try:
            for key in keys:
                client.set(key, key)
            assert client.get(keys[-1]) == keys[-1]
        finally:
            client.close()
        owners = {cluster.master_of(key) for key in keys}
        assert len(owners) == 3 and owners == set(cluster.masters)

        key = keys[0]
        victim = cluster.master_of(key)
        replica = cluster.replica_of(victim)
        with victim.client() as direct:  # same connection: WAIT covers this SET
            pipe = direct.pipeline(transaction=False)
            pipe.set(key, "acknowledged")
            pipe.wait(1, 2000)
            _, replicated = pipe.execute()
        assert replicated >= 1

        cluster.kill(victim)
        new = cluster.wait_promoted(victim)

        assert new is replica and new.role == "master" and not victim.alive
        assert cluster.master_of(key) is new
        with new.client() as direct:
            assert direct.get(key) == "acknowledged"
        client = cluster_client(cluster.url)  # the url still lists the dead master: skipped
        try:
            assert client.get(key) == "acknowledged"
            assert client.get(keys[1]) == keys[1]
        finally:
            client.close()


def test_sentinel_fails_over_to_a_replica_that_has_the_acknowledged_write(
        tmp_path: Path) -> None:
    with SentinelProcesses(tmp_path) as topology:
        sentinels = addresses(topology.url)
        service = topology.url.rsplit("/", 1)[1]
        with Sentinel(sentinels, socket_timeout=1.0, decode_responses=True) as sentinel:
            assert sentinel.discover_master(service) == ("127.0.0.1", topology.master().port)
            with sentinel.master_for(service) as master:
                pipe = master.pipeline(transaction=False)
                pipe.set("balance", "acknowledged")
                pipe.wait(1, 2000)
                _, replicated = pipe.execute()
        assert replicated >= 1

        old = topology.kill_master()
        new = topology.wait_failover(old)

        assert new is not old and new.alive and not old.alive
        with Sentinel(sentinels, socket_timeout=1.0, decode_responses=True) as sentinel:
            assert sentinel.discover_master(service) == ("127.0.0.1", new.port)
            with sentinel.master_for(service) as master:
                assert master.get("balance") == "acknowledged"
                assert master.set("after", "failover")  # a master: writes are accepted
