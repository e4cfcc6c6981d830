"""benchmarks/front.py's bookkeeping: a converted model kept on disk reads back as the model
it was converted to (so a speed cell timed later times the same model), no half-written
model is ever kept, and the table and plot take cells whose speed is not measured yet."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import front  # noqa: E402
from cmoe_jax.convert import ConvertConfig  # noqa: E402
from cmoe_jax.methods.cmoe import MoEPlan  # noqa: E402
from cmoe_jax.models import Decoder, ModelConfig  # noqa: E402

CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, activation="silu",
                  max_position_embeddings=64)


def tiny_front(out: Path) -> front.Front:
    sweep = object.__new__(front.Front)  # the model and windows set here, not loaded
    sweep.args = types.SimpleNamespace(out=out, model="tiny")
    sweep.lm = types.SimpleNamespace(model=Decoder(CFG, rngs=nnx.Rngs(0)), config=CFG, tokenizer=None)
    sweep.calib = np.random.default_rng(0).integers(0, 96, (4, 32)).astype(np.int32)
    return sweep


def test_a_kept_model_reads_back_as_converted(tmp_path):
    sweep = tiny_front(tmp_path)
    cc = ConvertConfig(plan=MoEPlan.parse("S1A1E8"), k_act=4)
    made, records = sweep.kept("uniform-0.25", cc)
    assert len(records) == CFG.num_layers
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["uniform-0.25"]  # no .partial left
    read, again = sweep.kept("uniform-0.25", cc)
    assert again is None  # read from disk, not converted again
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 16)), jnp.int32)
    np.testing.assert_allclose(np.asarray(read(tokens)), np.asarray(made(tokens)), rtol=1e-6, atol=1e-6)


def test_table_and_plot_take_cells_without_speed(tmp_path):
    cells = [dict(kind="dense", active_share=1.0, ppl=18.0, arc_acc=0.6),
             dict(kind="uniform", active_share=0.25, ppl=380.0, arc_acc=0.29, shapes=["S1A1E8"],
                  prefill_b1=1.2, prefill_b16=1.1, decode_b1=1.5, decode_b16=0.9, busy=True),
             dict(kind="adaptive", active_share=0.25, ppl=190.0, arc_acc=0.31, shapes=["dense", "S0A1E8"])]
    table = front.markdown(cells).splitlines()
    uniform = next(r for r in table if r.startswith("| uniform"))
    adaptive = next(r for r in table if r.startswith("| adaptive"))
    assert "1.50x (busy)" in uniform and adaptive.endswith("| - | - | - | - |")
    front.plot(cells, tmp_path / "front.png", "tiny")
    assert (tmp_path / "front.png").read_bytes()[:4] == b"\x89PNG"


def test_a_screen_alone_runs_no_budget(tmp_path):
    """`--screen` without `--budgets` screens only; the front's budgets need no flag."""
    out = ["--out", str(tmp_path / "f")]
    assert front.parse_args(out + ["--screen", "0.75:loss:4:16"]).budgets == []
    assert front.parse_args(out).budgets == list(front.BUDGETS)
    assert front.parse_args(out + ["--budgets", "0.5", "--screen", "0.75:loss:4"]).budgets == [0.5]
    assert front.parse_args(out + ["--budgets"]).budgets == []


def test_an_auto_band_is_chosen_once_and_kept(tmp_path, monkeypatch):
    """A budget of `--spread auto` takes the band of least held-out loss, kept in its cell so
    a resumed sweep converts no band again."""
    from cmoe_jax.methods.cmoe import spread_choice
    from cmoe_jax.methods.cmoe.budget import Budget

    sweep = tiny_front(tmp_path)
    sweep.args.resume, sweep.cells = True, tmp_path / "cells"
    sweep.held_out = np.random.default_rng(2).integers(0, 96, (2, 32)).astype(np.int32)
    budget = Budget(0.75, 8)
    cc = sweep.adaptive(budget)
    band = front.json.loads((sweep.cells / "band-0.75-E8.json").read_text())
    assert [t["spread"] for t in band["band_trials"]] == [1, 2, 3]
    assert band["spread_chosen"] == min(band["band_trials"], key=lambda t: (t["held_out_nll"], t["spread"]))["spread"]
    damage = sweep.sensitivity(budget).damage("loss")
    assert list(cc.layer_plans) == budget.with_spread(band["spread_chosen"]).allocate(damage)
    monkeypatch.setattr(spread_choice, "held_out_nll", lambda *a, **k: 1 / 0)
    assert sweep.adaptive(budget).layer_plans == cc.layer_plans


def test_the_summary_holds_every_saved_cell_with_its_speed(tmp_path):
    """A `--parts speed` run of one budget writes front.json and the plot of the whole front."""
    cells = {"dense": dict(kind="dense", active_share=1.0, ppl=18.0, arc_acc=0.6, machine="a"),
             "uniform-0.25": dict(kind="uniform", active_share=0.25, ppl=380.0, arc_acc=0.29, machine="a"),
             "speed-uniform-0.25": dict(prefill_b1=1.2, decode_b16=0.9, busy=False, machine="b"),
             "adaptive-0.75": dict(kind="adaptive", active_share=0.75, ppl=24.0, arc_acc=0.41),
             "damage-0.25-E8": dict(loss_rise=[0.1, 0.2]), "band-0.75-E16": dict(spread_chosen=6)}
    for name, cell in cells.items():
        front._save(tmp_path / f"{name}.json", cell)
    got = {c["kind"] + str(c["active_share"]): c for c in front.saved_front(tmp_path)}
    assert sorted(got) == ["adaptive0.75", "dense1.0", "uniform0.25"]
    assert got["uniform0.25"]["prefill_b1"] == 1.2 and got["uniform0.25"]["machine"] == "a"
    assert "prefill_b1" not in got["adaptive0.75"]
