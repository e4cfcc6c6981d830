#!/usr/bin/env bash
# Set up, then run the demo on the embedded SmolLM2-135M-Instruct and WikiText-2.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m cmoe_jax.demo "$@"
