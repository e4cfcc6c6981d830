"""Layer-adaptive budgets: the allocation against brute force, the budget's arithmetic, and
`convert --active F` end to end on a tiny model (its budget met, its errors refused)."""
from __future__ import annotations

import itertools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cmoe_jax.carving.allocation import BudgetError, allocate
from cmoe_jax.methods.cmoe.budget import Budget
from cmoe_jax.methods.cmoe.plan import MoEPlan


def brute_force(damage, units, target):
    """Least summed damage over every choice of one shape per layer spending `target` units."""
    best = np.inf
    for choice in itertools.product(range(damage.shape[1]), repeat=damage.shape[0]):
        if sum(units[k] for k in choice) == target:
            best = min(best, sum(damage[i, k] for i, k in enumerate(choice)))
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(2, 4), st.integers(0, 2 ** 31 - 1), st.data())
def test_allocation_is_optimal_against_brute_force(layers, shapes, seed, data):
    rng = np.random.default_rng(seed)
    damage = rng.random((layers, shapes))
    units = np.sort(rng.choice(np.arange(1, 7), shapes, replace=False))
    target = data.draw(st.integers(int(units.min()) * layers, int(units.max()) * layers))
    expected = brute_force(damage, units, target)
    if not np.isfinite(expected):
        with pytest.raises(BudgetError):
            allocate(damage, units, target)
        return
    picked = allocate(damage, units, target)
    assert sum(units[k] for k in picked) == target
    assert sum(damage[i, k] for i, k in enumerate(picked)) == pytest.approx(expected, rel=1e-12)


def test_equal_sensitivities_give_the_uniform_shape():
    curve = np.array([0.9, 0.5, 0.3, 0.2, 0.12, 0.06, 0.02, 0.0])
    budget = Budget(0.375, 8)
    plans = budget.allocate(np.tile(curve, (6, 1)))
    assert plans == [MoEPlan(1, 2, 8)] * 6
    # a linear curve makes every allocation equally good: the uniform one is still chosen
    linear = np.tile(np.linspace(1, 0, 8), (5, 1))
    assert Budget(0.5, 8, spread=None).allocate(linear) == [MoEPlan(2, 2, 8)] * 5
    auto = Budget(0.5, 8)  # every band `--spread auto` tries allocates the uniform shape too
    assert all(auto.with_spread(s).allocate(linear) == [MoEPlan(2, 2, 8)] * 5 for s in auto.spreads())


def test_the_allocation_moves_neurons_to_the_sensitive_layer():
    curve = np.array([0.9, 0.5, 0.3, 0.2, 0.12, 0.06, 0.02, 0.0])
    damage = np.stack([curve, curve * 50, curve, curve])
    plans = Budget(0.25, 8).allocate(damage)
    shares = [(p.shared + p.active) / p.total if p else 1.0 for p in plans]
    assert np.mean(shares) == pytest.approx(0.25) and shares[1] > 0.25 > min(shares)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.sampled_from([0.25, 0.375, 0.5, 0.625, 0.75]), st.integers(0, 3),
       st.integers(0, 2 ** 31 - 1))
def test_a_spread_keeps_every_layer_near_the_budget(layers, share, spread, seed):
    """Against the unbounded allocation's optimum over the same allowed shapes (brute force)."""
    damage = np.sort(np.random.default_rng(seed).random((layers, 8)), axis=1)[:, ::-1]
    budget = Budget(share, 8, spread=spread)
    plans = budget.allocate(damage)
    k = np.array([p.shared + p.active if p else 8 for p in plans])
    assert k.sum() == round(share * 8 * layers) and np.all(np.abs(k - share * 8) <= spread)
    allowed = np.where(budget.allowed(), damage, np.inf)
    got = sum(damage[i, j - 1] for i, j in enumerate(k))
    assert got == pytest.approx(brute_force(allowed, np.arange(1, 9), k.sum()), rel=1e-12)


def test_the_defaults_follow_the_budget():
    """Below half active the marginal damage over 8 experts with any spread, from there the
    dense-stream loss damage over 16 experts in the band of least held-out loss (a streamed
    job: within a quarter of the FFN); a measure or expert count given takes its own spread."""
    assert (Budget(0.25).experts, Budget(0.25).measure_by, Budget(0.25).spread) == (8, "marginal", None)
    assert (Budget(0.75).experts, Budget(0.75).measure_by, Budget(0.75).spread) == (16, "loss", "auto")
    assert Budget(0.75, 8).spread == "auto" and Budget(0.25, measure_by="stream").spread == "auto"
    assert Budget(0.75).spreads() == [2, 3, 4, 5, 6] and Budget(0.75, 8).spreads() == [1, 2, 3]
    assert Budget(0.75).streamed().spread == 4 and Budget(0.75, spread=5).streamed().spread == 5
    assert Budget(0.75, spread=None).spread is None
    assert [p.name if p else "dense" for p in Budget(0.75).candidates()][-3:] == ["S7A7E16", "S7A8E16", "dense"]


@pytest.mark.parametrize("flags, expected", [
    (["--active", "0.75"], (16, "loss", "auto")),
    (["--active", "0.25"], (8, "marginal", None)),
    (["--active", "0.75", "--experts", "8"], (8, "loss", "auto")),
    (["--active", "0.75", "--spread", "any"], (16, "loss", None)),
    (["--active", "0.75", "--spread", "3"], (16, "loss", 3)),
])
def test_the_command_passes_the_defaults_on(flags, expected):
    """`convert --active F` leaves z, the measure and the spread to the budget's defaults
    unless given."""
    from cmoe_jax.convert.cli import parse_args
    from cmoe_jax.methods.cmoe.flags import budget_from_args

    b = budget_from_args(parse_args(["--model", "smollm2", "--out", "o", *flags]))
    assert (b.experts, b.measure_by, b.spread) == expected


def test_budget_arithmetic():
    b = Budget(0.25, 8)
    assert [p.name if p else "dense" for p in b.candidates()] == [
        "S0A1E8", "S1A1E8", "S1A2E8", "S2A2E8", "S2A3E8", "S3A3E8", "S3A4E8", "dense"]
    assert b.target_units(30) == 60 and b.uniform_index() == 1
    assert Budget(0.3, 8).uniform_index() is None and Budget(0.3, 8).target_units(30) == 72
    for bad in (Budget(0.3, 8), Budget(0.05, 8), Budget(1.5, 8)):
        with pytest.raises(BudgetError):
            bad.target_units(2)  # 0.3 of 16 units is 4.8: 5 units is 4% off; 0.05 < 1/8; 1.5 > 1


def _cli(path, text, out, *extra):
    return ["--model", str(path), "--data-path", str(text), "--calib-samples", "2", "--seqlen", "32",
            "--k-act", "4", "--no-progress", "--out", str(out), *extra]


@pytest.mark.parametrize("measure", ["marginal", "loss"])
def test_convert_meets_the_budget(tiny_checkpoint, tmp_path, capsys, measure):
    from cmoe_jax.convert.cli import main

    _, path, text = tiny_checkpoint
    out = tmp_path / "adaptive"
    assert main(_cli(path, text, out, "--active", "0.375", "--sensitivity", measure)) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    plan = manifest["plan"]
    assert len(plan) == 2 and set(plan[0]) >= {"shared", "active", "experts", "expert_width"}
    shares = [(p["shared"] + p["active"]) / p["experts"] for p in plan]
    assert abs(np.mean(shares) - 0.375) <= 0.01 * 0.375
    assert manifest["active_share"] == pytest.approx(np.mean(shares))
    assert np.asarray(manifest["budget"]["damage"]).shape == (2, 8) and manifest["budget"]["sensitivity"] == measure
    assert all(layer["error"] >= 0 for layer in manifest["layers"])
    err = capsys.readouterr().err
    assert "layer  shape" in err and manifest["layers"][1]["shape"] in err


def test_convert_keeps_layers_within_the_spread(tiny_checkpoint, tmp_path):
    from cmoe_jax.convert.cli import main

    _, path, text = tiny_checkpoint
    out = tmp_path / "spread"
    assert main(_cli(path, text, out, "--active", "0.375", "--spread", "1", "--sensitivity", "stream")) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    assert manifest["budget"]["spread"] == 1 and manifest["budget"]["sensitivity"] == "stream"
    k = [p["shared"] + p["active"] for p in manifest["plan"]]  # a kept dense layer: all shared
    assert sum(k) == 6 and all(abs(v - 3) <= 1 for v in k)


@pytest.mark.parametrize("extra, message", [
    (["--active", "0.25", "--config", "S1A1E8"], "give one of them"),
    (["--active", "0.25", "--shared", "1"], "give one of them"),
    (["--active", "0.05"], "cannot be met"),
    (["--active", "0.3"], "cannot be met"),  # 2 layers of 8 experts: 0.3125 is 4% off
    (["--active", "1.5"], "(0, 1]"),
    (["--config", "S1A1E8", "--sensitivity", "loss"], "give --active"),
    (["--config", "S1A1E8", "--spread", "2"], "give --active"),
    (["--active", "0.4375", "--spread", "0"], "widen --spread"),  # 3.5 experts: none within 0
    (["--active", "0.75", "--spread", "auto", "--stream"], "give --spread N"),
])
def test_bad_budgets_fail_before_any_work(tiny_checkpoint, tmp_path, capsys, extra, message):
    from cmoe_jax.convert.cli import main

    _, path, text = tiny_checkpoint
    out = tmp_path / "out"
    assert main(_cli(path, text, out, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and message in err[-1], err
    assert not out.exists() and not list(tmp_path.glob("out.partial*"))


def _nll(model, tokens) -> float:
    """Mean next-token NLL from the model's own forward (not the calibration pass)."""
    logits = np.asarray(model(jnp.asarray(tokens)), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return float(-np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1).mean())


def test_marginal_damage_is_each_layers_loss_drop_in_the_uniform_model(tiny_checkpoint):
    """The default measure, recomputed apart from its pass: `convert_model` to the budget's
    uniform shape, then each layer's dense FFN put back alone, the loss from the model's
    forward. The measured drop is that one (negative on a random model: carving can help it;
    g[l] e[l, uniform] is the drop floored), and e[l, uniform] the conversion's layer error.
    The rise is the loss with layer l alone carved one shape lower (converted on the same
    stream: the layers before it uniform), and the damage there is drop + rise."""
    from cmoe_jax.convert import ConvertConfig, convert_model
    from cmoe_jax.loading import load_model
    from cmoe_jax.methods.cmoe.sensitivity import Measured, measure_damage

    _, path, _ = tiny_checkpoint
    calib = np.random.default_rng(1).integers(0, 96, (2, 32)).astype(np.int32)
    budget = Budget(0.25, 8)
    u = budget.uniform_index()
    dense = load_model(str(path), progress=False, stack=False).model
    saved, saved_rises = [], []  # the drops and rises as the job saves them for a resume
    s = measure_damage(dense, calib, ConvertConfig(plan=None, k_act=4), budget,
                       measured=Measured(on_gain=lambda i, drop: saved.append(drop), progress=False,
                                         on_rise=lambda i, rise: saved_rises.append(rise)))
    assert budget.measure_by == "marginal" and s.errors.shape == (2, 8)
    uniform, records = convert_model(load_model(str(path), progress=False, stack=False).model, calib,
                                     ConvertConfig(plan=budget.candidates()[u], k_act=4), progress=False)
    np.testing.assert_allclose(s.errors[:, u], [r.error for r in records], rtol=1e-4)
    carved = _nll(uniform, calib)
    drops = []
    for i, layer in enumerate(uniform.layers):
        moe, layer.mlp = layer.mlp, dense.layers[i].mlp
        drops.append(carved - _nll(uniform, calib))
        layer.mlp = moe
    assert min(abs(d) for d in drops) > 1e-4, drops  # drops large enough to check
    np.testing.assert_allclose(saved, drops, atol=2e-5)
    np.testing.assert_allclose(s.gains * s.errors[:, u], np.maximum(saved, 1e-9), rtol=1e-9)
    rises = []
    for i, layer in enumerate(uniform.layers):
        shapes = [budget.candidates()[u - 1 if j == i else u] for j in range(len(uniform.layers))]
        lower, _ = convert_model(load_model(str(path), progress=False, stack=False).model, calib,
                                 ConvertConfig(plan=None, layer_plans=tuple(shapes), k_act=4), progress=False)
        moe, layer.mlp = layer.mlp, lower.layers[i].mlp
        rises.append(_nll(uniform, calib) - carved)
        layer.mlp = moe
    assert min(abs(r) for r in rises) > 1e-4, rises
    np.testing.assert_allclose(saved_rises, rises, atol=2e-5)
    np.testing.assert_allclose(s.rises, rises, atol=2e-5)
    np.testing.assert_allclose(s.damage()[:, u - 1], np.maximum(saved, 1e-9) + np.maximum(saved_rises, 1e-9), rtol=1e-9)
