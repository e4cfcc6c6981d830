"""Data conventions: GPTQ joining, sources, windows, seeded calibration sampling, errors."""
from __future__ import annotations

import gzip
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from cmoe_jax.data import (C4_DOCUMENTS, DataError, calibration_windows, eval_windows, load_items,
                           load_text, load_text_tokens, text_windows)
from cmoe_jax.errors import CmoeError

SHARED_WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"

# What `datasets` yields for a raw WikiText file: non-blank lines keep "\n", blank lines are "".
RAW_LINES = [" \n", " = Title = \n", " \n", " First paragraph , with text . \n", " \n",
             " = = Section = = \n", "\n", " Second paragraph . \n"]
HF_ITEMS = ["", " = Title = \n", "", " First paragraph , with text . \n", "",
            " = = Section = = \n", "", " Second paragraph . \n"]


def test_wikitext_local_file_mirrors_the_datasets_items(tmp_path):
    f = tmp_path / "wiki.test.raw"
    f.write_text("".join(RAW_LINES))
    assert load_items("wikitext2", data_path=str(f)) == HF_ITEMS
    assert load_text("wikitext2", data_path=str(f)) == "\n\n".join(HF_ITEMS)


@pytest.mark.skipif(not (SHARED_WIKITEXT / "test.txt").exists(), reason="shared WikiText-2 not present")
def test_shared_wikitext_file():
    text = load_text("wikitext2", data_path=str(SHARED_WIKITEXT / "test.txt"))
    assert text.startswith("\n\n = Robert <unk> = \n\n\n\n\n Robert <unk> is an English film")
    items = load_items("wikitext2", data_path=str(SHARED_WIKITEXT / "test.txt"))
    assert len(items) == 4358  # one item per line of the release (torchtext's NUM_LINES)
    assert "\n\n".join(items) == text and text.endswith("Eddie <unk> . \n\n\n")


def test_fake_datasets_library_gets_gptq_calls(monkeypatch):
    calls = []

    class FakeDataset(dict):
        def select(self, idx):
            return FakeDataset(text=[self["text"][i] for i in idx])

        def __len__(self):
            return len(self["text"])

    def load_dataset(*args, **kw):
        calls.append((args, kw))
        if args[0] == "wikitext":
            return FakeDataset(text=HF_ITEMS)
        return FakeDataset(text=[f"doc{i}" for i in range(2000)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_text("wikitext2") == "\n\n".join(HF_ITEMS)
    assert calls[-1] == (("wikitext", "wikitext-2-raw-v1"), {"split": "test"})
    load_text("wikitext2", split="valid")
    assert calls[-1][1] == {"split": "validation"}
    c4 = load_text("c4")
    assert calls[-1] == (("allenai/c4",), {"data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"},
                                           "split": "validation"})
    assert c4 == " ".join(f"doc{i}" for i in range(C4_DOCUMENTS))


def test_fake_tfds_when_datasets_is_missing(monkeypatch):
    names = []

    def load(name, split):
        names.append((name, split))
        return [{"text": f"doc{i}".encode()} for i in range(3)]

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", types.SimpleNamespace(load=load, as_numpy=lambda d: d))
    assert load_text("wikitext2", split="test") == "doc0\n\ndoc1\n\ndoc2"
    assert names[-1] == ("huggingface:wikitext/wikitext-2-raw-v1", "test")


def test_missing_download_libraries_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(DataError, match=r"pip install -e '\.\[datasets\]'.*--data-path"):
        load_text("wikitext2")
    with pytest.raises(DataError, match=r"pip install -e '\.\[tfds\]'"):
        load_text("c4", source="tfds")


def test_datasets_failure_is_one_clear_error(monkeypatch):
    def load_dataset(*a, **k):
        raise ConnectionError("no route to the Hub")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(DataError, match="could not load wikitext2.*no route.*--data-path"):
        load_text("wikitext2")


def test_c4_local_jsonl_and_gzip_keep_first_1100_documents(tmp_path):
    docs = [{"text": f"doc {i}", "url": "u"} for i in range(1200)]
    f = tmp_path / "c4.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    g = tmp_path / "c4-validation.00000-of-00008.json.gz"
    with gzip.open(g, "wt") as out:
        out.write("\n".join(json.dumps(d) for d in docs))
    expected = " ".join(f"doc {i}" for i in range(1100))
    assert load_text("c4", data_path=str(f)) == expected
    assert load_text("c4", data_path=str(g)) == expected
    t = tmp_path / "c4.txt"
    t.write_text("first doc\nsecond doc\n")
    assert load_text("c4", data_path=str(t)) == "first doc second doc"


def test_bad_local_files(tmp_path):
    bad = tmp_path / "c4.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match="line 2 is not a JSON object"):
        load_text("c4", data_path=str(bad))
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    with pytest.raises(DataError, match="not UTF-8"):
        load_text("wikitext2", data_path=str(latin))
    with pytest.raises(DataError, match="not a file"):
        load_text("wikitext2", data_path=str(tmp_path))
    with pytest.raises(DataError, match="does not exist"):
        load_text("wikitext2", data_path=str(tmp_path / "missing.txt"))
    with pytest.raises(DataError, match="unknown dataset"):
        load_text("ptb", data_path=str(latin))


def test_tokens_are_int32_without_special_tokens(tmp_path):
    class Tok:
        def encode(self, text):
            return [len(w) for w in text.split()]

    f = tmp_path / "t.txt"
    f.write_text(" a bb \n\n ccc \n")
    tokens = load_text_tokens("wikitext2", Tok(), data_path=str(f))
    assert tokens.dtype == np.int32 and tokens.tolist() == [1, 2, 3]


def test_text_windows_non_overlapping_and_capped():
    tokens = np.arange(10_000, dtype=np.int64)
    w = text_windows(tokens, 2048)
    assert w.shape == (4, 2048) and w.dtype == np.int32
    np.testing.assert_array_equal(w.ravel(), np.arange(4 * 2048))  # remainder dropped
    assert text_windows(tokens, 2048, max_windows=2).shape == (2, 2048)
    assert text_windows(tokens, 2048, max_windows=99).shape == (4, 2048)


def test_c4_eval_windows_are_the_first_256():
    tokens = np.arange(300 * 8, dtype=np.int32)
    assert eval_windows(tokens, "c4", 8).shape == (256, 8)
    assert eval_windows(tokens, "c4", 8, max_windows=10).shape == (10, 8)
    assert eval_windows(tokens, "wikitext2", 8).shape == (300, 8)


def test_calibration_windows_seeded_gptq_offsets():
    tokens = np.arange(50_000, dtype=np.int32)
    a, b = calibration_windows(tokens, 8, 512, seed=0), calibration_windows(tokens, 8, 512, seed=0)
    assert a.shape == (8, 512) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, calibration_windows(tokens, 8, 512, seed=1))
    assert np.all(np.diff(a, axis=1) == 1)  # contiguous spans of the text
    # the convention itself: numpy Generator(seed), starts uniform in [0, len - seqlen - 1]
    starts = np.random.default_rng(0).integers(0, 50_000 - 512, size=8)
    np.testing.assert_array_equal(a[:, 0], starts)
    small = calibration_windows(np.arange(10), 200, 8, seed=3)
    assert set(small[:, 0].tolist()) == {0, 1}  # never runs past the end, both offsets drawn


def test_bos_opened_calibration_windows_are_the_same_draw_shifted_behind_bos():
    """Each window is BOS and the first seqlen - 1 tokens of the plain window of the same
    seed; the held-out windows are opened alike and still touch no calibration window."""
    from cmoe_jax.data import held_out_windows

    tokens = np.arange(7, 5007, dtype=np.int32)
    plain, opened = calibration_windows(tokens, 4, 64, seed=3), calibration_windows(tokens, 4, 64, seed=3, bos=1)
    assert opened.shape == plain.shape and opened.dtype == np.int32
    assert (opened[:, 0] == 1).all()
    np.testing.assert_array_equal(opened[:, 1:], plain[:, :-1])
    held_plain = held_out_windows(tokens, 4, 64, 3, 5)
    held = held_out_windows(tokens, 4, 64, 3, 5, bos=1)
    assert len(held) == len(held_plain) > 0
    assert (held[:, 0] == 1).all()
    np.testing.assert_array_equal(held[:, 1:], held_plain[:, :-1])
    assert not set(held[:, 1:].ravel()) & set(opened[:, 1:].ravel())


def test_short_dataset_errors_name_dataset_count_and_seqlen():
    with pytest.raises(DataError, match=r"wikitext2 \(test\) has 100 tokens, fewer than one window of 2048.*--seqlen"):
        text_windows(np.arange(100), 2048, name="wikitext2 (test)")
    with pytest.raises(DataError, match="has 100 tokens, not more than one window of 2048"):
        calibration_windows(np.arange(100), 8, 2048, seed=0)
    with pytest.raises(ValueError):  # DataError is a ValueError and a CmoeError
        text_windows(np.arange(10), 1)
    assert issubclass(DataError, CmoeError) and issubclass(DataError, ValueError)
    with pytest.raises(DataError, match="at least 1"):
        calibration_windows(np.arange(100), 0, 8, seed=0)
