"""Data conventions: GPTQ joining, windows, seeded calibration sampling, errors."""
from __future__ import annotations

import numpy as np
import pytest

from cmoe_jax.data import DataError, calibration_windows, load_text, text_windows


def test_wikitext_local_file_joins_lines_with_blank_lines(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(" = Title = \n\n Some text .\n")
    assert load_text("wikitext2", data_path=str(f)) == " = Title = \n\n\n\n Some text ."


def test_c4_local_jsonl_keeps_first_1100_documents(tmp_path):
    import json

    f = tmp_path / "c4.json"
    f.write_text("\n".join(json.dumps({"text": f"doc{i}"}) for i in range(1200)))
    text = load_text("c4", data_path=str(f))
    assert text.split(" ")[-1] == "doc1099" and text.startswith("doc0 doc1")


def test_text_windows_non_overlapping_and_capped():
    tokens = np.arange(10_000, dtype=np.int32)
    w = text_windows(tokens, 2048)
    assert w.shape == (4, 2048) and w[1, 0] == 2048 and w[3, -1] == 4 * 2048 - 1
    assert text_windows(tokens, 2048, max_windows=2).shape == (2, 2048)


def test_calibration_windows_seeded():
    tokens = np.arange(50_000, dtype=np.int32)
    a, b = calibration_windows(tokens, 8, 512, seed=0), calibration_windows(tokens, 8, 512, seed=0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, calibration_windows(tokens, 8, 512, seed=1))
    assert np.all(np.diff(a, axis=1) == 1)  # contiguous spans of the text


def test_short_dataset_errors_name_the_problem():
    with pytest.raises(DataError, match="fewer than one window of 2048"):
        text_windows(np.arange(100), 2048, name="wikitext2 (test)")
    with pytest.raises(DataError, match="not more than one window"):
        calibration_windows(np.arange(100), 8, 2048, seed=0)


def test_unknown_dataset_and_missing_file(tmp_path):
    with pytest.raises(DataError, match="unknown dataset"):
        load_text("ptb", data_path=str(tmp_path / "x"))
    with pytest.raises(DataError, match="does not exist"):
        load_text("wikitext2", data_path=str(tmp_path / "missing.txt"))
