#!/usr/bin/env bash
# Set up (core install: no torch), then run the demo on the embedded SmolLM2-135M-Instruct
# and WikiText-2. Arguments go to `python -m cmoe_jax.demo` (e.g. --windows 40).
# VENV=DIR chooses the environment (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec "${VENV:-.venv}/bin/python" -m cmoe_jax.demo "$@"
