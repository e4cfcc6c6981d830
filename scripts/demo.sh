#!/usr/bin/env bash
# Set up (core install: no torch), then run the demo on the embedded SmolLM2-135M-Instruct
# and WikiText-2. Arguments go to `python -m cmoe_jax.demo` (e.g. --windows 40).
# VENV=DIR chooses the environment (default .venv).
# WikiText-2 is read from a local copy (--data-path, or shared/data/wikitext-2/ beside the
# checkout); without one it is downloaded, and the `datasets` extra is installed for that.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=datasets
local=../shared/data/wikitext-2
if [ -f "$local/test.txt" ] && [ -f "$local/valid.txt" ]; then extras=""; fi
for arg in "$@"; do
  case "$arg" in --data-path|--data-path=*) extras="" ;; esac
done
scripts/setup.sh ${extras:+"$extras"}
exec "${VENV:-.venv}/bin/python" -m cmoe_jax.demo "$@"
