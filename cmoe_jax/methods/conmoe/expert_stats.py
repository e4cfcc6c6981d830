"""Calibration statistics of an MoE model's routed experts, layer by layer.

The original model runs on the calibration windows one layer at a time (as conversion does,
`cmoe_jax.calibration_pass.layer_pass`); at each MoE layer the router picks every token's top-k set
and gates, and every routed expert runs on every token, so one pass collects what ConMoE and
all four baselines need:

- `freq [E]`: tokens whose top-k set contains the expert (frequency pruning, M-SMoE cores),
- `contrib [E]`: ConMoE's a_e = mean over those tokens of g_e(t) ||e(h_t)||_2 (REAP's score),
- `mean_out [E, d]`: the expert's mean output over all tokens (HC-SMoE's features),
- `logit_gram [E, E]`: Gram matrix of the router-logit columns (M-SMoE's similarity).

In a hierarchical layer (`HierMoEFFN`) E counts top-level experts and an expert's output is
its family's, `E_i^s(x) + sum_j g'_ij E_ij^r(x)` with its own sub-routing; the router is the
top-level one.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmoe_jax.moe import MoELayer
from cmoe_jax.moe.hierarchical import sub_route
from cmoe_jax.moe.activations import glu_activation
from cmoe_jax.calibration_pass.layer_pass import (
    LayerInput,
    calibration_mesh,
    layer_pass,
    start_pass,
)


@dataclasses.dataclass
class LayerStats:
    freq: np.ndarray        # int64 [E]
    contrib: np.ndarray     # float64 [E]
    mean_out: np.ndarray    # float64 [E, d]
    logit_gram: np.ndarray  # float64 [E, E]
    tokens: int

    def to_npz(self) -> dict:
        return {k: np.asarray(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_npz(cls, d) -> "LayerStats":
        return cls(d["freq"], d["contrib"], d["mean_out"], d["logit_gram"], int(d["tokens"]))


def router_logits(ffn, x):
    """float32 `[T, E]`: the scores the router ranks (its unit's logits; pruned slots -inf)."""
    return ffn.router_scores(x)


def is_hierarchical(ffn) -> bool:
    return getattr(ffn, "sub_experts", 0) > 0


def all_expert_outputs(ffn, x):
    """float32 `[T, E, d]`: every routed expert's SwiGLU output on every token (in a
    hierarchical layer every family's output, each with its own sub-routing)."""
    wg, wu, wd = (p[...].astype(jnp.float32) for p in (ffn.expert_gate, ffn.expert_up, ffn.expert_down))
    x = x.astype(jnp.float32)
    h = glu_activation(ffn.activation)(jnp.einsum("td,edm->tem", x, wg)) * jnp.einsum("td,edm->tem", x, wu)
    out = jnp.einsum("tem,emd->ted", h, wd)
    if not is_hierarchical(ffn):
        return out

    t, n = x.shape[0], ffn.top_experts
    every = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (t, n))  # every family chosen
    ids, w = sub_route(x, every, jnp.ones((t, n), jnp.float32), ffn.sub_routers())
    weights = jnp.zeros((t, n * ffn.sub_experts), jnp.float32).at[jnp.arange(t)[:, None], ids].add(w)
    return (out * weights[..., None]).reshape(t, n, ffn.sub_experts, -1).sum(2)


@functools.partial(jax.jit, static_argnums=0)
def chunk_sums(graphdef, state, x):
    """Per-chunk sums (freq, contrib sum, output sum, logit Gram) for tokens `x [T, d]`."""
    ffn = nnx.merge(graphdef, state)
    ids, gates = ffn.top_route(x) if is_hierarchical(ffn) else ffn.route(x)
    e = ffn.top_experts if is_hierarchical(ffn) else ffn.num_experts
    sel = jnp.zeros((x.shape[0], e), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].add(1.0)
    g = jnp.zeros((x.shape[0], e), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].add(gates)
    out = all_expert_outputs(ffn, x)
    norms = jnp.linalg.norm(out, axis=-1)
    logits = router_logits(ffn, x)
    return sel.sum(0), (g * norms * (sel > 0)).sum(0), out.sum(0), logits.T @ logits


def layer_stats(ffn, x, chunk: int = 1024) -> LayerStats:
    """Statistics of MoE layer `ffn` on its inputs `x [..., d]` (float64 accumulation)."""
    x = np.asarray(x, np.float32).reshape(-1, ffn.d_model)
    gd, st = nnx.split(ffn)
    acc = None
    for s in range(0, x.shape[0], chunk):
        part = [np.asarray(a, np.float64) for a in chunk_sums(gd, st, jnp.asarray(x[s:s + chunk]))]
        acc = part if acc is None else [a + b for a, b in zip(acc, part)]
    freq, contrib_sum, out_sum, gram = acc
    contrib = np.where(freq > 0, contrib_sum / np.maximum(freq, 1), 0.0)
    return LayerStats(freq.astype(np.int64), contrib, out_sum / x.shape[0], gram, int(x.shape[0]))


def collect_stats(model, windows: np.ndarray, *, done=None, on_layer=None, progress=True):
    """`{layer: LayerStats}` of every MoE layer of `model` on calibration `windows [N, T]`.

    `done`: stats of layers finished by an interrupted run (resume: those layers only run
    forward); `on_layer(i, stats)` is called as each new layer finishes."""
    done = dict(done or {})
    windows = np.asarray(windows, np.int32)
    mesh = calibration_mesh(windows.shape[0])
    h, rope = start_pass(model, windows, mesh)
    stats = {}

    def measure(inputs: LayerInput):
        i, mlp = inputs.index, inputs.layer.mlp
        if isinstance(mlp, MoELayer):
            if i in done:
                stats[i] = done[i]
            else:
                stats[i] = layer_stats(mlp, inputs.ffn_input)
                if on_layer is not None:
                    on_layer(i, stats[i])
        return mlp  # the layer runs on unchanged

    layer_pass(model.layers, h, rope, mesh, measure, desc="calibrating experts", progress=progress)
    return stats
