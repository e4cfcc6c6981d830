"""Texts that are no text are refused before any work (a file of NUL bytes, an empty or blank
one, a binary file), a UTF-8 byte order mark is not read as text, and `convert --active 1.0`
keeps every layer dense without measuring any layer's damage."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.data import load_text
from cmoe_jax.data.text_sources import DataError
from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.loading import load_model
from tests.test_bad_input import inputs  # noqa: F401 (fixture)

NOT_TEXT = {
    "nul-bytes": b"\0" * 100_000,
    "empty": b"",
    "blank": b" \n\n\t\n  \n",
    "control-mostly": b"\x01\x02\x1b\x7f w1 \x00\x00" * 500,
    "bom-only": b"\xef\xbb\xbf",
}


@pytest.mark.parametrize("name", NOT_TEXT)
@pytest.mark.parametrize("dataset,suffix", [("wikitext2", ".txt"), ("c4", ".txt")])
def test_a_file_that_is_no_text_is_refused(tmp_path, name, dataset, suffix):
    path = tmp_path / f"{name}{suffix}"
    path.write_bytes(NOT_TEXT[name])
    with pytest.raises(DataError, match=f"data file {path} (holds no printable text|is not text)"):
        load_text(dataset, data_path=str(path))


def test_a_few_control_characters_in_a_text_are_kept(tmp_path):
    """A real text may hold a stray control character; only a text made of them is refused."""
    path = tmp_path / "t.txt"
    path.write_text("w1 w2 w3 w4 w5 w6 w7 w8 w9 \x01 w10\n")
    assert "\x01" in load_text("wikitext2", data_path=str(path))


@pytest.mark.parametrize("dataset", ["wikitext2", "c4"])
def test_a_utf8_byte_order_mark_is_dropped(tmp_path, dataset):
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("w1 w2 w3\nw4 w5\n", encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert load_text(dataset, data_path=str(marked)) == load_text(dataset, data_path=str(plain))


def test_eval_of_nul_bytes_is_one_line(inputs, tmp_path, capsys):  # noqa: F811
    data = tmp_path / "nul.txt"
    data.write_bytes(b"\0" * 100_000)
    code = eval_main(["--model", str(inputs["converted"]), "--data-path", str(data), "--seqlen", "16",
                      "--max-windows", "1", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: data file {data} holds no printable text (only control "
                                 "characters): give a text file"], err


def test_eval_with_a_byte_order_mark_equals_eval_without(inputs, tmp_path, capsys):  # noqa: F811
    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + inputs["text"].read_bytes())
    ppl = []
    for data in (inputs["text"], marked):
        assert eval_main(["--model", str(inputs["converted"]), "--data-path", str(data), "--seqlen", "16",
                          "--max-windows", "2", "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
        ppl.append(json.loads((tmp_path / "r.json").read_text())["ppl"])
    assert ppl[0] == ppl[1]


def test_convert_active_1_keeps_every_layer_dense_without_measuring(inputs, tmp_path):  # noqa: F811
    out = tmp_path / "full"
    assert convert_main(["--model", str(inputs["dense"]), "--data-path", str(inputs["text"]), "--calib-samples",
                         "2", "--seqlen", "32", "--k-act", "4", "--no-progress", "--active", "1.0",
                         "--out", str(out)]) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    assert manifest["model_config"]["moe_layers"] in ([], [None, None])
    assert "damage" not in manifest["budget"] and "stream_error" not in manifest["budget"]
    assert not list((tmp_path).glob("full.partial"))
    tokens = jnp.asarray(np.arange(2, 34, dtype=np.int32)[None])
    got = load_model(str(out), progress=False).model(tokens)
    want = load_model(str(inputs["dense"]), progress=False).model(tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
