#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (idempotent), then runs the main job or the tests.
#   bash scripts/dev.sh scan   [extra qkcircuits scan args]   head scan of SmolLM2-135M + HTML report in out/
#   bash scripts/dev.sh test   [extra pytest args]            the whole test suite
#   bash scripts/dev.sh setup                                  only the environment
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -c 'import sys; assert sys.version_info >= (3, 10), "qkcircuits needs Python >= 3.10"'
    "$PY" -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    # Prefer a torch wheel already on this machine (pip's find-links, e.g. a CPU build) over a
    # multi-GB CUDA download from PyPI; fall back to PyPI when there is none.
    "$VENV/bin/pip" install -qq --no-index torch 2>/dev/null || "$VENV/bin/pip" install -qq torch
  fi
  stamp="$VENV/.qkcircuits-installed"
  want=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$VENV/bin/pip" install -qq -e ".[dev]"
    echo "$want" > "$stamp"
  fi
}

cmd=${1:-help}; shift || true
case "$cmd" in
  setup) setup ;;
  scan)
    setup
    mkdir -p out
    "$VENV/bin/qkcircuits" scan smollm2-135m --text --confirm 5 --json out/smollm2-scan.json --csv out/smollm2-scan.csv "$@"
    "$VENV/bin/qkcircuits" diagnose smollm2-135m --json out/smollm2-diagnostics.json > out/smollm2-diagnostics.txt
    "$VENV/bin/qkcircuits" report smollm2-135m --scores out/smollm2-scan.json \
      --diagnostics out/smollm2-diagnostics.json -o out/smollm2-report.html
    echo "report: open out/smollm2-report.html in a browser (works offline)"
    ;;
  test)
    setup
    # The browser tests (tests/test_browser.py) drive Debian's chromium; they fail, not skip, without it.
    if ! command -v chromium >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
      $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
    fi
    export HF_HUB_OFFLINE=1
    "$VENV/bin/python" -m pytest -q "$@"
    ;;
  *) echo "usage: bash scripts/dev.sh scan|test|setup [args]" >&2; exit 2 ;;
esac
