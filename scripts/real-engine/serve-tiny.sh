#!/usr/bin/env bash
# Serve a tiny random Llama with real vLLM on CPU, in the foreground (so a supervisor, or the
# test tier, owns the process and its group). Installs vLLM and builds the model first when
# they are missing; both are cached under $REAL_ENGINES_DIR (default ~/.cache/real-engines).
#
#   scripts/real-engine/serve-tiny.sh PORT [extra `vllm serve` args...]
#   scripts/real-engine/serve-tiny.sh --prepare          # install + build only, then exit
#
# Env (defaults): SERVED_NAME=acme/tiny  MAX_MODEL_LEN=1024  HOST=127.0.0.1
#   VLLM_CPU_OMP_THREADS_BIND: the core(s) it computes on (0, 1, "0-1"...). With two replicas on a
#   2-core box give each its own core (vLLM's default pins every replica's worker to core 0).
#   The whole server is then kept on those cores (taskset): while it generates, vLLM's
#   EngineCore process spins beside its worker and would otherwise take a second core.
#   OTLP_TRACES_ENDPOINT: where to send vLLM's traces, over OTLP/HTTP (protobuf), e.g.
#   http://127.0.0.1:6006/v1/traces (unset: none). Each request is then an `llm_request` span
#   (kind SERVER), the child of the span in its `traceparent` header when it has one; loading the
#   model is a trace of its own. OTEL_BSP_SCHEDULE_DELAY (ms, 500 here; the SDK's default is
#   5000) is how long a finished span may wait before it is sent.
# First run: ~2 min install + ~8 s model; then ~25-30 s to /health 200 (--enforce-eager: no
# torch.compile warm-up, and the same speed for a model this small).
#
# After the project's shared real-engine recipe (shared/real-engines/start-vllm.sh, 2026-11-23):
# the same environment and flags, run in the foreground instead of nohup + pidfile.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${REAL_ENGINES_DIR:-$HOME/.cache/real-engines}
VENV=$DIR/vllm
MODEL=$DIR/tiny-model
usage="usage: serve-tiny.sh PORT [vllm serve args...] | serve-tiny.sh --prepare"
PORT=${1:?$usage}
shift

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}   # GiB, an integer: 1 is the least

REAL_ENGINES_DIR=$DIR bash "$HERE/install-vllm.sh" "$VENV" >&2
(
  flock 8   # two replicas starting at once build the model once
  if [ ! -f "$MODEL/model.safetensors" ] || [ ! -f "$MODEL/tokenizer.json" ]; then
    rm -rf "$MODEL.tmp"
    "$VENV/bin/python" "$HERE/build_tiny_model.py" "$MODEL.tmp" >&2
    rm -rf "$MODEL" && mv "$MODEL.tmp" "$MODEL"   # whole or not at all
  fi
) 8>"$DIR/.model.lock"
if [ "$PORT" = --prepare ]; then
  echo "ready: $VENV, $MODEL"
  exit 0
fi

PIN=()
if [[ "${VLLM_CPU_OMP_THREADS_BIND:-}" =~ ^[0-9][0-9,-]*$ ]] && command -v taskset >/dev/null; then
  PIN=(taskset -c "$VLLM_CPU_OMP_THREADS_BIND")
fi
TRACES=()
if [ -n "${OTLP_TRACES_ENDPOINT:-}" ]; then
  export OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=${OTEL_EXPORTER_OTLP_TRACES_PROTOCOL:-http/protobuf}
  export OTEL_BSP_SCHEDULE_DELAY=${OTEL_BSP_SCHEDULE_DELAY:-500}
  TRACES=(--otlp-traces-endpoint "$OTLP_TRACES_ENDPOINT")
fi
exec "${PIN[@]}" "$VENV/bin/vllm" serve "$MODEL" --served-model-name "${SERVED_NAME:-acme/tiny}" \
  --host "${HOST:-127.0.0.1}" --port "$PORT" --max-model-len "${MAX_MODEL_LEN:-1024}" \
  --enforce-eager "${TRACES[@]}" "$@"
