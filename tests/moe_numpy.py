"""A per-token float64 numpy reference of `MoEFFN` (any width, expert count, top_k, router),
shared by the MoE layer's tests: each token's selected experts run one by one."""
import numpy as np
from flax import nnx


def silu(z):
    return z / (1.0 + np.exp(-z))


def softmax(z):
    z = np.exp(z - z.max())
    return z / z.sum()


def params(layer) -> dict:
    """The layer's state as float64 numpy arrays by name."""
    return {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(layer)).items()}


def logits(p, xt, router, num_experts):
    """One token's router logits (the `RouterOutput.logits` row)."""
    if router in ("linear", "topsum"):
        return xt @ p["router_kernel"]
    if router == "cmoe":
        h = np.abs(silu(xt @ p["router_gate"]) * (xt @ p["router_up"]))
        return h.reshape(num_experts, -1).sum(-1)
    return np.zeros(num_experts)


def forward(layer, x):
    """(y [T, d], loads [E], ids [T, k]) of `layer` on tokens `x [T, d]`, token by token (a
    pair that does not run, below a routing threshold: id E)."""
    p = params(layer)
    e, k = layer.num_experts, layer.top_k
    out = np.zeros(x.shape, np.float64)
    counts = np.zeros(e, np.int64)
    chosen = np.zeros((x.shape[0], k), np.int64)
    for t, xt in enumerate(np.asarray(x, np.float64)):
        probs = softmax(logits(p, xt, layer.router, e))
        if layer.router == "linear":
            sel = np.argsort(-probs, kind="stable")[:k]
            gates = probs[sel] / (probs[sel].sum() if layer.spec.norm_topk_prob else 1.0)
        elif layer.router == "cmoe":
            sel = np.argsort(-(probs + p["router_bias"]), kind="stable")[:k]
            if "router_threshold" in p:  # only the chosen experts whose score reaches it run
                sel = sel[logits(p, xt, "cmoe", e)[sel] >= p["router_threshold"][0]]
            gates = 1.0 + probs[sel] * p["u"][sel]
        elif layer.router == "topsum":
            sel = np.argsort(-(xt @ p["router_kernel"]), kind="stable")[:k]
            gates = np.ones(k)
        else:
            sel, gates = np.arange(e), np.ones(e)
        y = np.zeros(x.shape[1])
        if "shared_gate" in p:
            y += (silu(xt @ p["shared_gate"]) * (xt @ p["shared_up"])) @ p["shared_down"]
        for j, g in zip(sel, gates):
            y += g * ((silu(xt @ p["expert_gate"][j]) * (xt @ p["expert_up"][j])) @ p["expert_down"][j])
            counts[j] += 1
        if "skip_down" in p:  # each skipped expert's r router neurons' h through its skip_down rows
            h = (silu(xt @ p["router_gate"]) * (xt @ p["router_up"])).reshape(e, -1)
            rows = p["skip_down"].reshape(e, h.shape[1], -1)
            y += sum(h[j] @ rows[j] for j in range(e) if j not in sel)
        out[t], chosen[t] = y, np.pad(sel, (0, k - len(sel)), constant_values=e)
    return out, counts, chosen
