# Sourced by scripts/test.sh and scripts/test_jax_range.sh: how the suite compiles.
# The suite's models are tiny, so its time goes into XLA compiling them, not running them:
# - XLA's backend (LLVM) optimisation is off: about a quarter of the suite's time, and
#   every result within the tolerances the tests assert; a caller's own XLA_FLAGS are kept;
# - one compilation cache is shared by the workers and every command they start, so a
#   function compiled once (the same tiny model's forward in many tests) is compiled once.
#   A fresh folder per run, removed at the end; JAX_COMPILATION_CACHE_DIR set by the caller wins.
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0"
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d -t cmoe-jax-tests-XXXXXX)
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
