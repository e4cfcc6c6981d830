"""What else a token's skipped experts can be made up from, one SmolLM2 layer at a time:
held-out relative error of a carved FFN with each training-free compensation.

    python benchmarks/compensation_levers.py --config S3A3E8 --layers 3 15 27 [--json out.json]

Inputs: the dense SmolLM2's FFN inputs (dense stream) at each layer on `--calib-windows`
WikiText-2 validation windows (carving and every fit) and `--test-windows` test windows (the
error). Error: ||FFN(x) - FFN_dense(x)||^2 / ||FFN_dense(x)||^2 on the test tokens. Columns:
- `carved`: `carve_ffn` with `down_fit=0` (router score and gate scales fitted);
- `down r=R`: the down projections refitted by ridge least squares (`--down-fit R`);
- `+skip-bias`: the same fit with one more row per expert, a bias [d] added to a token's
  output when it skips that expert (FLAP's compensation, per expert);
- `+x-map rank k`: after the down fit, the rest regressed on the token itself, a rank-k
  linear map x A B (reduced-rank least squares): what a low-rank side path could add;
- `+router h`: the same fit with one more row per router neuron, its |h| as the router
  computes it (the representatives' normalised columns, every expert's): the routing's own
  activations as an always-on expert that costs only its down projection; `+router h
  skipped`: those rows fed only for the experts the token skips.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ffn_layer_error import dense_targets  # noqa: E402
from benchmarks.harness import WIKITEXT  # noqa: E402

RIDGES = (0.01, 0.1, 1.0)
RANKS = (16, 64)


def features(moe, x):
    """(P [T, H]: what the carved layer feeds its down projections, skip [T, E]: 1 where the
    token skips the expert, router h [T, E r]: the router's neurons' activations) on tokens
    x [T, d], float64."""
    import jax
    import jax.numpy as jnp

    from cmoe_jax.moe.routers import cmoe_route

    ids, gates = cmoe_route(jnp.asarray(x), moe.router_gate[...], moe.router_up[...], moe.u[...],
                            jnp.zeros(moe.num_experts), moe.top_k, activation="silu")
    weight = np.zeros((len(x), moe.num_experts))
    np.put_along_axis(weight, np.asarray(ids), np.asarray(gates), 1)
    act = lambda v: np.asarray(jax.nn.silu(v), np.float64)  # noqa: E731
    h = act(np.einsum("td,edm->tem", x, moe.expert_gate[...])) * np.einsum("td,edm->tem", x, moe.expert_up[...])
    hs = act(x @ moe.shared_gate[...]) * (x @ np.asarray(moe.shared_up[...]))
    hr = act(x @ np.asarray(moe.router_gate[...])) * (x @ np.asarray(moe.router_up[...]))
    return np.concatenate([hs, (weight[..., None] * h).reshape(len(x), -1)], 1), (weight == 0) * 1.0, hr


def ridge(a, y, w0, r):
    """argmin ||y - a W||^2 + lam ||W - w0||^2, lam = r times the mean diagonal of a^T a."""
    g = a.T @ a
    lam = r * np.mean(np.diag(g))
    return np.linalg.solve(g + lam * np.eye(len(g)), a.T @ y + lam * w0)


def reduced_rank(x, rest, rank):
    """A rank-`rank` map M minimising ||rest - x M||^2 (least squares, then the top right
    singular directions of its fit)."""
    m = np.linalg.lstsq(x, rest, rcond=None)[0]
    vt = np.linalg.svd(x @ m, full_matrices=False)[2][:rank]
    return m @ vt.T @ vt


def levers(mlp, x_fit, x_test, config: str) -> dict:
    import jax.numpy as jnp

    from cmoe_jax import carve_ffn

    w = [np.asarray(getattr(mlp, n)[...], np.float32) for n in ("gate", "up", "down")]
    dense = lambda t: np.asarray(mlp(jnp.asarray(t)), np.float64)  # noqa: E731
    moe = carve_ffn(*w, x_fit, config, activation="silu", down_fit=0.0)
    (p_fit, s_fit, r_fit), (p_test, s_test, r_test) = features(moe, x_fit), features(moe, x_test)
    y_fit, y_test = dense(x_fit), dense(x_test)
    w0 = np.concatenate([np.asarray(moe.shared_down[...]), np.asarray(moe.expert_down[...]).reshape(-1, w[2].shape[1])])
    err = lambda y: float(np.square(y - y_test).sum() / np.square(y_test).sum())  # noqa: E731
    out = {"carved": err(p_test @ w0)}
    for r in RIDGES:
        out[f"down r={r}"] = err(p_test @ ridge(p_fit, y_fit, w0, r))
    best = min(RIDGES, key=lambda r: out[f"down r={r}"])
    per_expert = r_fit.shape[1] // s_fit.shape[1]
    extra_rows = {  # name -> (fit, test) columns given down rows of their own, starting at 0
        "+skip-bias": (s_fit, s_test), "+router h": (r_fit, r_test),
        "+router h skipped": (r_fit * np.repeat(s_fit, per_expert, 1), r_test * np.repeat(s_test, per_expert, 1))}
    for name, (f_fit, f_test) in extra_rows.items():
        wr = ridge(np.concatenate([p_fit, f_fit], 1), y_fit, np.concatenate([w0, np.zeros((f_fit.shape[1], w0.shape[1]))]), best)
        out[f"{name} r={best}"] = err(np.concatenate([p_test, f_test], 1) @ wr)
    down = ridge(p_fit, y_fit, w0, best)
    xf, xt = np.asarray(x_fit, np.float64), np.asarray(x_test, np.float64)
    for k in RANKS:
        out[f"+x-map rank {k}"] = err(p_test @ down + xt @ reduced_rank(xf, y_fit - p_fit @ down, k))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="S3A3E8")
    p.add_argument("--layers", type=int, nargs="+", default=[3, 15, 27])
    p.add_argument("--calib-windows", type=int, default=3)
    p.add_argument("--test-windows", type=int, default=1)
    p.add_argument("--data-dir", type=Path, default=WIKITEXT)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from cmoe_jax.data import calibration_windows, eval_windows, load_text_tokens
    from cmoe_jax.loading import load_model

    lm = load_model("smollm2", progress=False)
    valid = load_text_tokens("wikitext2", lm.tokenizer, data_path=str(args.data_dir / "valid.txt"))
    test = load_text_tokens("wikitext2", lm.tokenizer, data_path=str(args.data_dir / "test.txt"))
    xs_fit, _ = dense_targets(lm.model, calibration_windows(valid, args.calib_windows, 2048, 0))
    xs_test, _ = dense_targets(lm.model, eval_windows(test, "wikitext2", 2048, args.test_windows))
    flat = lambda a: np.asarray(a, np.float32).reshape(-1, a.shape[-1])  # noqa: E731
    rows = []
    for layer in args.layers:
        out = levers(lm.model.layers[layer].mlp, flat(xs_fit[layer]), flat(xs_test[layer]), args.config)
        rows.append({"layer": layer, "config": args.config, **out})
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
