"""Carve your own dense SwiGLU FFN into a mixture of experts with one call, `carve_ffn`.

The FFN is a Flax NNX module of your own (three `nnx.Linear` layers, kernels in JAX's
`[in, out]` layout); its calibration inputs here are random tokens (use your model's hidden
states at this FFN). The script checks that the carved layer with every expert active equals
the dense FFN, then reports how far the sparse layer (2 of 7 routed experts active) is.

    python examples/carve_own_ffn.py
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmoe_jax import carve_ffn


class MyFFN(nnx.Module):
    """down(silu(gate(x)) * up(x)), the FFN of a Llama-style block."""

    def __init__(self, d: int, d_h: int, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(d, d_h, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, d_h, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(d_h, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def main():
    d, d_h = 64, 256
    ffn = MyFFN(d, d_h, rngs=nnx.Rngs(0))
    calib = jax.random.normal(jax.random.PRNGKey(1), (8, 128, d))    # [batch, seq, d]
    # S1A2E8: 8 experts of width 32; 1 always on (shared), 2 of the other 7 chosen per token
    moe = carve_ffn(ffn.gate.kernel[...], ffn.up.kernel[...], ffn.down.kernel[...], calib,
                    "S1A2E8", activation="silu")
    print(f"carved: {moe.num_experts} routed experts of width {moe.expert_width}, "
          f"top_k {moe.top_k}, shared width {moe.shared_width}, router {moe.router!r}")

    x = jax.random.normal(jax.random.PRNGKey(2), (4, 32, d))
    dense = ffn(x)
    # the carving is a split of the dense neurons: with the dense down rows kept (down_fit=0;
    # by default they are refitted for top_k = 2), every routed expert active and gates 1
    # (the gate scales u are fitted for top_k = 2 too), the experts sum to the dense FFN
    every = carve_ffn(ffn.gate.kernel[...], ffn.up.kernel[...], ffn.down.kernel[...], calib,
                      "S1A2E8", activation="silu", down_fit=0.0)
    every.top_k = every.num_experts
    every.u[...] = jnp.zeros_like(every.u[...])
    err = float(jnp.max(jnp.abs(every(x) - dense)) / jnp.max(jnp.abs(dense)))
    print(f"every expert active: max |MoE - dense| / max |dense| = {err:.2e}")
    assert err < 1e-5, f"the carved experts do not sum to the dense FFN ({err:.2e})"

    y, load = moe(x, return_load=True)
    rel = float(jnp.linalg.norm(y - dense) / jnp.linalg.norm(dense))
    # random weights have no activation structure to exploit, so this error is large; a
    # trained model's FFN carves far better (docs/methods/cmoe.md)
    print(f"sparse (3 of 8 experts per token): relative error {rel:.3f}, "
          f"expert load {np.asarray(load).tolist()}")


if __name__ == "__main__":
    main()
