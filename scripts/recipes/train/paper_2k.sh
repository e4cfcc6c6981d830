#!/usr/bin/env bash
# The CMoE paper's lightweight fine-tuning (section 4): 2,048 WikiText-2 training samples of
# 2048 tokens, one epoch, LoRA rank 8 / alpha 32 on q/k/v/o/gate/up/down, Adam betas 0.9/0.95,
# lr 5.95e-5 (LoRA) and 1e-3 (router scales u), bias update speed 1e-3. Meant for an
# accelerator host: batches are split over every local device ("data" axis), --mesh DxM adds
# tensor parallelism. MODEL is a converted model directory (python -m cmoe_jax.convert ...).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${VENV:-.venv}/bin/python"   # VENV=DIR picks the environment
MODEL=${MODEL:?set MODEL to a converted model directory}
"$PY" -m cmoe_jax.train --model "$MODEL" --dataset wikitext2 --split train \
  ${DATA_PATH:+--data-path "$DATA_PATH"} --samples 2048 --seqlen 2048 --batch-size "${BATCH:-8}" \
  --lora-rank 8 --lora-alpha 32 --lr 5.95e-5 --router-lr 1e-3 --bias-speed 1e-3 --epochs 1 \
  --save-every 50 ${MESH:+--mesh "$MESH"} --out "${OUT:-runs/ft/paper_2k}" ${RESUME:-}
