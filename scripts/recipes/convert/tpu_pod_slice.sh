#!/usr/bin/env bash
# CMoE conversion as a multi-process job on a TPU pod slice (one process per host), then
# perplexity of the result over the same processes. Run this script on EVERY host of the
# slice at once, e.g.
#   gcloud compute tpus tpu-vm ssh NAME --worker=all --command="cd cmoe_jax && bash scripts/recipes/convert/tpu_pod_slice.sh"
# JAX detects the coordinator, process count and id on a pod (CMOE_DISTRIBUTED=auto); set
# JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID instead to name them yourself.
# Each process calibrates on its share of the --calib-samples windows (at least one per
# process) and evaluates its share of the windows; process 0 clusters, writes the manifest and
# the JSON; every process writes its part of the Orbax state. DATA and RUNS must be the same
# path on every host (a shared filesystem, e.g. an NFS or gcsfuse mount); MODEL a directory
# there or a Hub id. Needs `pip install -e '.[tpu]'` on every host.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY="${VENV:-.venv}/bin/python"   # VENV=DIR picks the environment
export CMOE_DISTRIBUTED=${CMOE_DISTRIBUTED:-auto}
MODEL=${MODEL:-meta-llama/Llama-2-7b-hf}
CONFIG=${CONFIG:-S3A3E16}
DATA=${DATA:-/mnt/shared/data/wikitext-2}     # valid.txt and test.txt (WikiText-2 raw release)
RUNS=${RUNS:-/mnt/shared/runs}
SAMPLES=${SAMPLES:-64}                        # calibration windows over all hosts
OUT="$RUNS/$(basename "$MODEL")/$CONFIG"
"$PY" -m cmoe_jax.convert --model "$MODEL" --config "$CONFIG" \
  --calib wikitext2 --data-path "$DATA/valid.txt" --calib-samples "$SAMPLES" --seqlen 2048 \
  --k-act 10 --seed 0 --out "$OUT" --overwrite "$@"
"$PY" -m cmoe_jax.eval --model "$OUT" --dataset wikitext2 \
  --data-path "$DATA/test.txt" --seqlen 2048 --no-progress --json "$OUT.ppl.json"
