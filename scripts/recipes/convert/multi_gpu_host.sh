#!/usr/bin/env bash
# CMoE conversion on one host with several GPUs as one process per GPU (each process owns
# one device: CUDA_VISIBLE_DEVICES), on a loopback coordinator, then perplexity of the
# result with the same processes. One process over all GPUs (no JAX_* variables: the
# calibration batch is then split over the local devices) works too; this script shows the
# multi-process form that multi-host GPU clusters use (there, give every host the first
# host's address and its own JAX_PROCESS_ID range). Needs `pip install -e '.[cuda]'`.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${VENV:-.venv}/bin/python"   # VENV=DIR picks the environment
MODEL=${MODEL:-meta-llama/Llama-2-7b-hf}
CONFIG=${CONFIG:-S3A3E16}
DATA=${DATA:-../shared/data/wikitext-2}       # valid.txt and test.txt (WikiText-2 raw release)
RUNS=${RUNS:-runs}
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
SAMPLES=${SAMPLES:-$((8 * GPUS))}             # calibration windows over all processes
PORT=${PORT:-12355}
OUT="$RUNS/$(basename "$MODEL")/$CONFIG"
export JAX_COORDINATOR_ADDRESS=127.0.0.1:$PORT JAX_NUM_PROCESSES=$GPUS
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

job() {  # run "$@" as one process per GPU; fail if any process fails
  local pids=() i
  for ((i = 0; i < GPUS; i++)); do
    CUDA_VISIBLE_DEVICES=$i JAX_PROCESS_ID=$i "$@" &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i"; done
}

job "$PY" -m cmoe_jax.convert --model "$MODEL" --config "$CONFIG" \
  --calib wikitext2 --data-path "$DATA/valid.txt" --calib-samples "$SAMPLES" --seqlen 2048 \
  --k-act 10 --seed 0 --out "$OUT" --overwrite "$@"
job "$PY" -m cmoe_jax.eval --model "$OUT" --dataset wikitext2 \
  --data-path "$DATA/test.txt" --seqlen 2048 --no-progress --json "$OUT.ppl.json"
