"""`--spread auto`: the band chosen on windows no calibration window touches, each band's
held-out loss recomputed from the model's own forward, a resume that converts only the bands
not yet tried, and the refusals."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmoe_jax.data import Calibration, calibration_windows, held_out_windows
from cmoe_jax.loading import load_model
from cmoe_jax.methods.cmoe import spread_choice
from cmoe_jax.methods.cmoe.budget import Budget
from cmoe_jax.methods.cmoe.config import ConvertConfig
from cmoe_jax.methods.cmoe.convert import convert_model
from cmoe_jax.methods.cmoe.job import ConvertSettings
from cmoe_jax.methods.cmoe.plan import MoEPlan
from test_budget import _cli, _nll


@settings(max_examples=60, deadline=None)
@given(st.integers(40, 400), st.integers(1, 6), st.integers(4, 40), st.integers(0, 2 ** 31 - 1),
       st.integers(1, 9))
def test_held_out_windows_touch_no_calibration_window(n, samples, seqlen, seed, limit):
    """With tokens 0..n-1 a window shows where it starts: every held-out window is an aligned
    stretch that overlaps no calibration window, and they are the first `limit` of those."""
    tokens = np.arange(n)
    if n <= seqlen:
        return
    starts = calibration_windows(tokens, samples, seqlen, seed)[:, 0]
    held = held_out_windows(tokens, samples, seqlen, seed, limit)
    free = [a for a in range(0, n - seqlen + 1, seqlen) if all(abs(a - c) >= seqlen for c in starts)]
    assert [int(w[0]) for w in held] == free[:limit]
    for w in held:
        np.testing.assert_array_equal(w, np.arange(w[0], w[0] + seqlen))


def _plans(names):
    return [None if n == "dense" else MoEPlan.parse(n) for n in names]


def test_auto_keeps_the_band_of_least_held_out_loss(tiny_checkpoint, tmp_path, capsys):
    """The default band choice with the loss damage: every band's recorded loss is its
    allocation converted on the calibration windows and run on the held-out ones through the
    model's own forward, and the model saved is the least one's."""
    from cmoe_jax.convert.cli import main
    from cmoe_jax.loading import load_tokenizer

    _, path, text = tiny_checkpoint
    out = tmp_path / "auto"
    assert main(_cli(path, text, out, "--active", "0.375", "--sensitivity", "loss")) == 0
    budget = json.loads((out / "cmoe_manifest.json").read_text())["budget"]
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    trials = budget["band_trials"]
    assert budget["spread"] == "auto" and [t["spread"] for t in trials] == [1, 2, 3]
    cal = Calibration(data_path=str(text), samples=2, seqlen=32)
    tokens = cal.tokens(load_tokenizer(str(path)))
    calib, held = cal.windows(tokens, 0), cal.held_out(tokens, 0, spread_choice.HELD_OUT_WINDOWS)
    assert len(held) == spread_choice.HELD_OUT_WINDOWS
    for t in trials:
        method = ConvertConfig(plan=None, layer_plans=tuple(_plans(t["shapes"])), k_act=4)
        moe, _ = convert_model(load_model(str(path), progress=False, stack=False).model, calib, method,
                               progress=False)
        assert t["held_out_nll"] == pytest.approx(_nll(moe, held), rel=1e-4)
    best = min(trials, key=lambda t: (t["held_out_nll"], t["spread"]))
    assert budget["spread_chosen"] == best["spread"]
    assert [layer["shape"] for layer in manifest["layers"]] == best["shapes"]
    err = capsys.readouterr().err
    assert "band  held-out nll" in err and "chosen" in err


def test_a_resumed_choice_converts_only_the_bands_not_tried(tiny_checkpoint, tmp_path, monkeypatch):
    from cmoe_jax.convert import convert

    _, path, text = tiny_checkpoint
    job = ConvertSettings(ConvertConfig(plan=None, k_act=4), Calibration(data_path=str(text), samples=2, seqlen=32),
                          budget=Budget(0.375, measure_by="loss"))
    whole = convert(str(path), job, out=tmp_path / "whole", progress=False)
    scored = []
    score = spread_choice.held_out_nll
    monkeypatch.setattr(spread_choice, "held_out_nll", lambda *a, **k: scored.append(1) or score(*a, **k))
    out = tmp_path / "resumed"
    assert convert(str(path), job, out=out, stop_after_layers=1, progress=False)["out"] is None
    bands = sorted((tmp_path / "resumed.partial" / "bands").glob("*.json"))
    assert [p.name for p in bands] == ["0000.json", "0001.json", "0002.json"]
    bands[2].unlink()
    scored.clear()
    resumed = convert(str(path), job, out=out, resume=True, progress=False)
    assert len(scored) <= 1  # band 3 alone (none when it allocates as a narrower band did)
    for key in ("budget", "plan", "layers"):
        assert resumed[key] == whole[key]


def test_too_little_held_out_text_fails_before_any_work(tiny_checkpoint, tmp_path, capsys):
    """A text whose every aligned window a calibration window touches: one error line."""
    from cmoe_jax.convert.cli import main
    from cmoe_jax.loading import load_tokenizer

    _, path, _ = tiny_checkpoint
    short = tmp_path / "short.txt"
    short.write_text(" ".join(f"w{i % 50}" for i in range(100)))
    tokens = Calibration(data_path=str(short)).tokens(load_tokenizer(str(path)))
    seed = next(s for s in range(200) if len(held_out_windows(tokens, 2, 32, s, 8)) == 0)
    out = tmp_path / "out"
    assert main(_cli(path, short, out, "--active", "0.375", "--sensitivity", "loss", "--seed", str(seed))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "--spread auto" in err[-1] and "fixed --spread N" in err[-1], err
    assert not out.exists() and not list(tmp_path.glob("out.partial*"))


def test_a_streamed_job_keeps_a_quarter_band():
    """A streamed job cannot convert each band: the default becomes z/4."""
    from cmoe_jax.methods.cmoe.job import CmoeSteps

    settings_ = ConvertSettings(ConvertConfig(plan=None), stream=True, budget=Budget(0.75))
    assert CmoeSteps(settings_).settings.budget.spread == 4
    assert CmoeSteps(ConvertSettings(ConvertConfig(plan=None), budget=Budget(0.75))).settings.budget.spread == "auto"
