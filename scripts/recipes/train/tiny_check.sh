#!/usr/bin/env bash
# A one-minute end-to-end check on the dense SmolLM2: 4 windows of 128 tokens, 4 steps.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${VENV:-.venv}/bin/python"   # VENV=DIR picks the environment
DATA=${DATA:-../shared/data/wikitext-2}
"$PY" -m cmoe_jax.train --model smollm2 --dataset wikitext2 --data-path "$DATA/valid.txt" \
  --samples 4 --seqlen 128 --batch-size 1 --out runs/ft/tiny_check --overwrite
