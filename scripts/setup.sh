#!/usr/bin/env bash
# Create .venv and install cmoe_jax with pinned dependencies (idempotent; re-runs when
# pyproject.toml changes). Usage: scripts/setup.sh [extras], e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python_bin="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)-${extras:-core}"
if [ ! -f "$stamp" ]; then
  spec="."
  [ -n "$extras" ] && spec=".[${extras}]"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$spec"
  touch "$stamp"
fi
