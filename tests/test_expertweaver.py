"""ExpertWeaver: CV/alpha by hand, shared sizes, balanced K-means, centroid router, the
training-free k-of-N_e layer against a direct numpy recomputation, and the CLI job."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from cmoe_jax.methods.expertweaver.weave import (active_experts, balanced_kmeans, coefficient_of_variation,
                                           gate_profiles, router_centroids, shared_experts,
                                           shared_ratio, weave_layer)
from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.methods.expertweaver import WeaveConfig
from cmoe_jax.loading import load_model


def test_cv_and_alpha_hand_worked():
    # 3 neurons, tasks [0, 0, 1, 1]: per-task means (1, 1), (1, 3), (0, 2)
    profiles = np.array([[1, 1, 1, 1], [1, 1, 3, 3], [0, 0, 2, 2]], float)
    cv = coefficient_of_variation(profiles, [0, 0, 1, 1], eps=0.0)
    np.testing.assert_allclose(cv, [0.0, 1 / 2, 1 / 1])  # std (population) / mean
    r, alpha = shared_ratio(cv, tau=0.6, alpha_min=0.2, alpha_max=0.7)
    assert r == pytest.approx(1 / 3)
    assert alpha == pytest.approx(0.7 - 0.5 / 3)
    # d_ffn 48, 8 experts of 6: round(0.5333 * 48) = 26 neurons -> round(26 / 6) = 4 experts
    assert shared_experts(alpha, 48, 8) == 4
    assert shared_experts(0.7, 1536, 64) == 45  # SmolLM2: round(1075.2)=1075, /24 = 44.8
    assert active_experts(0.25, 64) == 48 and active_experts(0.25, 8) == 6


def test_gate_profiles_are_mean_abs_swish_per_sample():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 5, 4)), rng.normal(size=(4, 6))
    g = x @ w
    want = np.abs(g / (1 + np.exp(-g))).mean(axis=1).T
    np.testing.assert_allclose(np.asarray(gate_profiles(x, w, "silu")), want, rtol=1e-5)


@pytest.mark.parametrize("assignment", ["greedy", "exact"])
def test_balanced_kmeans_recovers_separated_groups(assignment):
    rng = np.random.default_rng(1)
    centers = np.array([[0, 0], [10, 0], [0, 10]], float)
    pts = np.concatenate([c + rng.normal(scale=0.3, size=(4, 2)) for c in centers])
    perm = rng.permutation(12)
    labels, _ = balanced_kmeans(pts[perm], 3, assignment=assignment, seed=0)
    assert np.bincount(labels).tolist() == [4, 4, 4]
    truth = np.repeat(np.arange(3), 4)[perm]
    for j in range(3):  # each cluster is one true group
        assert len(set(truth[labels == j])) == 1


def test_exact_assignment_cost_never_above_greedy():
    pts = np.random.default_rng(2).normal(size=(60, 5))

    def cost(labels):
        return sum(((pts[labels == j] - pts[labels == j].mean(0)) ** 2).sum() for j in range(6))

    costs = {a: cost(balanced_kmeans(pts, 6, assignment=a, seed=3, max_iters=1)[0]) for a in ("greedy", "exact")}
    assert costs["exact"] <= costs["greedy"] + 1e-9


def test_weave_layer_shared_sizes_and_partition():
    rng = np.random.default_rng(0)
    tasks = np.repeat(np.arange(4), 2)
    flat = rng.uniform(1.0, 1.1, size=(48, 8))  # CV ~ 0: alpha = alpha_max
    spiky = flat.copy()
    spiky[:24, tasks != 0] *= 0.01  # half the neurons fire for task 0 only: CV > tau
    for profiles, r in ((flat, 0.0), (spiky, 0.5)):
        w = weave_layer(profiles, tasks, WeaveConfig(experts=8, alpha_min=0.2, alpha_max=0.7, tau=0.6))
        alpha = 0.7 - 0.5 * r
        n_se = int(np.round(np.round(alpha * 48) / 6))
        assert w.cv_ratio == pytest.approx(r) and w.alpha == pytest.approx(alpha) and w.n_shared == n_se
        assert len(w.shared_idx) == n_se * 6 and w.expert_idx.shape == (8 - n_se, 6)
        ids = np.sort(np.concatenate([w.shared_idx, w.expert_idx.ravel()]))
        np.testing.assert_array_equal(ids, np.arange(48))
        top = np.sort(np.argsort(-profiles.mean(1), kind="stable")[:n_se * 6])
        np.testing.assert_array_equal(w.shared_idx, top)
    assert weave_layer(flat, tasks, WeaveConfig(experts=8, n_shared=2)).n_shared == 2
    assert weave_layer(flat, tasks, WeaveConfig(experts=8), max_shared=3).n_shared == 3  # capped at k - 1


def test_router_columns_are_gate_centroids():
    w = np.random.default_rng(0).normal(size=(4, 12)).astype(np.float32)
    experts = np.array([[0, 5, 7], [1, 2, 3], [4, 6, 8], [9, 10, 11]])
    r = router_centroids(w, experts)
    for i, row in enumerate(experts):
        np.testing.assert_allclose(r[:, i], w[:, row].mean(axis=1), rtol=1e-6)


# ---- the converted model -------------------------------------------------------------------

def _articles(path, n=4, words=400, seed=0):
    from tests.conftest import WORDS

    rng = np.random.default_rng(seed)
    lines = []
    for a in range(n):
        lines += ["", f" = w{a} title = ", ""]
        # each article draws from its own part of the vocabulary: tasks differ
        pool = WORDS[a * 20:(a + 1) * 20 + 10]
        body = [pool[i] for i in rng.integers(0, len(pool), words)]
        lines += [" " + " ".join(body[i:i + 20]) + " " for i in range(0, words, 20)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _cli(path, text, out, *extra):
    return ["--method", "expertweaver", "--model", str(path), "--data-path", str(text), "--experts", "8",
            "--calib-tasks", "4", "--samples-per-task", "2", "--seqlen", "32", "--out", str(out), *extra]


def _silu(a):
    return a / (1 + np.exp(-a))


def test_cli_weaves_and_layer_matches_direct_recomputation(tiny_checkpoint, tmp_path):
    _, path, _ = tiny_checkpoint
    text, out = _articles(tmp_path / "articles.txt"), tmp_path / "ew"
    assert convert_main(_cli(path, text, out, "--report")) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    assert manifest["method"] == "expertweaver" and len(manifest["calibration"]["tasks"]) == 4
    assert (out / "report" / "alpha_per_layer.png").exists()
    dense = load_model(str(path), progress=False).model
    moe = load_model(str(out), progress=False).model
    x = np.random.default_rng(0).normal(size=(10, 32)).astype(np.float32)
    k = active_experts(0.25, 8)
    for i, rec in enumerate(manifest["layers"]):
        d, ffn = dense.layers[i].mlp, moe.layers[i].mlp
        wg, wu, wd = (np.asarray(p[...], np.float64) for p in (d.gate, d.up, d.down))
        shared, experts = np.asarray(rec["shared"]), np.asarray(rec["experts"])
        assert len(shared) == rec["n_shared"] * 8 and ffn.top_k == k - rec["n_shared"]
        assert ffn.router == "topsum" and ffn.num_experts == 8 - rec["n_shared"]
        router = np.stack([wg[:, e].mean(1) for e in experts], 1)
        np.testing.assert_allclose(np.asarray(ffn.router_kernel[...]), router, rtol=1e-5, atol=1e-6)

        def part(ids, xx):
            return (_silu(xx @ wg[:, ids]) * (xx @ wu[:, ids])) @ wd[ids]

        want = []
        for t in x.astype(np.float64):
            top = np.argsort(-(t @ router))[:k - rec["n_shared"]]
            want.append(part(shared, t) + sum(part(experts[e], t) for e in top))
        np.testing.assert_allclose(np.asarray(ffn(jnp.asarray(x))), np.array(want), rtol=1e-4, atol=1e-5)


def test_all_experts_active_reproduces_dense(tiny_checkpoint, tmp_path):
    _, path, _ = tiny_checkpoint
    out = tmp_path / "ew"
    assert convert_main(_cli(path, _articles(tmp_path / "a.txt"), out, "--sparsity", "0")) == 0
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (1, 16)))
    dense = load_model(str(path), progress=False).model
    moe = load_model(str(out), progress=False).model
    np.testing.assert_allclose(np.asarray(moe(tokens)), np.asarray(dense(tokens)), atol=2e-4)


def test_shared_by_energy_picks_the_neurons_of_highest_output_energy(tiny_checkpoint):
    """`shared_by="energy"`: layer 0's shared neurons are those of largest mean
    h^2 * ||W_down row||^2, recomputed in numpy from the dense model's first FFN inputs."""
    from cmoe_jax.methods.expertweaver import WeaveConfig, weave_model

    _, path, _ = tiny_checkpoint
    dense = load_model(str(path), progress=False).model
    windows = np.random.default_rng(1).integers(0, 96, (8, 16)).astype(np.int32)
    tasks = np.repeat(np.arange(4), 2)
    _, by_energy = weave_model(dense, windows, tasks, WeaveConfig(experts=8, shared_by="energy"), progress=False)
    _, by_profile = weave_model(dense, windows, tasks, WeaveConfig(experts=8), progress=False)
    _, captured = dense(jnp.asarray(windows), capture_ffn_inputs=True)
    x = np.asarray(captured[0], np.float64).reshape(-1, 32)
    mlp = dense.layers[0].mlp
    wg, wu, wd = (np.asarray(w[...], np.float64) for w in (mlp.gate, mlp.up, mlp.down))
    energy = ((_silu(x @ wg) * (x @ wu)) ** 2).mean(axis=0) * (wd ** 2).sum(axis=1)
    shared = np.asarray(by_energy[0]["shared"])
    assert len(shared) > 0
    np.testing.assert_array_equal(shared, np.sort(np.argsort(-energy, kind="stable")[:len(shared)]))
    assert by_energy[0]["n_shared"] == by_profile[0]["n_shared"]
    assert not np.array_equal(shared, by_profile[0]["shared"])  # the rules differ on this model


@pytest.mark.parametrize("extra, message", [(["--shared-by", "rate"], "--shared-by rate"),
                                            (["--sparsity", "1.0"], "--sparsity"),
                                            (["--experts", "5"], "divide"),
                                            (["--alpha-min", "0.8"], "--alpha-min"),
                                            (["--config", "S1A1E8"], "--experts and --sparsity"),
                                            (["--active", "3"], "budget F in (0, 1)"),
                                            (["--active", "1.0"], "budget F in (0, 1)"),
                                            (["--active", "0.5", "--sparsity", "0.3"], "give one")])
def test_cli_rejects_bad_settings(tiny_checkpoint, tmp_path, capsys, extra, message):
    _, path, _ = tiny_checkpoint
    out = tmp_path / "out"
    assert convert_main(_cli(path, _articles(tmp_path / "a.txt"), out) + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err, err
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_a_budget_is_its_sparsity(tiny_checkpoint, tmp_path):
    """`--active F` (the budget flag CMoE allocates per layer) converts exactly as
    `--sparsity 1 - F`: the same layers, the same shapes."""
    _, path, _ = tiny_checkpoint
    data = _articles(tmp_path / "a.txt")
    for name, flags in (("budget", ["--active", "0.5"]), ("sparsity", ["--sparsity", "0.5"])):
        assert convert_main(_cli(path, data, tmp_path / name) + flags) == 0
    a, b = (json.loads((tmp_path / n / "cmoe_manifest.json").read_text()) for n in ("budget", "sparsity"))
    assert a["layers"] == b["layers"] and a["config"] == b["config"]
    assert a["active_share"] == a["active_experts"] / 8 == 0.5


def test_interrupted_weave_resumes_identically(tiny_checkpoint, tmp_path):
    from cmoe_jax.convert import TaskCalibration, WeaveConfig, WeaverSettings, convert

    _, path, _ = tiny_checkpoint
    cal = TaskCalibration(data_path=str(_articles(tmp_path / "a.txt")), tasks=4, samples_per_task=2, seqlen=32)
    cc = WeaverSettings(WeaveConfig(experts=8), cal)
    convert(str(path), cc, out=tmp_path / "full", progress=False)
    r = convert(str(path), cc, out=tmp_path / "res", stop_after_layers=1, progress=False)
    assert r["out"] is None and not (tmp_path / "res").exists()
    convert(str(path), cc, out=tmp_path / "res", resume=True, progress=False)
    a, b = (json.loads((tmp_path / n / "cmoe_manifest.json").read_text()) for n in ("full", "res"))
    assert a["layers"] == b["layers"]
