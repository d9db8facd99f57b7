#!/usr/bin/env bash
# Serve a tiny random text-embedding model with real vLLM on CPU (`/v1/embeddings`), in the
# foreground, as serve-tiny.sh does for the tiny Llama. Installs vLLM and builds the model first
# when they are missing; both are cached under $REAL_ENGINES_DIR (default ~/.cache/real-engines):
#   vllm/         the same venv as serve-tiny.sh (install-vllm.sh)
#   tiny-embed/   the model, built offline by build_tiny_embedder.py (~11 s, 3.5 MB): a bare
#                 LlamaModel with Sentence Transformers pooling files (last token, normalised),
#                 256-dim vectors, Matryoshka dimensions 32/64/128/256
#
#   scripts/real-engine/serve-embed.sh PORT [extra `vllm serve` args...]
#   scripts/real-engine/serve-embed.sh --prepare         # install + build only, then exit
#
# Env (defaults): SERVED_NAME=acme/tiny-embed  MAX_MODEL_LEN=512  HOST=127.0.0.1  DTYPE=float32
#   VLLM_CPU_OMP_THREADS_BIND: the core(s) it computes on; the whole server is kept there
#   (taskset), as in serve-tiny.sh.
#   DTYPE (float32): the model is stored in bf16 but served in float32 by default. On a host whose
#   CPU advertises AMX (e.g. an Intel Xeon VM), vLLM's CPU attention picks its AMX kernel for
#   bf16 and runs AMX instructions without asking the kernel for AMX state (XTILEDATA) first:
#   when the server's first forward pass is short (a request of 1-5 tokens, e.g. "" or [5]),
#   nothing has asked yet (a longer first pass does, presumably oneDNN's AMX GEMM), the worker
#   dies of SIGILL and the server is dead (500, then it exits). float32 takes the plain AVX-512
#   kernel. The tiny chat Llama (serve-tiny.sh, bf16) has the same trap on such a host.
# vLLM finds the model's modules.json and resolves `--runner auto` to pooling (convert embed)
# by itself: no runner flag. Then ~25-40 s to /health 200 (--enforce-eager), ~2.9 GB RSS
# (of which 1 GiB KV cache: a decoder-based embedder still gets one).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${REAL_ENGINES_DIR:-$HOME/.cache/real-engines}
VENV=$DIR/vllm
MODEL=$DIR/tiny-embed
usage="usage: serve-embed.sh PORT [vllm serve args...] | serve-embed.sh --prepare"
PORT=${1:?$usage}
shift

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}   # GiB, an integer: 1 is the least

REAL_ENGINES_DIR=$DIR bash "$HERE/install-vllm.sh" "$VENV" >&2
(
  flock 8   # two replicas starting at once build the model once
  if [ ! -f "$MODEL/model.safetensors" ] || [ ! -f "$MODEL/modules.json" ]; then
    rm -rf "$MODEL.tmp"
    "$VENV/bin/python" -I "$HERE/build_tiny_embedder.py" "$MODEL.tmp" >&2
    rm -rf "$MODEL" && mv "$MODEL.tmp" "$MODEL"   # whole or not at all
  fi
) 8>"$DIR/.embed.lock"
if [ "$PORT" = --prepare ]; then
  echo "ready: $VENV, $MODEL"
  exit 0
fi

PIN=()
if [[ "${VLLM_CPU_OMP_THREADS_BIND:-}" =~ ^[0-9][0-9,-]*$ ]] && command -v taskset >/dev/null; then
  PIN=(taskset -c "$VLLM_CPU_OMP_THREADS_BIND")
fi
exec "${PIN[@]}" "$VENV/bin/vllm" serve "$MODEL" \
  --served-model-name "${SERVED_NAME:-acme/tiny-embed}" --host "${HOST:-127.0.0.1}" --port "$PORT" \
  --max-model-len "${MAX_MODEL_LEN:-512}" --dtype "${DTYPE:-float32}" --enforce-eager "$@"
