#!/usr/bin/env bash
# Example fine-tuning job: SmolLM2-135M converted to S1A1E8, LoRA as in the CMoE paper
# (rank 8, alpha 32, Adam 0.9/0.95, lr 5.95e-5, router lr 1e-3, bias speed 1e-3) on 2048-token
# windows of WikiText-2 validation text, stopped after a 30-minute budget on a CPU host,
# then WikiText-2 test perplexity of the fine-tuned model. Outputs land in runs/ft/.
# Rerun with RESUME=--resume to continue an interrupted (or time-limited) run.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data/wikitext-2}
MODEL=${MODEL:-runs/smollm2/S1A1E8}
if [ ! -d "$MODEL" ]; then
  .venv/bin/python -m cmoe_jax.convert --model smollm2 --config S1A1E8 --calib wikitext2 \
    --data-path "$DATA/valid.txt" --calib-samples 8 --seqlen 2048 --k-act 10 --seed 0 --out "$MODEL"
fi
.venv/bin/python -m cmoe_jax.train --model "$MODEL" --dataset wikitext2 --data-path "$DATA/valid.txt" \
  --samples 64 --seqlen 2048 --batch-size 1 --lora-rank 8 --lora-alpha 32 --lr 5.95e-5 \
  --router-lr 1e-3 --bias-speed 1e-3 --epochs 1 --save-every 10 --max-minutes "${MINUTES:-30}" \
  --out runs/ft/s1a1e8 ${RESUME:-}
.venv/bin/python -m cmoe_jax.eval --model runs/ft/s1a1e8 --dataset wikitext2 \
  --data-path "$DATA/test.txt" --max-windows 40 --json runs/ft/s1a1e8/ppl.json
