"""Streamed (layer-by-layer) CMoE conversion against the in-memory path: the same model, bit
for bit, with each layer's weights read only when the calibration stream reaches it."""
from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.checkpoint import PER_LAYER, restore_model
from cmoe_jax.convert import Calibration, ConvertConfig, ConvertSettings, convert, convert_model
from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.methods.cmoe.streamed import Streamed, convert_streamed
from cmoe_jax.loading import load_config, load_model, open_source
from cmoe_jax.loading.sources import TensorSource
from tests.conftest import tiny_hf_model
from tests.test_loading import _write_llama_gguf

def _job(plan, text, stream=False):
    return ConvertSettings(ConvertConfig(plan=plan, k_act=4), Calibration(data_path=str(text), samples=2, seqlen=32),
                      stream=stream)


def memory_and_streamed(save_tiny, tmp_path, cc: ConvertConfig) -> tuple:
    """A tiny Llama converted with `cc` in memory and streamed: (the two manifests, the two
    restored models)."""
    from tests.conftest import save_tiny_tokenizer, write_random_text

    _, path = save_tiny("llama", intermediate_size=64)
    save_tiny_tokenizer(path)
    text = write_random_text(tmp_path / "calib.txt", 2000)
    for out, stream in (("memory", False), ("streamed", True)):
        convert(str(path), ConvertSettings(cc, Calibration(data_path=str(text), samples=2, seqlen=32), stream=stream),
                out=tmp_path / out, progress=False)
    manifests = tuple(json.loads((tmp_path / o / "cmoe_manifest.json").read_text()) for o in ("memory", "streamed"))
    return manifests, (restore_model(tmp_path / "memory"), restore_model(tmp_path / "streamed"))


def _assert_same_state(a, b):
    fa, fb = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (p, x), (_, y) in zip(fa, fb):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()),
                                      err_msg=str(p))


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_streamed_conversion_equals_in_memory(save_tiny, tmp_path, family):
    """Same manifest partitions and bitwise-equal parameters as the in-memory conversion;
    both outputs are written per layer (state/layer_NNNN, state/rest) and load alike."""
    from tests.conftest import save_tiny_tokenizer, write_random_text

    _, path = save_tiny(family, intermediate_size=64)
    save_tiny_tokenizer(path)
    text = write_random_text(tmp_path / "calib.txt", 2000)
    plan = MoEPlan.parse("S1A2E8")
    convert(str(path), _job(plan, text), out=tmp_path / "memory", progress=False)
    convert(str(path), _job(plan, text, stream=True), out=tmp_path / "streamed", progress=False)
    a = json.loads((tmp_path / "memory" / "cmoe_manifest.json").read_text())
    b = json.loads((tmp_path / "streamed" / "cmoe_manifest.json").read_text())
    assert a["state_layout"] == b["state_layout"] == PER_LAYER
    assert a["layers"] == b["layers"] and a["model_config"] == b["model_config"]
    for out in ("memory", "streamed"):
        parts = sorted(p.name for p in (tmp_path / out / "state").iterdir())
        assert parts == ["layer_0000", "layer_0001", "rest"]
    _assert_same_state(restore_model(tmp_path / "memory"), restore_model(tmp_path / "streamed"))


class _Recording(TensorSource):
    """A source that logs every tensor read, to check the order of reads and writes."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def names(self):
        return self.inner.names()

    def __contains__(self, name):
        return name in self.inner

    def get(self, name):
        self.log.append(("read", name))
        return self.inner.get(name)


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


@pytest.mark.parametrize("fmt, family", [("safetensors", "llama"), ("safetensors", "qwen2"),
                                         ("gguf", "llama")])
def test_each_layer_is_read_after_the_previous_one_is_written(tmp_path, fmt, family):
    """Layer i+1's tensors are read only once layer i is converted and written; every tensor
    is read once; the result equals `convert_model` on the fully loaded model."""
    hf = tiny_hf_model(family, intermediate_size=64, num_hidden_layers=3)
    if fmt == "gguf":
        path = tmp_path / "tiny.gguf"
        _write_llama_gguf(hf, path)
    else:
        path = tmp_path / "tiny"
        hf.save_pretrained(path)
    cfg, _ = load_config(str(path))
    calib = np.random.default_rng(0).integers(0, 96, size=(2, 32)).astype(np.int32)
    cc = ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=4)
    log = []
    out = tmp_path / "out"

    def on_layer(i, record):
        assert (out / "state" / f"layer_{i:04d}").exists()
        log.append(("written", i))

    cfg_moe, records = convert_streamed(Streamed(_Recording(open_source(path), log), cfg, out), calib, cc,
                                        progress=False, on_layer=on_layer)
    reads = [name for kind, name in log if kind == "read"]
    assert len(reads) == len(set(reads))  # nothing read twice
    written = -1
    for kind, what in log:
        if kind == "written":
            assert what == written + 1
            written = what
        elif _layer_of(what) is not None:
            assert _layer_of(what) == written + 1, f"{what} read while layer {written} was the last written"
    assert written == cfg.num_layers - 1

    dense = load_model(str(path), progress=False).model
    moe, expected = convert_model(dense, calib, cc, progress=False)
    for r, e in zip(records, expected):
        np.testing.assert_array_equal(r.carving.expert_idx, e.carving.expert_idx)
        np.testing.assert_array_equal(r.load, e.load)
    assert cfg_moe == moe.config


def test_interrupted_streamed_conversion_resumes_identically(tiny_checkpoint, tmp_path):
    _, path, text = tiny_checkpoint
    plan = MoEPlan.parse("S1A1E8")
    job = _job(plan, text, stream=True)
    convert(str(path), job, out=tmp_path / "full", progress=False)
    r = convert(str(path), job, out=tmp_path / "resumed", stop_after_layers=1, progress=False)
    assert r["out"] is None and not (tmp_path / "resumed").exists()
    convert(str(path), job, out=tmp_path / "resumed", resume=True, progress=False)
    _assert_same_state(restore_model(tmp_path / "full"), restore_model(tmp_path / "resumed"))


def test_expertweaver_streamed_equals_in_memory(tiny_checkpoint, tmp_path, monkeypatch):
    """`--stream` weaves the same layers (manifest and bitwise-equal parameters) as in
    memory, and a streamed weave stopped after a layer resumes to the same model."""
    from cmoe_jax.convert import TaskCalibration, WeaveConfig, WeaverSettings
    from cmoe_jax.methods.expertweaver import job
    from tests.test_expertweaver import _articles, _cli

    streamed, weave = [], job.weave_streamed
    monkeypatch.setattr(job, "weave_streamed", lambda *a, **k: streamed.append(1) or weave(*a, **k))
    _, path, _ = tiny_checkpoint
    text = _articles(tmp_path / "articles.txt")
    assert convert_main(_cli(path, text, tmp_path / "memory")) == 0
    assert not streamed
    assert convert_main(_cli(path, text, tmp_path / "streamed", "--stream")) == 0
    assert streamed == [1]
    a, b = (json.loads((tmp_path / n / "cmoe_manifest.json").read_text()) for n in ("memory", "streamed"))
    assert a["layers"] == b["layers"] and a["model_config"] == b["model_config"]
    assert b["state_layout"] == PER_LAYER and [s["shared_width"] for s in b["model_config"]["moe_layers"]]
    _assert_same_state(restore_model(tmp_path / "memory"), restore_model(tmp_path / "streamed"))

    settings = WeaverSettings(WeaveConfig(experts=8), TaskCalibration(data_path=str(text), tasks=4,
                                                                       samples_per_task=2, seqlen=32), stream=True)
    r = convert(str(path), settings, out=tmp_path / "resumed", stop_after_layers=1, progress=False)
    assert r["out"] is None and not (tmp_path / "resumed").exists()
    convert(str(path), settings, out=tmp_path / "resumed", resume=True, progress=False)
    _assert_same_state(restore_model(tmp_path / "memory"), restore_model(tmp_path / "resumed"))
