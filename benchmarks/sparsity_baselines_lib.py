"""The ExpertWeaver paper's FFN sparsity baselines (AbsTopk-GLU, magnitude, Wanda): used only by
benchmarks/sparsity_baselines.py, so they live beside it rather than in the package.

- AbsTopk-GLU (paper eq. 2): per token keep the round((1-s) d_ffn) largest |Swish(x W_gate)|
  and zero the rest before the product with x W_up; a dynamic, per-token neuron choice.
- Magnitude: zero the s share of smallest |w| of each FFN weight matrix (static, unstructured).
- Wanda (Sun et al. 2023): score |w_ij| * ||x_j||_2 (x the matrix's input over calibration
  tokens) and zero the s share of lowest score within each output neuron (each column of our
  [in, out] layout, a row of the torch weight), as Wanda's per-output comparison group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cmoe_jax.models.layers import SwiGLU


def abstopk_glu(x, w_gate, w_up, w_down, keep: int):
    """AbsTopk-GLU FFN output [..., d] keeping `keep` gate activations per token."""
    g = jax.nn.silu(x @ w_gate)
    kth = jax.lax.top_k(jnp.abs(g), keep)[0][..., -1:]
    g = jnp.where(jnp.abs(g) >= kth, g, 0.0)  # ties at the k-th value keep all of them
    return (g * (x @ w_up)) @ w_down


class AbsTopkGLU(SwiGLU):
    """A dense SwiGLU layer that runs as AbsTopk-GLU (drop-in for `DecoderLayer.mlp`)."""

    def __init__(self, dense: SwiGLU, keep: int):
        self.gate, self.up, self.down, self.keep = dense.gate, dense.up, dense.down, keep

    def __call__(self, x, key=None):
        return abstopk_glu(x, self.gate[...], self.up[...], self.down[...], self.keep)


def _zero_lowest(score: np.ndarray, w: np.ndarray, sparsity: float, axis) -> np.ndarray:
    """w with the round(s n) lowest-score entries zeroed (n: entries per group along `axis`;
    axis None: the whole matrix is one group). Ties: stable order, lower flat index first."""
    if axis is None:
        n = int(round(sparsity * score.size))
        order = np.argsort(score.ravel(), kind="stable")[:n]
        out = w.copy().ravel()
        out[order] = 0
        return out.reshape(w.shape)
    n = int(round(sparsity * score.shape[axis]))
    order = np.argsort(score, axis=axis, kind="stable")
    mask = np.ones_like(w, bool)
    np.put_along_axis(mask, np.take(order, np.arange(n), axis=axis), False, axis=axis)
    return np.where(mask, w, 0)


def magnitude_prune(w, sparsity: float) -> np.ndarray:
    w = np.asarray(w)
    return _zero_lowest(np.abs(w), w, sparsity, None)


def wanda_prune(w, input_norm, sparsity: float) -> np.ndarray:
    """w [in, out]; input_norm [in] = ||x_j||_2 over the calibration tokens."""
    w = np.asarray(w)
    return _zero_lowest(np.abs(w) * np.asarray(input_norm)[:, None], w, sparsity, 0)


@jax.jit
def ffn_input_norms(x, w_gate, w_up):
    """(||x_j|| over tokens [d], ||h_j|| over tokens [d_ffn]) of an FFN's two inputs."""
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    h = jax.nn.silu(x @ w_gate) * (x @ w_up)
    return jnp.sqrt(jnp.sum(x * x, axis=0)), jnp.sqrt(jnp.sum(h * h, axis=0))


def prune_ffn(mlp: SwiGLU, sparsity: float, method: str, x=None) -> None:
    """Prune a dense SwiGLU in place by "magnitude" or "wanda" (x: its calibration inputs)."""
    weights = {n: np.asarray(getattr(mlp, n)[...], np.float32) for n in ("gate", "up", "down")}
    if method == "magnitude":
        new = {n: magnitude_prune(w, sparsity) for n, w in weights.items()}
    elif method == "wanda":
        xn, hn = (np.asarray(a) for a in ffn_input_norms(x, weights["gate"], weights["up"]))
        new = {"gate": wanda_prune(weights["gate"], xn, sparsity),
               "up": wanda_prune(weights["up"], xn, sparsity),
               "down": wanda_prune(weights["down"], hn, sparsity)}
    else:
        raise ValueError(f"unknown pruning method {method!r}")
    for n, w in new.items():
        getattr(mlp, n)[...] = jnp.asarray(w, getattr(mlp, n)[...].dtype)

