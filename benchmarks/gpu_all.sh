#!/usr/bin/env bash
# Every GPU check and the accelerator cells of the MoE grid in one run, within 8 minutes on
# one H100 or H200: the checks get at most CHECK_SECONDS (180), the grid starts no cell after
# GRID_SECONDS (240); on an H200 150 s of checks reached all but the last one, and 270 s
# of grid covered 35 of its 48 bf16 cells (the 1.5B model's run below comes on top):
#
#   bash benchmarks/gpu_all.sh [OUT_DIR]      # default out/gpu
#
# Writes OUT_DIR/device.txt, gpu_check.txt and grid.json (with grid.md and grid.png beside
# it); where the 1.5B model is installed (the `qwen25-coder` extra, or its GGUF in the cache),
# also scale.txt: its whole-model prefill and decoding against dense
# (benchmarks/scale_speed.py, at most SCALE_SECONDS, default 600). Exits non-zero when a check fails. PYTHON picks the interpreter (default python3).
# The results go into docs/results/performance.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu}
py=${PYTHON:-python3}
budget=${GRID_SECONDS:-240}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  "$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} | tee "$out/device.txt"
timeout "${CHECK_SECONDS:-180}" "$py" benchmarks/gpu_check.py 2>&1 | tee "$out/gpu_check.txt"
status=${PIPESTATUS[0]}
# bf16 first (the accelerator's dtype), the largest shape first; ratios against cuBLAS
timeout $((budget + 90)) "$py" benchmarks/moe_grid.py --dtype bf16 \
    --shape 4096x11008 640x2048 576x1536 --paths auto padded sort dense gather \
    --time-budget "$budget" --out "$out/grid.json" 2>&1 | tee "$out/grid.txt"
if "$py" -c "from cmoe_jax.loading import resolve; resolve('qwen2.5-coder-1.5b')" >/dev/null 2>&1; then
  timeout "${SCALE_SECONDS:-600}" "$py" benchmarks/scale_speed.py --model qwen2.5-coder-1.5b \
      --plans S1A1E8 S3A3E8 --batches 1 16 2>&1 | tee "$out/scale.txt"
else
  echo "qwen2.5-coder-1.5b is not installed here: no whole-model figures of it" | tee "$out/scale.txt"
fi
exit "$status"
