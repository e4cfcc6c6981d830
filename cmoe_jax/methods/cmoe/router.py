"""Analytical router: each routed expert is represented by its neuron(s) closest to the
cluster centroid; the router scores a token with those neurons' (normalised) gate and up
columns, summing |h| over an expert's r neurons, optionally rescaled per expert so that the
scores track the experts' output norms on the calibration tokens."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.sparse as sp

from cmoe_jax.carving.kmeans import cooccurrence
from cmoe_jax.moe.activations import glu_activation
from cmoe_jax.moe.routers import cmoe_choice, cmoe_scores
from cmoe_jax.moe.skip_term import skipped_activations


def representative_neurons(points: sp.csr_matrix, labels, centroid_counts, cluster_size: int,
                           per_cluster: int = 1) -> np.ndarray:
    """Per cluster j, the `per_cluster` member points closest (squared L2) to its centroid
    C_j / s, closest first.

    ||p_i - C_j/s||^2 = (s |p_i| - 2 p_i.C_j) / s + const_j, so the order is taken on the
    integer s|p_i| - 2 G_ij: exact, ties to the lowest point index. Returns point ids [k, r].
    """
    labels = np.asarray(labels)
    k = centroid_counts.shape[1]
    norms = np.asarray(points.sum(axis=1), np.int64).ravel()
    score = cluster_size * norms[:, None] - 2 * cooccurrence(points, centroid_counts)
    reps = np.empty((k, per_cluster), np.int64)
    for j in range(k):
        members = np.flatnonzero(labels == j)
        if len(members) < per_cluster:
            raise ValueError(f"cluster {j} has {len(members)} members, fewer than the "
                             f"{per_cluster} router neurons asked for")
        # stable sort: equal distances keep the lower point index first
        reps[j] = members[np.argsort(score[members, j], kind="stable")[:per_cluster]]
    return reps


def _unit_columns(w):
    if isinstance(w, np.ndarray):
        w32 = w.astype(np.float32)
        return (w32 / np.maximum(np.linalg.norm(w32, axis=0, keepdims=True), 1e-12)).astype(w.dtype)

    w32 = w.astype(jnp.float32)
    return (w32 / jnp.maximum(jnp.linalg.norm(w32, axis=0, keepdims=True), 1e-12)).astype(w.dtype)


def router_weights(w_gate, w_up, representative_idx, normalize: bool = True) -> tuple:
    """(router_gate [d, N_r*r], router_up [d, N_r*r]): the representative neurons' weight
    columns of W_gate, W_up [d, d_h] (ids [N_r, r], expert-major), each scaled to unit L2 norm
    (as for the profiling) unless normalize=False. Computed in float32, returned in the
    weights' dtype (numpy or jax)."""
    idx = np.asarray(representative_idx, np.int64).reshape(-1)
    gate, up = w_gate[:, idx], w_up[:, idx]
    if normalize:
        gate, up = _unit_columns(gate), _unit_columns(up)
    return gate, up


@functools.partial(jax.jit, static_argnames=("activation",))
def router_fit_sums(x, router_gate, router_up, expert_gate, expert_up, expert_down,
                    activation: str):
    """Per expert j, (sum_t s_tj y_tj, sum_t s_tj^2) over tokens x [..., d], float32.

    s_tj is the analytical router's score (`cmoe_scores`) and y_tj = ||E_j(x_t)||_2 the norm
    of expert j's output: the least-squares scale c_j = sum s y / sum s^2 makes c_j s_tj the
    best proportional estimate of what dropping expert j costs token t, so experts become
    comparable with each other (section 4.2 of the CMoE paper ranks experts by their
    contribution; one representative's |h| does not know its expert's size). `activation`:
    the experts' GLU activation (`cmoe_jax.moe.activations`).
    """
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    s = cmoe_scores(x, router_gate, router_up, expert_gate.shape[0], activation=activation)
    h = glu_activation(activation)(jnp.einsum("td,edm->tem", x, expert_gate)) * jnp.einsum("td,edm->tem", x, expert_up)
    y = jnp.linalg.norm(jnp.einsum("tem,emd->ted", h, expert_down), axis=-1)
    return (s * y).sum(0), (s * s).sum(0)


def scale_router_up(router_up, num, den, num_experts: int) -> tuple:
    """(scaled router_up [d, E*r] in its dtype, float64 scales c [E]): expert j's columns
    times c_j = num_j / den_j (1 where den_j = 0 or c_j <= 0).

    |act(a) * (b c)| = c |act(a) b| for c > 0, so the scale folds into the weights: the
    layer's router is unchanged in form and cost."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    c = np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)
    c = np.where(c > 0, c, 1.0)
    cols = np.repeat(c, router_up.shape[1] // num_experts).astype(np.float32)
    return (np.asarray(router_up, np.float32) * cols[None, :]).astype(router_up.dtype), c


@functools.partial(jax.jit, static_argnames=("top_k", "activation"))
def gate_fit_sums(x, router, experts, *, top_k: int, activation: str):
    """(A^T A [E, E], A^T r [E]) of the least-squares gate scales u over tokens x [..., d].

    The routed part of the layer is sum over the selected experts j of (1 + s'_j u_j) E_j(x);
    at u = 0 it misses r = sum of the unselected experts' outputs (the shared expert and the
    selected ones are exact, the carving being a split of the dense FFN). Column j of A is
    s'_j E_j(x) on the tokens that select j (0 elsewhere), so u = argmin ||r - A u||^2 is the
    gate scaling that best makes up, on the calibration tokens, for the experts left out.
    `router`: (router_gate, router_up, the layer's routing threshold or None); `experts`: the
    routed experts' (gate, up, down). Selection as the layer makes it at conversion
    (`cmoe_choice`, balancing bias 0).
    """
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    (router_gate, router_up, threshold), (expert_gate, expert_up, expert_down) = router, experts
    num_experts = expert_gate.shape[0]
    scores = cmoe_scores(x, router_gate, router_up, num_experts, activation=activation)
    probs = jax.nn.softmax(scores, axis=-1)
    zeros = jnp.zeros((num_experts,), jnp.float32)
    ids, _ = cmoe_choice(scores, zeros, zeros, top_k, threshold=threshold)
    chosen = jnp.zeros(probs.shape, bool).at[jnp.arange(x.shape[0])[:, None], ids].set(True, mode="drop")
    h = (glu_activation(activation)(jnp.einsum("td,edm->tem", x, expert_gate.astype(jnp.float32)))
         * jnp.einsum("td,edm->tem", x, expert_up.astype(jnp.float32)))
    out = jnp.einsum("tem,emd->ted", h, expert_down.astype(jnp.float32))     # [T, E, d]
    missing = jnp.where(chosen[..., None], 0.0, out).sum(1)                   # [T, d]
    a = jnp.where(chosen[..., None], probs[..., None] * out, 0.0)              # [T, E, d]
    return jnp.einsum("ted,tfd->ef", a, a), jnp.einsum("ted,td->e", a, missing)


@functools.partial(jax.jit, static_argnames=("num_experts", "activation"))
def score_sample(x, router_gate, router_up, num_experts: int | None = None, *, activation: str):
    """The router's scores `[T, E]` of tokens x [..., d] (`cmoe_scores`), what
    `routing_threshold` is taken over."""
    return cmoe_scores(x.reshape(-1, x.shape[-1]).astype(jnp.float32), router_gate, router_up,
                       num_experts, activation=activation)


def routing_threshold(scores, active: int) -> float:
    """The threshold with which the tokens of `scores [T, E]` run `active` experts each on
    average: the (T * active)-th largest score. A global cut rather than one per token, so
    the budget goes to the (token, expert) pairs the router rates highest."""
    flat = np.asarray(scores, np.float32).ravel()
    n = scores.shape[0] * active
    if n >= flat.size:
        return 0.0
    return float(np.partition(flat, flat.size - n)[flat.size - n])


def solve_gate_scales(ata, atr, ridge: float = 1e-6) -> np.ndarray:
    """u [E] float64 from the summed normal equations, with a ridge of `ridge` times the mean
    diagonal (an expert never selected on the calibration tokens keeps u = 0)."""
    ata, atr = np.asarray(ata, np.float64), np.asarray(atr, np.float64)
    used = np.diag(ata) > 0
    u = np.zeros(len(atr))
    if used.any():
        sub = ata[np.ix_(used, used)]
        lam = ridge * float(np.mean(np.diag(sub)))
        u[used] = np.linalg.solve(sub + lam * np.eye(int(used.sum())), atr[used])
    return u


@functools.partial(jax.jit, static_argnames=("top_k", "activation", "skip"))
def down_fit_sums(x, router, shared, experts, *, top_k: int, activation: str, skip: bool = False):
    """(P^T P [H, H], P^T y [H, d]) of the least-squares down projections over tokens x [..., d],
    H = S + E m the layer's neurons (shared first, then the experts' in order; with `skip`,
    then the E r router neurons' h of the experts each token skips, the rows of `skip_down`,
    `cmoe_jax.moe.skip_term`). `router`:
    (router_gate, router_up, u, threshold); `shared`: the shared MLP's (gate, up, down), S = 0
    allowed; `experts`: the routed experts' (gate, up, down).

    Row t of P holds what each neuron feeds the down projections in the converted layer: the
    shared neurons' h, and for a selected expert j its neurons' h times its gate g_j
    (`cmoe_choice`, with the fitted u), 0 for the experts the token skips; y_t is the dense
    FFN's output (the shared expert's plus every routed expert's, the carving being a split
    of the dense neurons). W = argmin ||y - P W||^2 is the set of down projections with which
    the neurons a token runs best make up, on the calibration tokens, for the ones it skips:
    a closed-form layer-wise reconstruction (`solve_down`). Selection with balancing bias 0.
    `routed_gram.routed_normal_equations` makes the same sums from `down_fit_columns`.
    """
    hs, gated, _, skipped, dense = down_fit_columns(x, router, shared, experts, top_k=top_k,
                                                    activation=activation, skip=skip)
    p = jnp.concatenate([hs, gated.reshape(hs.shape[0], -1), skipped], axis=1)   # [T, H]
    return symmetric_gram(p), p.T @ dense


@functools.partial(jax.jit, static_argnames=("top_k", "activation", "skip"))
def down_fit_columns(x, router, shared, experts, *, top_k: int, activation: str, skip: bool = False):
    """P's parts and y of `down_fit_sums` over tokens x [..., d]: (the shared neurons' h
    [T, S], the experts' gated h [T, E, m] (0 where skipped), the gates [T, E] (0: skipped),
    the skipped experts' router h [T, E r] ([T, 0] without `skip`), the dense output y [T, d])."""
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    act = glu_activation(activation)
    f32 = lambda w: w.astype(jnp.float32)  # noqa: E731
    (router_gate, router_up, u, threshold), (shared_gate, shared_up, shared_down) = router, shared
    expert_gate, expert_up, expert_down = experts
    n, num_experts = x.shape[0], expert_gate.shape[0]
    scores = cmoe_scores(x, router_gate, router_up, num_experts, activation=activation)
    ids, gates = cmoe_choice(scores, u, jnp.zeros((num_experts,), jnp.float32), top_k, threshold=threshold)
    weight = jnp.zeros((n, num_experts), jnp.float32).at[jnp.arange(n)[:, None], ids].set(gates, mode="drop")
    h = act(jnp.einsum("td,edm->tem", x, f32(expert_gate))) * jnp.einsum("td,edm->tem", x, f32(expert_up))
    hs = act(x @ f32(shared_gate)) * (x @ f32(shared_up))                     # [T, S]
    dense = hs @ f32(shared_down) + jnp.einsum("tem,emd->td", h, f32(expert_down))
    skipped = (skipped_activations(x, router_gate, router_up, ids, num_experts, activation=activation)
               if skip else jnp.zeros((n, 0), jnp.float32))
    return hs, weight[..., None] * h, weight, skipped, dense


def symmetric_gram(p, blocks: int = 4):
    """p.T @ p [H, H] from its upper triangle of `blocks` x `blocks` column blocks, each lower
    block the transpose of its mirror: (blocks + 1) / (2 blocks) of the multiply-adds (the
    down fit's Gram over 8,960 neurons is most of a 1.5B layer's fit), and exactly
    symmetric on every backend, which `solve_down` relies on."""
    edges = np.linspace(0, p.shape[1], blocks + 1).astype(int)
    cols = [p[:, a:b] for a, b in zip(edges[:-1], edges[1:])]
    upper = {(i, j): cols[i].T @ cols[j] for i in range(blocks) for j in range(i, blocks)}
    return jnp.block([[upper[i, j] if i <= j else upper[j, i].T for j in range(blocks)]
                      for i in range(blocks)])


def solve_down(ptp, pty, w0, ridge: float, *, overwrite: bool = False) -> np.ndarray:
    """W [H, d] float64 = argmin ||y - P W||^2 + lam ||W - W0||^2 from the summed normal
    equations, lam = `ridge` times the mean diagonal of P^T P: pulled towards the carved
    down projections W0 (the dense FFN's rows), so a neuron never run on the calibration
    tokens keeps its dense row and few tokens cannot overfit. Only the upper triangle of
    `ptp` is read (`routed_gram` makes only that). `overwrite`: ptp (float64) is solved in
    place, its [H, H] (0.6 GB at H = 8960) not copied."""
    ptp, pty = np.asarray(ptp, np.float64), np.asarray(pty, np.float64)
    w0 = np.asarray(w0, np.float64)
    lam = ridge * float(np.mean(np.diag(ptp)))
    if lam <= 0:
        return w0
    a = ptp if overwrite else ptp.copy()
    a[np.diag_indices_from(a)] += lam
    # a.T is the Fortran-ordered matrix LAPACK factors in place (given `a` itself, scipy
    # would first copy it into Fortran order); its lower triangle is a's upper one
    return scipy.linalg.solve(a.T, pty + lam * w0, assume_a="pos", lower=True, overwrite_a=True,
                              overwrite_b=True)
