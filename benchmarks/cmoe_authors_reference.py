"""The CMoE authors' conversion, in torch, on a `transformers` decoder of any family: the
reference side of the project's CMoE comparisons (docs/results/cmoe.md, gemma3.md).

Written from the description of JarvisPei/CMoE (`construct_moe`, `construct_experts_k_means`,
`analyze_neuron_activations`; not copied). Layer by layer, on the calibration windows as the
already-converted layers before it transform them:

1. the FFN input x (what the layer hands `self.mlp`), h = act(x_n W_g,n) * (x_n W_u,n) on
   L2-normalised tokens and weight rows; ATopK markers (top K_a of |h| per token) and rates;
2. shared experts: `torch.topk` of the rates (their tie order), x*m neurons;
3. routed experts: one balanced K-means step, L1 distances (`torch.cdist(p=1)`) to the
   initial centroids (the highest-rate remaining neurons), solved as the n x n linear
   assignment of repeated columns with `lap.lapjv`, then the centroid update;
4. router: per expert the member closest in L1 to its updated centroid; scores
   |act(x W_g^R) * (x W_u^R)| on unit-normed rows, softmax, top-k, gates 1 (u = b = 0).

The layer itself is the `transformers` one, so its norms around the FFN (Gemma's pre- and
post-feed-forward norms), its attention type and its rotary embeddings are the family's own:
only `layer.mlp` is replaced, by an `AuthorsMoE` using the dense MLP's own activation. Each
layer runs alone through the model's own forward (the stream given as `inputs_embeds`, every
other layer passing it through), its FFN input caught by a hook that stops the forward
there (the authors' `Catcher`).

    python benchmarks/cmoe_authors_reference.py --model gemma3-270m --config S3A3E8 \
        --sampler authors --max-windows 10

converts the `transformers` model reading the same file as `cmoe-jax` (float32, SDPA) on 8
calibration windows of 2048 tokens of WikiText-2 validation (`--sampler`: the authors'
`random.seed(0)` draws or the project's, no BOS: the authors' `get_wikitext2`) and prints the
perplexity on the first test windows as `cmoe-jax eval` builds them.

`convert(model, calib, ...)` returns per layer the FFN input it carved on and its carving;
`carve=` replaces the authors' carving (step 2-4's partition) by another, so a test can run
the project's partition through this pipeline.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class Carving:
    shared: np.ndarray           # int64 [S] neuron ids of the shared expert
    experts: np.ndarray          # int64 [N_r, m] neuron ids per routed expert
    representatives: np.ndarray  # int64 [N_r] the router's neuron per expert


def profile(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, act, k_act: int):
    """(markers [T, d_h] float 0/1, rates [d_h]) of FFN inputs x [..., d]; torch [out, in] weights."""
    xn = F.normalize(x.reshape(-1, x.shape[-1]).float(), p=2, dim=-1)
    h = act(xn @ F.normalize(gate_w.float(), p=2, dim=1).T) * (xn @ F.normalize(up_w.float(), p=2, dim=1).T)
    top = torch.topk(h.abs(), k_act, dim=-1).indices
    markers = torch.zeros_like(h).scatter_(1, top, 1.0)
    return markers, markers.mean(0)


def authors_carving(markers: torch.Tensor, rates: torch.Tensor, shared: int, total: int) -> Carving:
    """Shared-by-rate, one L1 K-means step solved by lapjv, centroid-closest representatives."""
    import lap

    d_h = rates.shape[0]
    m, k = d_h // total, total - shared
    shared_ids = torch.topk(rates, m * shared).indices.tolist() if shared else []
    rest = sorted(set(range(d_h)) - set(shared_ids))
    first = torch.topk(rates[rest], k).indices.tolist()
    points = markers[:, rest]                                   # [T, n]
    centroids = markers[:, [rest[i] for i in first]].clone()    # [T, k]
    dist = torch.cdist(points.T.contiguous(), centroids.T.contiguous(), p=1).double().numpy()
    col = lap.lapjv(np.repeat(dist, m, axis=1))[1]
    labels = np.asarray(col) // m
    groups, reps = [], []
    for j in range(k):
        members = np.flatnonzero(labels == j)
        centroids[:, j] = points[:, members].mean(1)
        d = torch.cdist(centroids[:, j:j + 1].T.contiguous(), points[:, members].T.contiguous(), p=1)
        reps.append(rest[members[int(torch.argmin(d))]])
        groups.append([rest[i] for i in members])
    return Carving(np.sort(np.asarray(shared_ids, np.int64)), np.sort(np.asarray(groups, np.int64), 1),
                   np.asarray(reps, np.int64))


class _MLP(nn.Module):
    def __init__(self, gate_w, up_w, down_w, act):
        super().__init__()
        self.gate, self.up, self.down, self.act = gate_w, up_w, down_w, act

    def forward(self, x):
        return (self.act(x @ self.gate.T) * (x @ self.up.T)) @ self.down.T


class AuthorsMoE(nn.Module):
    """Shared MLP + routed experts looped in Python + the representative-neuron router."""

    def __init__(self, mlp: nn.Module, carving: Carving, top_k: int):
        super().__init__()
        act, (g, u, d) = mlp.act_fn, (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        self.top_k, self.act = top_k, act
        s = torch.as_tensor(carving.shared)
        self.shared = _MLP(g[s], u[s], d[:, s], act) if len(s) else None
        self.experts = [_MLP(g[torch.as_tensor(e)], u[torch.as_tensor(e)], d[:, torch.as_tensor(e)], act)
                        for e in carving.experts]
        r = torch.as_tensor(carving.representatives)
        self.router_gate, self.router_up = F.normalize(g[r], p=2, dim=1), F.normalize(u[r], p=2, dim=1)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = (self.act(x @ self.router_gate.T) * (x @ self.router_up.T)).abs()
        ids = torch.topk(scores.softmax(-1, dtype=torch.float32), self.top_k, dim=-1).indices
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, _ = torch.where(ids == e)
            if len(rows):
                y = y.index_add(0, rows, expert(x[rows]))
        if self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(shape)


class _Caught(Exception):
    pass


class _PassThrough(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _run_layer(model, index: int, h: torch.Tensor, stop_at_ffn: bool = False) -> torch.Tensor:
    """Decoder layer `index` alone on the residual stream h [N, T, d], through the model's
    own forward (the mask and rotary tables of that layer's attention type; every other
    layer passes the stream through): the layer's output, or with `stop_at_ffn` the input
    its `mlp` receives."""
    seen = []

    def catch_ffn(_module, args):
        seen.append(args[0].detach())
        raise _Caught

    def catch_out(_module, _args, out):
        seen.append((out[0] if isinstance(out, tuple) else out).detach())
        raise _Caught

    layers = model.model.layers
    layer = layers[index]
    hook = (layer.mlp.register_forward_pre_hook(catch_ffn) if stop_at_ffn
            else layer.register_forward_hook(catch_out))
    model.model.layers = nn.ModuleList([layer if j == index else _PassThrough()
                                        for j in range(len(layers))])
    try:
        model.model(inputs_embeds=h)
    except _Caught:
        pass
    finally:
        hook.remove()
        model.model.layers = layers
    return seen[0]


@torch.no_grad()
def convert(model, calib: np.ndarray, shared: int, active: int, total: int, k_act: int = 10,
            carve=None, on_layer=None) -> list[dict]:
    """Convert the `transformers` causal LM `model` in place, layer by layer, on the
    calibration windows `calib` [N, T]. Returns per layer {"ffn_input": [N, T, d] numpy,
    "carving": Carving}. `carve(index, markers, rates) -> Carving` replaces the authors'
    carving (default: `authors_carving`); `on_layer(index)` is called after each layer (a
    timing run stops the conversion there by raising)."""
    h = model.model.embed_tokens(torch.as_tensor(np.asarray(calib), dtype=torch.long))
    out = []
    for i, layer in enumerate(model.model.layers):
        x = _run_layer(model, i, h, stop_at_ffn=True)
        mlp = layer.mlp
        markers, rates = profile(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.act_fn, k_act)
        carving = (carve(i, markers, rates) if carve is not None
                   else authors_carving(markers, rates, shared, total))
        layer.mlp = AuthorsMoE(mlp, carving, active)
        h = _run_layer(model, i, h)
        out.append({"ffn_input": x.numpy(), "carving": carving})
        if on_layer is not None:
            on_layer(i)
    return out


def calibration(valid, bos, variant: str, seqlen: int = 2048, n: int = 8, seed: int = 0):
    """The calibration windows of `variant`: the conversion's (`calibration_windows`), or the
    authors' draw (`authors-sampler`: `random.seed(seed)`, `random.randint(0, len - seqlen -
    1)` per window); a variant named `...calib-bos` opens each window with the family's `bos`
    (`--calib-bos`)."""
    from cmoe_jax.data import calibration_windows

    if variant == "authors-sampler":
        random.seed(seed)
        starts = [random.randint(0, len(valid) - seqlen - 1) for _ in range(n)]
        return np.stack([valid[s:s + seqlen] for s in starts]).astype(np.int32)
    return calibration_windows(valid, n, seqlen, seed, bos=bos if variant.endswith("calib-bos") else None)


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.harness import WIKITEXT
    from benchmarks.torch_reference import load_torch_causal_lm
    from cmoe_jax.data import load_text_tokens, text_windows
    from cmoe_jax.jobs.source import SourceModel
    from cmoe_jax.loading import window_bos
    from cmoe_jax.methods.cmoe import MoEPlan

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--config", default="S3A3E8")
    p.add_argument("--sampler", choices=["authors", "project"], default="authors")
    p.add_argument("--max-windows", type=int, default=10)
    p.add_argument("--data-dir", type=Path, default=WIKITEXT)
    args = p.parse_args(argv)
    source = SourceModel(args.model)
    tok = source.tokenizer
    valid = load_text_tokens("wikitext2", tok, "validation", args.data_dir / "valid.txt")
    test = load_text_tokens("wikitext2", tok, "test", args.data_dir / "test.txt")
    calib = calibration(valid, None, "authors-sampler" if args.sampler == "authors" else "defaults")
    windows = text_windows(test, 2048, args.max_windows, bos=window_bos(source.config, tok))
    model = load_torch_causal_lm(Path(source.path)).eval()
    plan = MoEPlan.parse(args.config)
    convert(model, calib, plan.shared, plan.active, plan.total)
    with torch.no_grad():
        nll = [float(model(ids, labels=ids).loss)
               for ids in (torch.tensor(w[None].astype("int64")) for w in windows)]
    print(f"{args.model} {args.config} authors' conversion ({args.sampler} sampler): "
          f"ppl {math.exp(sum(nll) / len(nll)):.4f} on {len(nll)} windows", flush=True)


if __name__ == "__main__":
    main()
