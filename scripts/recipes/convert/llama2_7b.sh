#!/usr/bin/env bash
# Example conversion job for a Hugging Face checkpoint on an accelerator host, as in the
# papers: Llama-2-7B, S3A3E16 (25% activation), 8 x 2048 WikiText-2 calibration tokens.
# MODEL may be a local directory or a Hub id; calibration data comes from `datasets` (the
# `datasets` extra); the --report plots need the `plots` extra.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${VENV:-.venv}/bin/python"   # VENV=DIR picks the environment
MODEL=${MODEL:-meta-llama/Llama-2-7b-hf}
"$PY" -m cmoe_jax.convert --model "$MODEL" --config "${CONFIG:-S3A3E16}" \
  --calib wikitext2 --calib-samples 8 --seqlen 2048 --k-act 10 --seed 0 \
  --out "runs/llama2-7b/${CONFIG:-S3A3E16}" --report "$@"
