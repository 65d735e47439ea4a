#!/usr/bin/env bash
# Builds .venv-engine: the real SGLang 0.5.23 (CPU path), mooncake's non-CUDA transfer engine
# and smg 1.13.0, apart from .venv because sglang pins its own torch, transformers and
# pydantic stack (about 11 GB, about 10 minutes on a 2-core machine).
#
# The tests in tests/real_engine/ run from .venv and start engines with this interpreter;
# nothing of the project is installed here. Re-running when the environment is complete is a
# no-op: the stamp records the requirement set, so a changed pin rebuilds it.
#
# System package: mooncake's transfer engine loads libibverbs even for its TCP transport.
# As root (CI and developers here) it is apt-installed; otherwise install `libibverbs1`
# yourself (or make `sudo -n` work) and run this again.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${ENGINE_VENV:-.venv-engine}"
PY="${PY:-python3}"
REQUIREMENTS=(
  "sglang==0.5.23"
  "mooncake-transfer-engine-non-cuda==0.3.13.post1"
  "smg==1.13.0"
)
STAMP="$VENV/.complete"
MODEL_DIR="${ENGINE_MODEL_DIR:-.cache/real-engine/tiny-llama}"
WANT="${REQUIREMENTS[*]}"

log() { printf '[engine-env] %s\n' "$*" >&2; }

ensure_libibverbs() {
  if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    return
  fi
  local runner=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      runner=(sudo -n)
    else
      log "libibverbs1 is missing and this user cannot apt-get (not root, no sudo -n):"
      log "install it with 'apt-get install -y libibverbs1', then run this again."
      exit 1
    fi
  fi
  log "apt-get install libibverbs1 (mooncake's transfer engine loads it even for TCP)"
  DEBIAN_FRONTEND=noninteractive "${runner[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${runner[@]}" apt-get install -y -qq libibverbs1 >/dev/null
}

# The tiny model the tests serve: built locally from a fixed seed, no hub download (15 s).
build_model() {
  "$VENV/bin/python" tests/real_engine/tiny_model.py "$MODEL_DIR"
}

ensure_libibverbs

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  log "$VENV is complete ($WANT)"
  build_model
  exit 0
fi

start=$(date +%s)
rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
log "pip install ${REQUIREMENTS[*]} (about 10 minutes and 11 GB the first time)"
# (Locations this machine's pip configuration names but that do not exist are dropped from
# the log: one warning per package otherwise.)
"$VENV/bin/python" -m pip install --quiet --progress-bar off "${REQUIREMENTS[@]}" \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
# Import check: a broken wheel fails here, not in the middle of a test session.
"$VENV/bin/python" -c 'import sglang, mooncake, transformers, tokenizers, torch; print("sglang", sglang.__version__, "torch", torch.__version__)' >&2
printf '%s' "$WANT" >"$STAMP"
log "$VENV ready in $(( $(date +%s) - start )) s"
build_model
