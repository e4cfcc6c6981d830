"""ConMoE compression (`cmoe_jax.compress`) on tiny random Qwen3-MoE and Mixtral models:
the prototype runtime against the copied checkpoint, statistics, scores, distances,
mapping and the four baselines against direct numpy computations."""
from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.methods.conmoe import apply_plans, baseline_plans, collect_stats, conmoe_plans, materialize, routed_bytes
from cmoe_jax.methods.conmoe import baselines, scoring
from cmoe_jax.loading import load_model
from cmoe_jax.moe import MoEFFN

CALIB = np.random.default_rng(0).integers(0, 96, (2, 32)).astype(np.int32)
TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 16)).astype(np.int32))


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    """(model, calibration statistics), built once per family for the module."""
    from tests.conftest import tiny_hf_model

    path = tmp_path_factory.mktemp(request.param)
    tiny_hf_model(request.param, num_hidden_layers=4).save_pretrained(path)
    model = load_model(str(path), progress=False).model
    return model, collect_stats(model, CALIB, progress=False)


def np_swiglu(x, wg, wu, wd):
    g = x @ wg
    return (g / (1 + np.exp(-g)) * (x @ wu)) @ wd


@pytest.mark.parametrize("scope,selection", [(1, "adaptive"), (2, "adaptive"), (4, "fixed"), (2, "usage")])
def test_prototype_runtime_equals_copied_checkpoint(moe, scope, selection):
    model, stats = moe
    plans, _ = conmoe_plans(model, stats, 0.5, scope, selection)
    runtime, copied = apply_plans(model, plans), materialize(model, plans)
    np.testing.assert_allclose(np.asarray(runtime(TOKENS)), np.asarray(copied(TOKENS)), atol=2e-5)
    # a scope's table is stored once: K prototypes of the 4 * 4 experts
    k = sum(p.num_prototypes for p in plans)
    assert k == (8 if selection != "fixed" else 8)
    assert routed_bytes(runtime) * 16 == routed_bytes(model) * k
    if scope > 1:
        assert runtime.layers[1].mlp.expert_gate is runtime.layers[0].mlp.expert_gate


def test_merging_runtime_equals_copied_checkpoint(moe):
    model, stats = moe
    for method in ("msmoe", "hcsmoe"):
        plans = baseline_plans(method, stats, 0.5, model)
        np.testing.assert_allclose(np.asarray(apply_plans(model, plans)(TOKENS)),
                                   np.asarray(materialize(model, plans)(TOKENS)), atol=2e-5)


def assert_stats_match(model, stats, outputs):
    """Layer 0's freq, a_e, mean outputs and router-logit Gram against a per-token loop over
    its captured FFN input (linear top-2 router); `outputs(mlp, x)` gives each expert's (or
    family's) output `[T, E, d]`. Layer 0's input is the original model's in every variant."""
    _, captured = model(jnp.asarray(CALIB), capture_ffn_inputs=True)
    x = np.asarray(captured[0], np.float64).reshape(-1, 32)
    mlp = model.layers[0].mlp
    logits = x @ np.asarray(mlp.router_kernel[...], np.float64)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    top = np.argsort(-probs, axis=1)[:, :2]
    gates = np.take_along_axis(probs, top, 1)
    if mlp.spec.norm_topk_prob:
        gates /= gates.sum(1, keepdims=True)
    outs = outputs(mlp, x)
    freq, contrib = np.zeros(4), np.zeros(4)
    for t in range(len(x)):
        for j in range(2):
            e = top[t, j]
            freq[e] += 1
            contrib[e] += gates[t, j] * np.linalg.norm(outs[t, e])
    st = stats[0]
    np.testing.assert_array_equal(st.freq, freq)
    np.testing.assert_allclose(st.contrib, contrib / np.maximum(freq, 1), rtol=1e-4)
    np.testing.assert_allclose(st.mean_out, outs.mean(0), rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(st.logit_gram, logits.T @ logits, rtol=1e-4)


def test_calibration_statistics_against_numpy(moe):
    def outputs(mlp, x):
        ws = [np.asarray(getattr(mlp, n)[...], np.float64) for n in ("expert_gate", "expert_up", "expert_down")]
        return np.stack([np_swiglu(x, ws[0][e], ws[1][e], ws[2][e]) for e in range(4)], 1)

    assert_stats_match(*moe, outputs)


def test_scores_distances_selection_and_mapping_against_numpy(moe):
    model, stats = moe
    plans, figures = conmoe_plans(model, stats, 0.25, 2)
    plan = plans[0]
    mlps = [model.layers[l].mlp for l in (0, 1)]
    experts = [[np.asarray(getattr(m, n)[...], np.float64)[e] for n in ("expert_gate", "expert_up", "expert_down")]
               for m in mlps for e in range(4)]
    n = len(experts)
    dist = np.zeros((n, n))
    for i, j in itertools.product(range(n), range(n)):
        if i != j:
            dist[i, j] = np.mean([2 * np.linalg.norm(a - b) / (np.linalg.norm(a) + np.linalg.norm(b) + 2e-8)
                                  for a, b in zip(experts[i], experts[j])])
    b = np.array([min(dist[i, j] for j in range(n) if j != i) for i in range(n)])
    a = np.concatenate([stats[0].contrib, stats[1].contrib])
    mm = lambda v: (v - v.min()) / (v.max() - v.min() + 1e-8)
    s = mm(a) * mm(b)
    np.testing.assert_allclose(plan.info["b"], b, rtol=1e-6)
    np.testing.assert_allclose(plan.info["score"], s, rtol=1e-6, atol=1e-9)
    k = 6  # round(0.75 * 8)
    protos = sorted(np.argsort(-s, kind="stable")[:k].tolist())
    assert plan.info["prototypes"] == protos
    for i in range(n):  # nearest prototype (a prototype keeps itself)
        want = protos.index(i) if i in protos else int(np.argmin([dist[i, p] for p in protos]))
        assert plan.slot_maps[(0, 1)[i // 4]][i % 4] == want
    layer_of = np.repeat([0, 1], 4)
    nn_other = [layer_of[np.argmin(np.where(np.eye(n, dtype=bool)[i], np.inf, dist[i]))] != layer_of[i]
                for i in range(n)]
    assert abs(scoring.cross_layer_fraction(dist, layer_of) - np.mean(nn_other)) < 1e-12
    assert 0.0 <= figures["cross_layer_nn_fraction"] <= 1.0


def merged_gates(protos, gates, rule):
    """{prototype: gate} of one token's chosen (prototype, gate) pairs under a duplicate rule."""
    out = {}
    for p, g in zip(protos, gates):
        if p >= 0:
            out[p] = out.get(p, 0.0) + g if rule == "sum" else max(out.get(p, -np.inf), g)
    if rule == "renorm" and out:
        total = sum(g for p, g in zip(protos, gates) if p >= 0)
        out = {p: g * total / sum(out.values()) for p, g in out.items()}
    return out


@pytest.mark.parametrize("router,rule", [("cmoe", "sum"), ("linear", "sum"), ("cmoe", "max"),
                                         ("linear", "max"), ("cmoe", "renorm"), ("linear", "renorm")])
def test_pruned_and_shared_slots_against_numpy(router, rule):
    """A prototype layer with a pruned slot (-1) and two slots sharing a prototype, against
    the direct formula: masked router, top-k, gates merged per prototype by the duplicate
    rule, sum of g * prototype(x)."""
    layer = MoEFFN(d_model=16, expert_width=8, num_experts=5, top_k=3, shared_width=8, router=router, norm_topk_prob=router == "linear",
                   router_neurons=2, num_prototypes=3, duplicate_gates=rule, activation="silu", rngs=nnx.Rngs(3))
    slot_map = np.array([2, -1, 0, 2, 1], np.int32)
    layer.slot_map[...] = jnp.asarray(slot_map)
    if router == "cmoe":
        layer.u[...] = jnp.linspace(-1, 1, 5)
        layer.router_bias[...] = jnp.array([0.0, 0.5, 0.0, 0.01, 0.0])
    x = np.random.default_rng(4).normal(size=(12, 16))
    w = {n: np.asarray(getattr(layer, n)[...], np.float64) for n in
         ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down")}
    keep = slot_map >= 0
    if router == "cmoe":
        h = np.abs(np_silu_mul(x, np.asarray(layer.router_gate[...]), np.asarray(layer.router_up[...])))
        scores = np.where(keep, h.reshape(12, 5, 2).sum(-1), -np.inf)
        probs = np.exp(scores - scores.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        key = np.where(keep, probs + np.asarray(layer.router_bias[...]), -np.inf)
        ids = np.argsort(-key, axis=1)[:, :3]
        gates = 1 + np.take_along_axis(probs, ids, 1) * np.asarray(layer.u[...])[ids]
    else:
        logits = np.where(keep, x @ np.asarray(layer.router_kernel[...]), -np.inf)
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        ids = np.argsort(-probs, axis=1)[:, :3]
        gates = np.take_along_axis(probs, ids, 1)
        gates /= gates.sum(1, keepdims=True)
    want = np_swiglu(x, w["shared_gate"], w["shared_up"], w["shared_down"])
    shared_tokens = 0
    for t in range(12):
        protos = slot_map[ids[t]]
        shared_tokens += len(set(protos[protos >= 0])) < (protos >= 0).sum()
        for p, g in merged_gates(protos, gates[t], rule).items():
            want[t] += g * np_swiglu(x[t], w["expert_gate"][p], w["expert_up"][p], w["expert_down"][p])
    assert shared_tokens > 0  # some token chose two slots of one prototype: the rule matters
    got, counts = layer(jnp.asarray(x, jnp.float32), return_load=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    assert counts.shape == (5,) and int(counts[1]) == 0


def test_output_distance_against_numpy(moe):
    """`distance="outputs"`: d between the experts' mean outputs, normalised like the weight
    distance (2 ||m_i - m_j|| / (||m_i|| + ||m_j||)); b_e its nearest other expert."""
    model, stats = moe
    plans, _ = conmoe_plans(model, stats, 0.5, 2, distance="outputs")
    for plan in plans:
        m = np.concatenate([stats[l].mean_out for l in plan.layers]).astype(np.float64)
        n = len(m)
        d = np.array([[0.0 if i == j else 2 * np.linalg.norm(m[i] - m[j]) /
                       (np.linalg.norm(m[i]) + np.linalg.norm(m[j]) + 2 * scoring.EPS)
                       for j in range(n)] for i in range(n)])
        b = np.array([min(d[i, j] for j in range(n) if j != i) for i in range(n)])
        np.testing.assert_allclose(plan.info["b"], b, rtol=1e-6, atol=1e-9)
        for slot_map_layer, l in enumerate(plan.layers):  # every slot points at its nearest prototype
            protos = np.asarray(plan.info["prototypes"])
            for e, p in enumerate(plan.slot_maps[l]):
                unit = slot_map_layer * len(stats[l].freq) + e
                assert d[unit, protos[p]] == pytest.approx(d[unit, protos].min())
    weights, _ = conmoe_plans(model, stats, 0.5, 2)
    assert [p.info["b"] for p in plans] != [p.info["b"] for p in weights]


def np_silu_mul(x, wg, wu):
    g = x @ wg
    return g / (1 + np.exp(-g)) * (x @ wu)


def test_pruning_baselines_keep_the_top_experts(moe):
    model, stats = moe
    for method, key in (("frequency", "freq"), ("reap", "contrib")):
        plans = baseline_plans(method, stats, 0.5)
        for plan in plans:
            score = getattr(stats[plan.layers[0]], key).astype(float)
            kept = sorted(np.argsort(-score, kind="stable")[:2].tolist())
            slots = plan.slot_maps[plan.layers[0]]
            assert sorted(np.flatnonzero(slots >= 0).tolist()) == kept
        out = np.asarray(apply_plans(model, plans)(TOKENS))
        assert np.isfinite(out).all()


def test_msmoe_groups_and_merged_weights_against_numpy(moe):
    """Groups by router-logit cosine to the most used experts; each merged expert is the
    usage-weighted average of its members, every member's neurons in its recorded order."""
    model, stats = moe
    st = stats[1]
    plan = baseline_plans("msmoe", stats, 0.5, model)[1]
    cores = sorted(np.argsort(-st.freq.astype(float), kind="stable")[:2].tolist())
    g = st.logit_gram
    cos = g / np.sqrt(np.outer(np.diag(g), np.diag(g)))
    groups = [cores.index(e) if e in cores else int(np.argmax(cos[e, cores])) for e in range(4)]
    assert plan.slot_maps[1].tolist() == groups
    assert sorted(plan.perms) == [e for e in range(4) if e not in cores]  # dominant ones stay put
    runtime = apply_plans(model, [plan])
    mlp = model.layers[1].mlp
    wg, wd = (np.asarray(w[...], np.float64) for w in (mlp.expert_gate, mlp.expert_down))
    order = {e: plan.perms.get(e, np.arange(wg.shape[-1])) for e in range(4)}
    for c in range(2):
        members = [e for e in range(4) if groups[e] == c]
        f = st.freq[members].astype(float) / st.freq[members].sum()
        want_g = sum(fi * wg[e][:, order[e]] for fi, e in zip(f, members))
        want_d = sum(fi * wd[e][order[e]] for fi, e in zip(f, members))
        np.testing.assert_allclose(np.asarray(runtime.layers[1].mlp.expert_gate[...])[c], want_g, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(runtime.layers[1].mlp.expert_down[...])[c], want_d,
                                   rtol=1e-5, atol=1e-7)


def test_neuron_alignment_against_brute_force():
    """The weight-matching permutation maximises the matched inner products over all 5!
    orders, and undoes a permutation of a noisy copy."""
    rng = np.random.default_rng(3)
    anchor = [rng.normal(size=(6, 5)), rng.normal(size=(6, 5)), rng.normal(size=(5, 6))]
    member = [rng.normal(size=(6, 5)), rng.normal(size=(6, 5)), rng.normal(size=(5, 6))]

    def score(perm):
        return sum(np.sum(anchor[i] * member[i][:, perm]) for i in (0, 1)) + np.sum(anchor[2] * member[2][perm])

    best = max(itertools.permutations(range(5)), key=lambda p: score(list(p)))
    assert baselines.align_neurons(anchor, member).tolist() == list(best)
    shuffle = rng.permutation(5)
    noisy = [anchor[0][:, shuffle] + 0.01 * rng.normal(size=(6, 5)),
             anchor[1][:, shuffle] + 0.01 * rng.normal(size=(6, 5)), anchor[2][shuffle]]
    perm = baselines.align_neurons(anchor, noisy)
    np.testing.assert_array_equal(shuffle[perm], np.arange(5))


def test_msmoe_merges_permuted_copies_back_into_the_original(moe):
    """Experts that are neuron-permuted copies of one another compute the same function; the
    aligned merge returns that function, while a plain average of the weights would not."""
    model, stats = moe
    before = np.asarray(model.layers[1].mlp.expert_gate[...]).copy()
    copies = nnx.clone(model).unstacked()  # one module per layer: layer 1 is changed below
    mlp = copies.layers[1].mlp
    rng = np.random.default_rng(4)
    gate, up, down = (np.array(w[...]) for w in (mlp.expert_gate, mlp.expert_up, mlp.expert_down))
    for e in range(1, 4):
        perm = rng.permutation(gate.shape[-1])
        gate[e], up[e], down[e] = gate[0][:, perm], up[0][:, perm], down[0][perm]
    mlp.expert_gate[...], mlp.expert_up[...], mlp.expert_down[...] = gate, up, down
    plan = baseline_plans("msmoe", stats, 0.5, copies)[1]
    merged = apply_plans(copies, [plan])
    np.testing.assert_allclose(np.asarray(merged(TOKENS)), np.asarray(copies(TOKENS)), atol=2e-5)
    with pytest.raises(ValueError, match="pass the model"):
        baseline_plans("msmoe", stats, 0.5)
    np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.expert_gate[...]), before)  # fixture intact


def average_linkage(points, k):
    """Brute-force agglomerative clustering, average linkage, Euclidean: lists of members."""
    clusters = [[i] for i in range(len(points))]
    d = lambda a, b: np.mean([np.linalg.norm(points[i] - points[j]) for i in a for j in b])
    while len(clusters) > k:
        i, j = min(itertools.combinations(range(len(clusters)), 2),
                   key=lambda ij: d(clusters[ij[0]], clusters[ij[1]]))
        clusters[i] = clusters[i] + clusters.pop(j)
    return sorted(sorted(c) for c in clusters)


def test_hcsmoe_clusters_against_brute_force():
    points = np.random.default_rng(5).normal(size=(8, 6))
    for k in (2, 3, 5):
        groups = baselines.hcsmoe_groups(points, k)
        got = sorted(sorted(np.flatnonzero(groups == g).tolist()) for g in range(groups.max() + 1))
        assert got == average_linkage(points, k)


def test_ratio_zero_keeps_every_expert(moe):
    model, stats = moe
    plans, _ = conmoe_plans(model, stats, 0.0, 2)
    for plan in plans:  # every expert is a prototype and its slot keeps it
        for j, l in enumerate(plan.layers):
            assert plan.slot_maps[l].tolist() == list(range(4 * j, 4 * j + 4))
    np.testing.assert_allclose(np.asarray(apply_plans(model, plans)(TOKENS)), np.asarray(model(TOKENS)),
                               atol=2e-5)
