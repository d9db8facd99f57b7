#!/usr/bin/env bash
# Create (or reuse) a venv with Arize Phoenix (PyPI "arize-phoenix" 20.26.1): a real
# OpenTelemetry trace backend, a Python package, for the tests' traces. It receives OTLP/HTTP
# (protobuf) at /v1/traces, keeps the spans in SQLite, and answers for them over REST
# (/v1/projects/NAME/spans) and GraphQL (/graphql). (Jaeger and the OTel Collector are Go
# programs: they cannot be built here.) Idempotent, and safe to run from several processes at
# once (one installs, the others wait and reuse it). Prints the venv's path on stdout.
#   scripts/trace-backend/install-phoenix.sh [VENV]   # default $REAL_ENGINES_DIR/phoenix
# REAL_ENGINES_DIR defaults to ~/.cache/real-engines (outside any clone: ~850 MB).
# About 1.5 min the first time on a 2-core machine; a second run only checks (well under 1 s).
set -euo pipefail
DIR=${REAL_ENGINES_DIR:-$HOME/.cache/real-engines}
VENV=${1:-$DIR/phoenix}
PHOENIX_VERSION=${PHOENIX_VERSION:-20.26.1}
PY=${PYTHON:-python3.11}
mkdir -p "$DIR"
exec 9>"$DIR/.phoenix.lock"
flock 9

# A version check, not an import: importing phoenix.server takes seconds.
ready() {
  "$VENV/bin/python" -I -c "import importlib.metadata as m, sys
sys.exit(m.version('arize-phoenix') != '$PHOENIX_VERSION')" 2>/dev/null && [ -x "$VENV/bin/phoenix" ]
}
if ! ready; then
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  # This machine's pip config also names local index dirs that lack these packages: pip warns
  # "Location ... is ignored" once per package. Those lines are dropped; the rest goes to stderr
  # (stdout is the venv's path alone), and pip's exit status stays the pipeline's (pipefail).
  "$VENV/bin/pip" install -q --disable-pip-version-check "arize-phoenix==$PHOENIX_VERSION" 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  ready
fi
echo "$VENV"
