#!/usr/bin/env bash
# Builds .venv-<trainer> (verl or areal): the project with the trainer's extra and the
# `trainer-test` extra (pytest; the whole `test` extra does not resolve beside AReaL), for
# tests/test_<trainer>_real.py. Each trainer has an environment of its
# own: verl 0.9.1 needs transformers>=5.5.3, AReaL 1.0.4 transformers<=5.3 and torch<2.11,
# SGLang 0.5.23 (.venv-engine) transformers==5.19.0.
#
# Re-running when the environment is complete is a no-op: the stamp records the two extras'
# lines of pyproject.toml, so a changed pin rebuilds it.
set -euo pipefail
cd "$(dirname "$0")/.."

TRAINER="${1:?usage: scripts/trainer-env.sh verl|areal}"
case "$TRAINER" in
  verl | areal) ;;
  *) echo "unknown trainer '$TRAINER' (verl or areal)" >&2; exit 2 ;;
esac
VENV=".venv-$TRAINER"
PY="${PY:-python3}"
STAMP="$VENV/.complete"
WANT="$(grep -E "^($TRAINER|trainer-test) = " pyproject.toml)"

log() { printf '[trainer-env %s] %s\n' "$TRAINER" "$*" >&2; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  log "$VENV is complete"
  exit 0
fi

start=$(date +%s)
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
log "pip install -e '.[trainer-test,$TRAINER]' (several GB the first time: torch with CUDA libraries, Ray)"
# (Locations this machine's pip configuration names but that do not exist are dropped from
# the log: one warning per package otherwise.)
nice -n 10 "$VENV/bin/python" -m pip install --quiet --progress-bar off -e ".[trainer-test,$TRAINER]" \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
"$VENV/bin/python" -c "import $TRAINER, torch, transformers; print('$TRAINER ready, torch', torch.__version__, 'transformers', transformers.__version__)" >&2
printf '%s' "$WANT" >"$STAMP"
log "$VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
