"""The fits on a converted layer's calibration inputs: the analytical router's per-expert
score scales, its routing threshold (threshold routing), the gate scales, then the down
projections, each a least-squares solve (or a quantile) from sums (scores) taken per window."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cmoe_jax import distributed
from cmoe_jax.methods.cmoe.routed_gram import routed_normal_equations
from cmoe_jax.methods.cmoe.router import (down_fit_columns, down_fit_sums, gate_fit_sums, router_fit_sums,
                                          routing_threshold, scale_router_up, score_sample, solve_down,
                                          solve_gate_scales)
from cmoe_jax.calibration_pass.layer_pass import replicate, window_chunks


@functools.partial(jax.jit, static_argnums=0, static_argnames=("top_k", "activation", "skip"))
def _per_window(sums, x, *weights, **static):
    """`sums(tokens, *weights)` of each window of x [N, T', d] -> its outputs, each [N, ...]."""
    fit = functools.partial(sums, **static)
    return jax.vmap(fit, in_axes=(0,) + (None,) * len(weights))(x, *weights)


def fit_sums(sums, ffn, x, tokens: int | None, mesh, names: tuple, host=None, **static) -> tuple:
    """The float64 totals of `sums` (`router_fit_sums`, `gate_fit_sums`, `down_fit_sums`) over
    an evenly strided subset of about `tokens` (None: all) of the layer's calibration inputs x [N, T, d]
    (kept sharded over the batch), so every device and process count sees the same tokens:
    taken per window, added in window order. `names`: the FFN's arrays `sums` takes after x
    (a tuple of names: one argument, a tuple of arrays). `host`: a numpy function that
    makes a window's sums from what `sums` returns for it (`sums` then gives the parts).

    The windows go one per local device at a time, so the per-window sums held at once are
    one per device (the down fit's are [d_h, d_h] each: 0.3 GB at d_h = 8960)."""
    stride = token_stride(x, tokens)
    weights = [replicate(_arrays(ffn, name), mesh) for name in names]
    total = None
    for chunk in window_chunks(x):
        part = _per_window(sums, chunk[:, ::stride], *weights, activation=ffn.activation, **static)
        if host is not None:
            part = _on_host(host, part)
        part = [distributed.gather_rows(np.asarray(s)) for s in part]
        if total is None:
            total = [np.zeros(s.shape[1:], np.float64) for s in part]
        for acc, windows in zip(total, part):
            for window in windows:  # added in place in window order: no float64 copy of a chunk
                np.add(acc, window, out=acc)
        del part
    return tuple(total)


def token_stride(x, tokens: int | None) -> int:
    """The stride through each window of x [N, T, d] (N local; the count is over every
    process) that leaves about `tokens` (None: all) of the calibration tokens to a fit."""
    n, t = x.shape[:2]
    n_all = int(distributed.sum_across_processes(np.int64(n)))
    return 1 if tokens is None else max(1, -(-n_all * t // tokens))


def _on_host(host, part) -> list:
    """`host` applied to each window of `part` (arrays [n, ...]), its outputs stacked [n, ...];
    each call's outputs are copied (or, for one window, handed on to be added up) before the
    next call, so `host` may return the same buffers each time."""
    arrays = [np.asarray(a) for a in part]
    n = arrays[0].shape[0]
    stacked = None
    for w in range(n):
        sums = host(*(a[w] for a in arrays))
        if n == 1:
            return [s[None] for s in sums]
        if stacked is None:
            stacked = [np.empty((n,) + s.shape, s.dtype) for s in sums]
        for into, s in zip(stacked, sums):
            into[w] = s
    return stacked


def _arrays(ffn, name: str | tuple):
    """`ffn`'s array `name` (a tuple of names: a tuple of arrays); a shared MLP of width 0
    has none: an empty one of its shape; a layer routed by top-k alone has no threshold: None."""
    if isinstance(name, tuple):
        return tuple(_arrays(ffn, n) for n in name)
    if name == "router_threshold" and not ffn.spec.threshold_routing:
        return None
    if name.startswith("shared_") and ffn.spec.shared_width == 0:
        d = ffn.expert_gate.shape[1]
        return jnp.zeros((0, d) if name == "shared_down" else (d, 0), jnp.float32)
    return getattr(ffn, name)[...]


_EXPERTS = ("expert_gate", "expert_up", "expert_down")
_SHARED = ("shared_gate", "shared_up", "shared_down")


def fit_router_scales(ffn, x, cc, mesh) -> np.ndarray:
    """Fold least-squares per-expert score scales into `ffn.router_up` (in place); returns them."""
    num, den = fit_sums(router_fit_sums, ffn, x, cc.router_fit_tokens, mesh, ("router_gate", "router_up") + _EXPERTS)
    up, scales = scale_router_up(np.asarray(ffn.router_up[...]), num, den, ffn.num_experts)
    ffn.router_up[...] = jnp.asarray(up)
    return scales


def fit_threshold(ffn, x, mesh, active: int) -> float:
    """Set `ffn.router_threshold` so that its calibration tokens x [N, T, d] run `active`
    routed experts each on average (`routing_threshold` over all of them); returns it."""
    weights = [replicate(ffn.router_gate[...], mesh), replicate(ffn.router_up[...], mesh)]
    scores = [distributed.gather_rows(np.asarray(score_sample(chunk, *weights, ffn.num_experts,
                                                              activation=ffn.activation)))
              for chunk in window_chunks(x)]
    threshold = routing_threshold(np.concatenate(scores), active)
    ffn.router_threshold[...] = jnp.full((1,), threshold, ffn.router_threshold[...].dtype)
    return threshold


def fit_gate_scales(ffn, x, cc, mesh) -> np.ndarray:
    """Set `ffn.u` to the least-squares gate scales (`gate_fit_sums`) on the same tokens as
    the router scales; returns them."""
    ata, atr = fit_sums(gate_fit_sums, ffn, x, cc.router_fit_tokens, mesh,
                        (("router_gate", "router_up", "router_threshold"), _EXPERTS), top_k=ffn.top_k)
    u = solve_gate_scales(ata, atr)
    ffn.u[...] = jnp.asarray(u, ffn.u[...].dtype)
    return u


def fit_down(ffn, x, cc, mesh) -> np.ndarray | None:
    """Replace the shared and routed down projections of `ffn` (in place) by the
    least-squares ones (`down_fit_sums`, `solve_down` with `cc.down_fit` as the ridge) on
    `cc.down_fit_tokens` of the layer's calibration inputs, with its router as fitted; a layer
    with `skip_compensation` gets its `skip_down` from the same solve (pulled towards 0).

    Returns the dense FFN's output on x [N, T, d] (float32, this process's windows), which
    the fit computes as its target, where it read every token on the host (None elsewhere):
    the layer's stream error then needs no second dense pass."""
    skip = ffn.spec.skip_compensation
    names = (("router_gate", "router_up", "u", "router_threshold"), _SHARED, _EXPERTS)
    targets = None
    if on_cpu(mesh):  # the routing's zeros skipped (`routed_gram`)
        targets = [] if token_stride(x, cc.down_fit_tokens) == 1 else None
        reuse = {}
        host = functools.partial(_routed_sums, offsets=_columns(ffn), targets=targets, reuse=reuse)
        ptp, pty = fit_sums(down_fit_columns, ffn, x, cc.down_fit_tokens, mesh, names, host=host,
                            top_k=ffn.top_k, skip=skip)
        reuse.clear()  # the window's buffer (0.3 GB at d_h 8,960) is not held through the solve
        if targets is not None:
            targets = np.stack(targets).reshape(x.shape[:2] + (-1,))
    else:
        ptp, pty = fit_sums(down_fit_sums, ffn, x, cc.down_fit_tokens, mesh, names, top_k=ffn.top_k, skip=skip)
    shared, (e, m, d) = np.asarray(_arrays(ffn, "shared_down"), np.float32), ffn.expert_down.shape
    s = shared.shape[0]
    rows = [shared, np.asarray(ffn.expert_down[...], np.float32).reshape(e * m, d)]
    if skip:
        rows.append(np.zeros(ffn.skip_down.shape, np.float32))
    w = solve_down(ptp, pty, np.concatenate(rows), cc.down_fit, overwrite=True)
    if s:
        ffn.shared_down[...] = jnp.asarray(w[:s], ffn.shared_down[...].dtype)
    ffn.expert_down[...] = jnp.asarray(w[s:s + e * m].reshape(e, m, d), ffn.expert_down[...].dtype)
    if skip:
        ffn.skip_down[...] = jnp.asarray(w[s + e * m:], ffn.skip_down[...].dtype)
    return targets


def on_cpu(mesh) -> bool:
    """Whether the calibration runs on the host CPU, where the down fit's Gram skips the
    routing's zeros (on an accelerator a dense product is faster than the gathers)."""
    return mesh.devices.flat[0].platform == "cpu"


def _columns(ffn) -> tuple:
    """(first routed column, H) of the down fit's P for `ffn` (`down_fit_sums`' layout)."""
    e, m, _ = ffn.expert_down.shape
    s = ffn.spec.shared_width
    return s, s + e * m + (ffn.skip_down.shape[0] if ffn.spec.skip_compensation else 0)


def _routed_sums(hs, gated, weight, skipped, y, *, offsets, targets: list | None, reuse: dict):
    """One window's (P^T P, P^T y) from `down_fit_columns`' parts (`routed_normal_equations`,
    into the buffers of the window before, kept in `reuse`); its target y appended to
    `targets` (a list) if given."""
    if targets is not None:
        targets.append(y)
    dense = [(0, hs)] if hs.shape[1] else []
    if skipped.shape[1]:  # the last columns
        dense.append((offsets[1] - skipped.shape[1], skipped))
    reuse["out"] = routed_normal_equations(dense, gated, weight, y, offsets, out=reuse.get("out"))
    return reuse["out"]


class LayerFits(NamedTuple):
    """What `fit_layer` fitted: per-expert score scales and gate scales (None: not fitted),
    and the dense FFN's output on the calibration inputs where the down fit made it for
    every token on the host (`fit_down`; None otherwise)."""

    router_scales: np.ndarray | None
    gate_scales: np.ndarray | None
    dense_output: np.ndarray | None = None


def fit_layer(ffn, x, cc, mesh, active: int | None = None) -> LayerFits:
    """The layer's fits on its calibration inputs x [N, T, d], as `cc` asks: the score scales
    (`fit_router_scales`), then on the router so scaled its threshold for `active` experts a
    token (`fit_threshold`, a layer with threshold routing), the gate scales
    (`fit_gate_scales`), then with the router as fitted the down projections (`fit_down`)."""
    scales = fit_router_scales(ffn, x, cc, mesh) if cc.router_scale else None
    if ffn.spec.threshold_routing:
        if active is None:
            raise ValueError("a layer with threshold routing needs the experts a token runs on average (active)")
        fit_threshold(ffn, x, mesh, active)
    gates = fit_gate_scales(ffn, x, cc, mesh) if cc.gate_fit else None
    dense = fit_down(ffn, x, cc, mesh) if cc.down_fit else None
    return LayerFits(scales, gates, dense)
