#!/usr/bin/env bash
# The MoE layer's tests at either end of the JAX range pyproject.toml admits. The layer is a
# library installed beside a user's own JAX, so both ends are tested, not assumed; the
# README's suite (scripts/test.sh) runs on constraints.txt, between them.
#   lowest:  jax/jaxlib at the lower bound read from pyproject.toml, everything else from
#            constraints.txt, on the project's Python (3.11); in .venv-lowest
#   current: the current JAX line on Python >= 3.12 (which JAX >= 0.11 needs), the exact set
#            in constraints-current.txt, tokamax included; in .venv-current; also runs the
#            library examples
# No torch in either. Usage: scripts/test_jax_range.sh lowest|current [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
end="${1:-}"; shift || true
case "$end" in
  lowest)
    venv=.venv-lowest; python_bin="${PYTHON:-python3}"
    want=$(sed -n 's/^ *"jax>=\([0-9.]*\),.*/\1/p' pyproject.toml)
    [ -n "$want" ] || { echo "error: no jax lower bound found in pyproject.toml" >&2; exit 2; }
    packages=(-e . pytest pytest-xdist hypothesis) ;;
  current)
    venv=.venv-current
    python_bin="${PYTHON_CURRENT:-$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3 2>/dev/null | head -1)}"
    [ -n "$python_bin" ] || python_bin=$(command -v python3.12 || command -v python3.13 || true)
    [ -n "$python_bin" ] || { echo "error: the current JAX needs Python >= 3.12 and none was found; set PYTHON_CURRENT=/path/to/python3.12" >&2; exit 2; }
    want=$(sed -n 's/^jax==//p' constraints-current.txt)
    packages=(-e . pytest pytest-xdist hypothesis tokamax) ;;
  *) echo "error: say which end of the JAX range to test: lowest or current" >&2; exit 2 ;;
esac
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
stamp="$venv/.installed-$(cat pyproject.toml constraints.txt constraints-current.txt "$0" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  if [ "$end" = lowest ]; then
    sed -e "s/^jax==.*/jax==$want/" -e "s/^jaxlib==.*/jaxlib==$want/" constraints.txt > "$venv/constraints.txt"
  else
    cp constraints-current.txt "$venv/constraints.txt"
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$venv/constraints.txt" "${packages[@]}"
  touch "$stamp"
fi
"$venv/bin/python" -c "import jax, flax, sys; print('$end-jax job: jax', jax.__version__, 'flax', flax.__version__, 'python', sys.version.split()[0]); sys.exit(jax.__version__ != '$want')"
export JAX_PLATFORMS=cpu
source scripts/test_env.sh
if [ "$end" = current ]; then
  "$venv/bin/python" examples/carve_own_ffn.py
  "$venv/bin/python" examples/train_moe_lm.py
fi
# the toy router's whole-model export is checked against torch, which these jobs have not
"$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider tests/test_moe_*.py tests/test_adding_a_router.py \
  tests/test_gmm_lowering.py --deselect tests/test_adding_a_router.py::test_a_model_with_the_toy_router_saves_loads_and_exports "$@"
