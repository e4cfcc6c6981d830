#!/usr/bin/env bash
# Set up (with the test extras: torch 2.13.0 CPU for the transformers reference), then run
# the test suite on the CPU, one pytest-xdist worker per core (up to 4).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
export JAX_PLATFORMS=cpu TOKENIZERS_PARALLELISM=false
workers=$(( $(nproc) < 4 ? $(nproc) : 4 ))
exec "${VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider -n "$workers" "$@"
