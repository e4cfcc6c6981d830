#!/usr/bin/env bash
# Example conversion job: SmolLM2-135M to the three README configurations, each evaluated
# on the first 40 WikiText-2 test windows, with the defaults as in the README's table. Models
# land in runs/smollm2/<CONFIG>/, their perplexity beside them in runs/smollm2/<CONFIG>.ppl.json
# (a job never writes inside its input). DATA holds WikiText-2's valid.txt and test.txt.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${VENV:-.venv}/bin/python"   # VENV=DIR picks the environment
DATA=${DATA:-../shared/data/wikitext-2}
for CONFIG in ${CONFIGS:-S3A3E8 S2A2E16 S1A1E8}; do
  "$PY" -m cmoe_jax.convert --model smollm2 --config "$CONFIG" --calib wikitext2 \
    --data-path "$DATA/valid.txt" --calib-samples 8 --seqlen 2048 --k-act 10 --seed 0 \
    --out "runs/smollm2/$CONFIG" --overwrite --report
  "$PY" -m cmoe_jax.eval --model "runs/smollm2/$CONFIG" --dataset wikitext2 \
    --data-path "$DATA/test.txt" --max-windows 40 --json "runs/smollm2/$CONFIG.ppl.json"
done
