#!/usr/bin/env bash
# Serve a tiny random Whisper with real vLLM on CPU (`/v1/audio/transcriptions` and
# `/translations`), in the foreground, as serve-tiny.sh does for the tiny Llama. Installs what
# is missing first, all cached under $REAL_ENGINES_DIR (default ~/.cache/real-engines):
#   vllm-audio/    a second venv: install-vllm.sh, then vLLM's audio extra minus torchaudio and
#                  torchcodec (CUDA builds on PyPI): soundfile, soxr, av, scipy (~2 min, 3.7 GB)
#   tiny-whisper/  the model, built offline by build_tiny_whisper.py (~10 s, 1.5 MB)
#
#   scripts/real-engine/serve-whisper.sh PORT [extra `vllm serve` args...]
#   scripts/real-engine/serve-whisper.sh --prepare       # install + build only, then exit
#
# Env (defaults): SERVED_NAME=acme/whisper-tiny  HOST=127.0.0.1
#   VLLM_CPU_OMP_THREADS_BIND: the core(s) it computes on; the whole server is kept there
#   (taskset), as in serve-tiny.sh.
# Then ~35-45 s to /health 200 (--enforce-eager; 70 s with torch.compile's warm-up).
#
# After the project's shared real-engine recipe (shared/real-engines/whisper-start.sh,
# 2026-11-23): the same environment and flags, run in the foreground.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${REAL_ENGINES_DIR:-$HOME/.cache/real-engines}
VENV=$DIR/vllm-audio
MODEL=$DIR/tiny-whisper
AUDIO_EXTRAS=(soundfile soxr av scipy)
usage="usage: serve-whisper.sh PORT [vllm serve args...] | serve-whisper.sh --prepare"
PORT=${1:?$usage}
shift

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}   # GiB, an integer: 1 is the least

REAL_ENGINES_DIR=$DIR bash "$HERE/install-vllm.sh" "$VENV" >&2
(
  flock 8   # two starts at once install the extras and build the model once
  # -I: never import from the working directory (run from $DIR, ./vllm would shadow vLLM).
  if ! "$VENV/bin/python" -I -c "import soundfile, soxr, av, scipy" 2>/dev/null; then
    "$VENV/bin/pip" install --disable-pip-version-check "${AUDIO_EXTRAS[@]}" >&2
  fi
  if [ ! -f "$MODEL/model.safetensors" ] || [ ! -f "$MODEL/tokenizer.json" ]; then
    rm -rf "$MODEL.tmp"
    "$VENV/bin/python" -I "$HERE/build_tiny_whisper.py" "$MODEL.tmp" >&2
    rm -rf "$MODEL" && mv "$MODEL.tmp" "$MODEL"   # whole or not at all
  fi
) 8>"$DIR/.whisper.lock"
if [ "$PORT" = --prepare ]; then
  echo "ready: $VENV, $MODEL"
  exit 0
fi

PIN=()
if [[ "${VLLM_CPU_OMP_THREADS_BIND:-}" =~ ^[0-9][0-9,-]*$ ]] && command -v taskset >/dev/null; then
  PIN=(taskset -c "$VLLM_CPU_OMP_THREADS_BIND")
fi
# max_model_len is Whisper's own 448 (max_target_positions): nothing to set.
exec "${PIN[@]}" "$VENV/bin/vllm" serve "$MODEL" --served-model-name "${SERVED_NAME:-acme/whisper-tiny}" \
  --host "${HOST:-127.0.0.1}" --port "$PORT" --enforce-eager "$@"
