"""What one token's routed experts cost on the CPU, by how their weights are held.

The layer keeps each projection's experts stacked (`[E, d, m]`); its path for few tokens
("gather", `cmoe_jax.moe.dispatch.gathered_experts`) takes each chosen expert's slice, which
XLA:CPU copies before the product. This times, interleaved in one process, the same k routed
experts' SwiGLU for one token four ways:

- `gather`: the layer's gather path on the stacked weights, whole slices (as in a scan over
  stacked layers, and in bf16);
- `slabs`: the same in the CPU rule's slabs of each expert, at every size (the layer's fp32
  path on the CPU for experts over 1 MiB held apart, `cmoe_jax.moe.dispatch.pair_products`);
- `switch`: every expert in a buffer of its own, the chosen one picked by `lax.switch`
  (the product reads the expert in place: nothing is copied);
- `contiguous`: one SwiGLU of k experts' width on weights of its own (the bytes the k
  experts must read, the floor).

and the dense FFN the experts were cut from. It prints the medians, the ratios gather /
switch and slabs / switch and the load average; the four ways' outputs are checked equal
first.

    python benchmarks/expert_buffers.py --shape 4096x11008 --experts 8 --top-k 1 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, machine_busy, machine_line, print_load  # noqa: E402


def swiglu(x, w_gate, w_up, w_down):
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    h = jax.nn.silu(jnp.dot(x, w_gate, preferred_element_type=f32)) * jnp.dot(x, w_up, preferred_element_type=f32)
    return jnp.dot(h.astype(x.dtype), w_down, preferred_element_type=f32)


def switched_experts(x, ids, gates, experts):
    """`gathered_experts` with each expert's (gate, up, down) in buffers of its own."""
    import jax.numpy as jnp
    from jax import lax

    num_tokens, top_k = ids.shape
    flat = jnp.minimum(ids.reshape(-1), len(experts) - 1)
    branches = [lambda row, w=w: swiglu(row, *w) for w in experts]
    ys = jnp.stack([lax.switch(flat[p], branches, x[p // top_k]) for p in range(num_tokens * top_k)])
    return jnp.einsum("tkd,tk->td", ys.reshape(num_tokens, top_k, -1), gates.astype(jnp.float32))


def sides(d: int, d_h: int, num_experts: int, top_k: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    from cmoe_jax.moe.dispatch import gathered_experts
    from cmoe_jax.moe.modes import DENSE_WHEN

    m = d_h // num_experts
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.float32)  # noqa: E731
    w_gate, w_up, w_down = normal(num_experts, d, m), normal(num_experts, d, m), normal(num_experts, m, d)
    own = [(w_gate[e] + 0, w_up[e] + 0, w_down[e] + 0) for e in range(num_experts)]  # fresh buffers
    chosen = rng.choice(num_experts, top_k, replace=False)
    contiguous = [jnp.concatenate([w[e] for e in chosen], axis=-1 if i < 2 else 0)  # the k chosen, side by side
                  for i, w in enumerate(zip(*own))]
    dense = (normal(d, d_h), normal(d, d_h), normal(d_h, d))
    x = normal(1, d) * 50
    ids = jnp.asarray(chosen[None], jnp.int32)
    gates = jnp.ones((1, top_k), jnp.float32)
    gather = jax.jit(lambda x, ids, g, a, b, c: gathered_experts(x, ids, g, a, b, c, "silu")[0])
    slabs = jax.jit(lambda x, ids, g, a, b, c: gathered_experts(x, ids, g, a, b, c, "silu",
                                                                DENSE_WHEN["cpu"].slabs()._replace(min_bytes=0))[0])
    switch = jax.jit(switched_experts)
    ffn = jax.jit(swiglu)
    ref = np.asarray(gather(x, ids, gates, w_gate, w_up, w_down))
    np.testing.assert_allclose(np.asarray(switch(x, ids, gates, own)), ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(slabs(x, ids, gates, w_gate, w_up, w_down)), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ffn(x, *contiguous)), ref, rtol=1e-4, atol=1e-6)
    run = lambda f, *a: lambda: jax.block_until_ready(f(*a))  # noqa: E731
    return {"gather": run(gather, x, ids, gates, w_gate, w_up, w_down),
            "slabs": run(slabs, x, ids, gates, w_gate, w_up, w_down),
            "switch": run(switch, x, ids, gates, own),
            "contiguous": run(ffn, x, *contiguous),
            "dense FFN": run(ffn, x, *dense)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", nargs="+", default=["576x1536", "4096x11008"], help="d x d_h")
    p.add_argument("--experts", type=int, default=8, help="routed experts E")
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    load = load_average()
    print(machine_line(), flush=True)
    for shape in args.shape:
        d, d_h = map(int, shape.split("x"))
        for k in args.top_k:
            named = sides(d, d_h, args.experts, k)
            times = dict(zip(named, interleaved_times(list(named.values()), args.repeats)))
            med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            ratios = ("withheld (machine busy)" if machine_busy(load) else
                      f"gather/switch {med['gather'] / med['switch']:.2f}x, slabs/switch {med['slabs'] / med['switch']:.2f}x")
            print(f"{shape} E={args.experts} k={k}: " + "  ".join(f"{n} {v:.2f} ms" for n, v in med.items())
                  + f"  | {ratios}", flush=True)
    print_load(load, args.repeats, ratio=True)


if __name__ == "__main__":
    main()
