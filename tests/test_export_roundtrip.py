"""A directory `export` wrote is read back by the project's own jobs: `eval` gives the
perplexity of the model it was exported from, `generate` the same tokens, `train` the same
first loss, for a carved model (transformers' remote-code form, `cmoe_llama`) and a dense
one (its family's own architecture)."""
from __future__ import annotations

import json

import pytest

from cmoe_jax.compress.cli import main as compress_main
from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.export.cli import main as export_main
from cmoe_jax.generate import main as generate_main
from cmoe_jax.loading import load_config
from cmoe_jax.train.cli import main as train_main
from tests.test_bad_input import inputs  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def exported(inputs, tmp_path_factory):  # noqa: F811
    """{kind: (source model, its export)} for a dense model, its S1A1E8 conversion and a
    ConMoE compression of that (a prototype table and an integer slot map)."""
    root = tmp_path_factory.mktemp("exported")
    compressed = root / "compressed"
    assert compress_main(["--model", str(inputs["converted"]), "--data-path", str(inputs["text"]),
                          "--calib-samples", "2", "--seqlen", "32", "--method", "conmoe", "--ratio", "0.5",
                          "--out", str(compressed)]) == 0
    pairs = {}
    for kind, source in (("dense", inputs["dense"]), ("carved", inputs["converted"]), ("compressed", compressed)):
        out = root / f"{kind}-hf"
        assert export_main(["--model", str(source), "--calib-samples", "0", "--no-progress", "--out", str(out)]) == 0
        pairs[kind] = (source, out)
    return pairs


KINDS = ["dense", "carved", "compressed"]


def _ppl(model, text, tmp_path) -> float:
    result = tmp_path / "r.json"
    assert eval_main(["--model", str(model), "--data-path", str(text), "--seqlen", "16", "--max-windows", "4",
                      "--no-progress", "--json", str(result)]) == 0
    return json.loads(result.read_text())["ppl"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_export_reads_back_as_the_model_it_was_exported_from(inputs, exported, kind):  # noqa: F811
    source, out = exported[kind]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("llama" if kind == "dense" else "cmoe_llama")
    assert load_config(str(out))[0] == load_config(str(source))[0]


@pytest.mark.parametrize("kind", KINDS)
def test_eval_of_an_export_gives_the_sources_perplexity(inputs, exported, tmp_path, kind):  # noqa: F811
    source, out = exported[kind]
    want, got = _ppl(source, inputs["text"], tmp_path), _ppl(out, inputs["text"], tmp_path)
    assert abs(got - want) <= 1e-5 * want, (got, want)


def test_generate_from_an_export_gives_the_sources_tokens(exported, capsys):
    texts = []
    for model in exported["carved"]:
        assert generate_main(["--model", str(model), "--prompt", "w1 w2 w3", "--max-new-tokens", "6"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()


def test_train_on_an_export_starts_from_the_sources_loss(inputs, exported, tmp_path):  # noqa: F811
    losses = []
    for i, model in enumerate(exported["carved"]):
        out = tmp_path / f"t{i}"
        assert train_main(["--model", str(model), "--data-path", str(inputs["text"]), "--samples", "4",
                           "--seqlen", "16", "--batch-size", "2", "--no-progress", "--out", str(out)]) == 0
        losses.append(json.loads((out / "train_log.json").read_text())["first_loss"])
    assert abs(losses[1] - losses[0]) <= 1e-5 * losses[0], losses
