"""Correctness of the grouped-matmul backends and the MoE layer on a real GPU (compiled, not
interpreted), against a float64 numpy reference (XLA runs fp32 dots on a GPU as TF32 unless
told otherwise, so `ragged_dot` is no fp32 reference there); run before the GPU benchmarks.

    python benchmarks/gpu_check.py        # prints one line per check and "gpu checks: N passed, M failed"

Each check is independent: a failure prints its one-line reason and the others still run.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS: list[tuple[str, bool, str]] = []


def check(name):
    def wrap(fn):
        try:
            detail = fn() or ""
            RESULTS.append((name, True, detail))
        except Exception as e:  # noqa: BLE001 - report and go on
            RESULTS.append((name, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            traceback.print_exc(limit=3)
        ok, msg = RESULTS[-1][1:]
        print(f"{'ok  ' if ok else 'FAIL'} {name} {msg}", flush=True)
        return fn
    return wrap


def groups(rng, rows: int, g: int):
    cuts = np.sort(rng.integers(0, rows + 1, g - 1))
    return jnp.asarray(np.diff(np.concatenate([[0], cuts, [rows]])), jnp.int32)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def numpy_gmm(lhs, rhs, gs):
    """float64 grouped matmul and the gradients of sum(sin(out)): the reference."""
    a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    ends = np.cumsum(np.asarray(gs))
    out, da, db = np.zeros((a.shape[0], b.shape[2])), np.zeros_like(a), np.zeros_like(b)
    for g, (lo, hi) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        out[lo:hi] = a[lo:hi] @ b[g]
        dout = np.cos(out[lo:hi])
        da[lo:hi], db[g] = dout @ b[g].T, a[lo:hi].T @ dout
    return out, da, db


def gmm_case(backend_fn, dtype, tol, m=1000, k=512, n=768, g=8, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
    gs = groups(rng, m, g)
    out = jax.jit(backend_fn)(lhs, rhs, gs)
    ref, ra, rb = numpy_gmm(lhs, rhs, gs)
    e = rel_err(out, ref)
    loss = lambda a, b: jnp.sum(jnp.sin(backend_fn(a, b, gs).astype(jnp.float32)))  # noqa: E731
    ga, gb = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    eg = max(rel_err(ga, ra), rel_err(gb, rb))
    if not (e < tol and eg < tol):
        raise AssertionError(f"relative error forward {e:.2e}, gradients {eg:.2e} (tolerance {tol})")
    return f"forward {e:.1e}, gradients {eg:.1e}"


def main() -> int:
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    from cmoe_jax.moe.gmm import get_gmm, resolve_backend

    check("resolve_backend('auto') on gpu is pallas_gpu")(
        lambda: None if resolve_backend("auto") == "pallas_gpu" else (_ for _ in ()).throw(
            AssertionError(resolve_backend("auto"))))
    for name in ("pallas_gpu", "tokamax"):
        for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
            check(f"gmm {name} {jnp.dtype(dtype).name} vs numpy float64")(
                lambda name=name, dtype=dtype, tol=tol: gmm_case(get_gmm(name), dtype, tol))
    check("gmm pallas_gpu empty groups and 7 rows")(
        lambda: gmm_case(get_gmm("pallas_gpu"), jnp.float32, 1e-4, m=7, g=16, seed=3))

    def moe_layer():
        from flax import nnx

        from cmoe_jax.moe import MoEFFN
        x = jax.random.normal(jax.random.key(1), (4, 256, 256))
        outs = {}
        for backend in ("pallas_gpu", "ragged_dot"):
            layer = MoEFFN(d_model=256, expert_width=128, num_experts=8, top_k=2, shared_width=128, backend=backend, activation="silu", rngs=nnx.Rngs(0))
            with jax.default_matmul_precision("highest"):  # the rest of the layer in IEEE fp32 too
                outs[backend] = nnx.jit(lambda m, x: m(x))(layer, x)
        e = rel_err(outs["pallas_gpu"], outs["ragged_dot"])
        if e > 1e-4:
            raise AssertionError(f"relative error {e:.2e}")
        return f"relative error {e:.1e}"
    check("MoEFFN pallas_gpu vs ragged_dot, both at highest precision (4 x 256 tokens)")(moe_layer)

    def dispatch_paths(tokens):
        """Every dispatch path of the layer against the sort path on `ragged_dot`: outputs
        and the gradients of the expert weights, at highest precision."""
        from flax import nnx

        from cmoe_jax.moe import MoEFFN
        x = jax.random.normal(jax.random.key(2), (tokens, 256))
        loss = lambda m, x: jnp.sum(jnp.sin(m(x)))  # noqa: E731
        got = {}
        for path, backend in (("sort", "ragged_dot"), ("sort", "pallas_gpu"), ("dense", "auto"),
                              ("gather", "auto"), ("padded", "auto"), ("auto", "auto")):
            layer = MoEFFN(d_model=256, expert_width=128, num_experts=8, top_k=2, shared_width=128, router="cmoe", router_neurons=8,
                           backend=backend, dispatch=path, activation="silu", rngs=nnx.Rngs(0))
            with jax.default_matmul_precision("highest"):
                y = nnx.jit(lambda m, x: m(x))(layer, x)
                g = nnx.jit(nnx.grad(loss))(layer, x)
            got[f"{path}@{backend}"] = (y, g.expert_gate[...], g.expert_down[...])
        ref = got.pop("sort@ragged_dot")
        errs = {k: max(rel_err(a, b) for a, b in zip(v, ref)) for k, v in got.items()}
        worst = max(errs.values())
        if worst > 1e-4:
            raise AssertionError(", ".join(f"{k} {e:.1e}" for k, e in errs.items()))
        return ", ".join(f"{k} {e:.1e}" for k, e in errs.items())
    for tokens in (3, 512):
        check(f"MoEFFN every dispatch path vs sort@ragged_dot, values and gradients ({tokens} tokens)")(
            lambda tokens=tokens: dispatch_paths(tokens))

    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"gpu checks: {passed} passed, {len(RESULTS) - passed} failed")
    return 0 if passed == len(RESULTS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
