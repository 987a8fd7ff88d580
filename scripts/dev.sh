#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (idempotent), then runs the main job or the tests.
#   bash scripts/dev.sh scan   [extra qkcircuits scan args]   head scan of SmolLM2-135M + HTML report in out/
#   bash scripts/dev.sh test   [extra pytest args]            the whole test suite
#   bash scripts/dev.sh setup                                  only the environment
#   bash scripts/dev.sh qk ARGS...                             any qkcircuits command in .venv, e.g. qk scan toy-induction
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

# The newest torch wheel on this machine that this interpreter can install, or nothing.
local_torch_wheel() {
  "$VENV/bin/python" - <<'PY'
import glob, os, subprocess, sys
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename

dirs = os.environ.get("TORCH_WHEELS", "").split(os.pathsep) + os.environ.get("PIP_FIND_LINKS", "").split()
config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
for line in config.splitlines():
    key, _, value = line.partition("=")
    if key.endswith("find-links"):
        dirs += value.strip().strip("'\"").split()
supported, best = set(sys_tags()), None
for d in filter(None, dirs):
    for path in glob.glob(os.path.join(d.replace("file://", ""), "torch-*.whl")):
        name, version, _, tags = parse_wheel_filename(os.path.basename(path))
        if name == "torch" and tags & supported and (best is None or version > best[0]):
            best = (version, path)
print(best[1] if best else "")
PY
}

setup() {
  if [ ! -x "$VENV/bin/pip" ]; then
    "$PY" -c 'import sys; assert sys.version_info >= (3, 10), "qkcircuits needs Python >= 3.10"'
    rm -rf "$VENV"   # a half-made venv (e.g. no ensurepip) would make every later run fail
    if ! "$PY" -m venv "$VENV"; then
      rm -rf "$VENV"
      if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv
        "$PY" -m venv "$VENV"
      else
        echo "error: '$PY -m venv' failed; install your distribution's python3-venv package" >&2; exit 2
      fi
    fi
  fi
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    # Prefer a torch wheel already on this machine (pip's find-links, or the folders in $TORCH_WHEELS)
    # over a multi-GB CUDA download: install that file by path, its small dependencies from the index.
    wheel=$(local_torch_wheel)
    t0=$SECONDS
    if [ -n "$wheel" ]; then
      echo "qkcircuits: [1/2] installing torch from $wheel ($(du -m "$wheel" | cut -f1) MB; unpacking takes 1-2 minutes)" >&2
      "$VENV/bin/pip" install -q "$wheel"
    else
      echo "qkcircuits: [1/2] no torch wheel on this machine; installing torch from PyPI (large download, pip's bar below)" >&2
      "$VENV/bin/pip" install --progress-bar on torch
    fi
    echo "qkcircuits: [1/2] torch installed in $((SECONDS - t0)) s" >&2
  fi
  stamp="$VENV/.qkcircuits-installed"
  want=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    t0=$SECONDS
    echo "qkcircuits: [2/2] installing qkcircuits and its dependencies (pyproject.toml) from PyPI: one line per download" >&2
    # pip's own lines for what it fetches ("Downloading X (12.3 MB)"), nothing else; pip's exit status is kept
    "$VENV/bin/pip" install --progress-bar off -e ".[dev]" 2>&1 \
      | { grep --line-buffered -E "^ *(Downloading|Installing collected|Successfully installed|ERROR|error)" || true; } >&2
    echo "qkcircuits: [2/2] installed in $((SECONDS - t0)) s" >&2
    echo "$want" > "$stamp"
  fi
}

cmd=${1:-help}; shift || true
case "$cmd" in
  setup) setup ;;
  scan)
    setup
    mkdir -p out
    # scan (with the causal check), diagnose and report in ONE process: one model load, one corpus pass
    # (scripts/main_scan.py runs the three qkcircuits commands' own code on the shared model)
    "$VENV/bin/python" scripts/main_scan.py "$@"
    echo "report: open out/smollm2-report.html in a browser (works offline)"
    ;;
  qk)
    setup
    # any command of the README, run in .venv without activating it: bash scripts/dev.sh qk circuits smollm2-135m --head 18.6
    exec "$VENV/bin/python" -m qkcircuits "$@"
    ;;
  test)
    setup
    # The browser tests (tests/test_browser.py) drive Debian's chromium; they fail, not skip, without it.
    if ! command -v chromium >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
      $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
    fi
    export HF_HUB_OFFLINE=1
    # One pytest-xdist worker per core (at most 4; QKCIRCUITS_TEST_WORKERS overrides, 1 = no workers). --dist
    # loadfile keeps a file's tests on one worker, so module fixtures are built once; each worker loads its own
    # shared SmolLM2 (tests/conftest.py) and takes its share of the cores for torch.
    workers=${QKCIRCUITS_TEST_WORKERS:-$("$VENV/bin/python" -c 'import os; print(max(1, min(4, os.cpu_count() or 1)))')}
    parallel=()
    if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile); fi
    # --durations: the slowest tests in every CI log, so that what slows the suite is seen where it runs
    "$VENV/bin/python" -m pytest -q --durations=20 ${parallel[@]+"${parallel[@]}"} "$@"
    ;;
  *) echo "usage: bash scripts/dev.sh scan|test|setup|qk [args]" >&2; exit 2 ;;
esac
