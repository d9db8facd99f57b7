#!/usr/bin/env bash
# Serve Arize Phoenix, a real OpenTelemetry trace backend, in the foreground (so a supervisor, or
# the tests, own the process and its group). Installs it first when it is missing
# (install-phoenix.sh: a venv under $REAL_ENGINES_DIR, default ~/.cache/real-engines).
#
#   scripts/trace-backend/serve-phoenix.sh PORT [GRPC_PORT]
#
# Then, on http://127.0.0.1:PORT: OTLP/HTTP (protobuf) spans in at /v1/traces, REST at /v1
# (GET /v1/projects/default/spans), GraphQL at /graphql, the UI at /. OTLP/gRPC on GRPC_PORT
# (default 4317), which Phoenix binds on every interface, whatever PHOENIX_HOST says.
# A span goes to the project named by its resource's `openinference.project.name`, else
# "default". Phoenix keeps no span kind, no links and no resource attributes (the tests' relay,
# tests/support/trace_backend.py, adds kind and links back). ~12 s to /readyz 200 (more beside
# busy engines); ~420 MB.
#
# Env (defaults): HOST=127.0.0.1  PHOENIX_SQL_DATABASE_URL=sqlite:///:memory: (spans are gone
#   when it stops)  PHOENIX_WORKING_DIR=$REAL_ENGINES_DIR/phoenix-home (a few empty folders).
# Off: Phoenix's telemetry, anything it would fetch from outside, its AI assistant (with its
# server-side bash tool) and its MCP server.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${REAL_ENGINES_DIR:-$HOME/.cache/real-engines}
usage="usage: serve-phoenix.sh PORT [GRPC_PORT]"
PORT=${1:?$usage}
GRPC_PORT=${2:-4317}

VENV=$(REAL_ENGINES_DIR=$DIR bash "$HERE/install-phoenix.sh")
export PHOENIX_HOST=${HOST:-127.0.0.1} PHOENIX_PORT=$PORT PHOENIX_GRPC_PORT=$GRPC_PORT
export PHOENIX_SQL_DATABASE_URL=${PHOENIX_SQL_DATABASE_URL:-sqlite:///:memory:}
export PHOENIX_WORKING_DIR=${PHOENIX_WORKING_DIR:-$DIR/phoenix-home}
export PHOENIX_TELEMETRY_ENABLED=false PHOENIX_ALLOW_EXTERNAL_RESOURCES=false
export PHOENIX_DISABLE_AGENT_ASSISTANT=true PHOENIX_AGENTS_DISABLE_BASH=true
export PHOENIX_ENABLE_MCP_SERVER=false
mkdir -p "$PHOENIX_WORKING_DIR"
cd "$PHOENIX_WORKING_DIR"
exec "$VENV/bin/phoenix" serve
