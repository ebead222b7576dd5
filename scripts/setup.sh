#!/usr/bin/env bash
# Set up a fresh machine for nuvec_mlx: a C++ compiler for mx.compile on Linux,
# a virtual environment in .venv, the package with the extras named in $1, and
# the benchmark's distribution (benchmarks/: its commands and the models the tests build).
#   bash scripts/setup.sh bench   # to run the benchmark
#   bash scripts/setup.sh test    # to run the tests (and the benchmark)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
[ "$extras" = bench ] && extras=mlx-lm
if [ "$(uname -s)" = Linux ]; then
  extras="cpu,$extras"
  # MLX compiles CPU kernels with g++; without it, mx.compile silently runs uncompiled.
  if ! command -v g++ >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
    else
      echo "setup: g++ is missing; install it (e.g. sudo apt-get install g++), then run again" >&2
      exit 1
    fi
  fi
fi
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$extras]" -e ./benchmarks
echo "setup: .venv ready with nuvec-mlx[$extras] and nuvec-mlx-bench"
