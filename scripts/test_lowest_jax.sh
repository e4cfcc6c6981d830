#!/usr/bin/env bash
# The MoE layer's tests on the lowest JAX that pyproject.toml admits. The layer is a library
# installed beside a user's own JAX, so its lower bound is tested, not assumed. The
# environment (.venv-lowest, or VENV_LOWEST=DIR) takes jax and jaxlib at the lower bound
# read from pyproject.toml and everything else from constraints.txt; no torch.
# Usage: scripts/test_lowest_jax.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV_LOWEST:-.venv-lowest}"
python_bin="${PYTHON:-python3}"
lowest=$(sed -n 's/^ *"jax>=\([0-9.]*\),.*/\1/p' pyproject.toml)
[ -n "$lowest" ] || { echo "error: no jax lower bound found in pyproject.toml" >&2; exit 2; }
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
stamp="$venv/.installed-$(cat pyproject.toml constraints.txt "$0" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  sed -e "s/^jax==.*/jax==$lowest/" -e "s/^jaxlib==.*/jaxlib==$lowest/" constraints.txt > "$venv/constraints-lowest.txt"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$venv/constraints-lowest.txt" \
    -e . pytest pytest-xdist hypothesis
  touch "$stamp"
fi
"$venv/bin/python" -c "import jax, sys; v = jax.__version__; print('lowest-jax job: jax', v); sys.exit(v != '$lowest')"
export JAX_PLATFORMS=cpu
# the toy router's whole-model export is checked against torch, which this job has not
exec "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider tests/test_moe_*.py tests/test_adding_a_router.py \
  --deselect tests/test_adding_a_router.py::test_a_model_with_the_toy_router_saves_loads_and_exports "$@"
