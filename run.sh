#!/usr/bin/env bash
# One entry point for a fresh machine. Each command sets up (or reuses) the virtual environment at .venv first.
#   bash run.sh main    train a CNN on scikit-learn's digits with optimize(dtype=bfloat16) beside fp32, report + plot
#   bash run.sh test    lint (ruff) and run the test suite
#   bash run.sh bench   run the quick benchmark suite (writes out/bench/)
#   bash run.sh setup   only set up .venv (everything the tests need)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VENV="$PWD/.venv"
PY="$VENV/bin/python"

setup() {  # $1: the extras to install with the project
  if [ ! -x "$PY" ]; then
    echo "[setup] creating $VENV"
    python3 -m venv "$VENV"
  fi
  "$PY" -m pip install -q --disable-pip-version-check --upgrade pip "setuptools>=77" wheel ninja
  "$PY" -m pip install -q --disable-pip-version-check torch==2.14.1 torchvision==0.29.1
  # --no-build-isolation: build the kernels against the torch installed above, never a second copy.
  echo "[setup] building ipex_train (C++ kernels) ..."
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[$1]"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup test,recipes,xpu,lightning ;;
  main) setup recipes; exec "$PY" -m recipes.digits "$@" ;;
  test) setup test,recipes,xpu,lightning
    "$PY" -m ruff check ipex_train tests benchmarks recipes setup.py
    exec "$PY" -m pytest -q "$@" ;;
  bench) setup recipes,xpu,peers; exec "$PY" -m benchmarks --quick "$@" ;;
  *) echo "usage: bash run.sh {main|test|bench|setup} [args]" >&2; exit 2 ;;
esac
