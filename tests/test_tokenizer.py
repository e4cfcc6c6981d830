"""GGUF tokenizers built without torch give the ids of transformers' `AutoTokenizer(gguf_file=...)`."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cmoe_jax.data.text_sources import join_items, wikitext_items_from_file
from cmoe_jax.loading import load_tokenizer, smollm2_gguf

WIKITEXT_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"
STRINGS = [
    "", " ", "Hello world", " Hello  world ", "naïve café — 東京タワー 🙂 Ελληνικά",
    "1234567 3.14159 1,000,000 2024-11-23 0x1F", "  leading\ttabs\n\n\nnewlines  \r\n end",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "don't I'll we're it's",
    " @-@ <unk> = = Section = = \n", "a" * 300, "\u00a0nbsp\u2009thin\u200bzero-width",
]


OUT_OF_VOCABULARY = "\u6771"  # in STRINGS, so the vocabulary is trained without it


def reference_tokenizer(path: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_ids(ours, ref, texts):
    for text in texts:
        expected = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == expected, f"ids differ on {text!r}"


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else (None if len(a) == len(b) else n)


@pytest.mark.slow
def test_smollm2_whole_wikitext2_test_split_same_ids_as_transformers():
    path = smollm2_gguf()
    ours, ref = load_tokenizer(path), reference_tokenizer(path)
    if WIKITEXT_TEST.exists():
        text = join_items("wikitext2", wikitext_items_from_file(WIKITEXT_TEST))
    else:  # outside this project's machines: the test split through `datasets`
        from cmoe_jax.data.text_sources import load_items

        text = join_items("wikitext2", load_items("wikitext2", "test"))
    got, expected = ours.encode(text), ref(text, add_special_tokens=False)["input_ids"]
    print(f"\nWikiText-2 test: {len(got)} ids (transformers {len(expected)}), "
          f"first mismatch: {first_mismatch(got, expected)}")
    assert len(got) > 250_000
    assert first_mismatch(got, expected) is None
    assert_same_ids(ours, ref, STRINGS)
    assert ours.decode(ours.encode(STRINGS[4])) == STRINGS[4]


def _gguf_reader_fields(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.ggml.")}


def write_tokenizer_gguf(path: Path, *, model: str, tokens, token_types, scores=None, merges=None,
                         pre: str | None = None, bos=1, eos=2, unk=0, add_space_prefix=None):
    """A llama GGUF with a vocabulary and no tensors (all a tokenizer needs)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 16), (w.add_head_count, 2),
                       (w.add_head_count_kv, 2), (w.add_vocab_size, len(tokens))):
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(list(tokens))
    w.add_token_types(list(token_types))
    if scores is not None:
        w.add_token_scores(list(scores))
    if merges is not None:
        w.add_token_merges(list(merges))
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sentencepiece_vocab(size=400):
    """A SentencePiece-style BPE vocabulary (control tokens, byte fallbacks, scored pieces)
    trained with `tokenizers` on real text, listed as a GGUF stores it."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = WIKITEXT_TEST.read_text()[:200_000] if WIKITEXT_TEST.exists() else " ".join(STRINGS) * 200
    text = text.replace(OUT_OF_VOCABULARY, "")  # the byte-fallback check needs it outside the vocabulary
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(vocab_size=size, show_progress=False))
    pieces = [p for p, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # unknown, control, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores, merges


@pytest.mark.parametrize("with_merges", [False, True])
@pytest.mark.parametrize("add_space_prefix", [None, False])
def test_sentencepiece_gguf_same_ids_as_transformers(tmp_path, with_merges, add_space_prefix):
    tokens, types, scores, merges = sentencepiece_vocab()
    path = write_tokenizer_gguf(tmp_path / "sp.gguf", model="llama", tokens=tokens, token_types=types,
                                scores=scores, merges=merges if with_merges else None,
                                add_space_prefix=add_space_prefix)
    ours = load_tokenizer(path)
    assert_same_ids(ours, reference_tokenizer(path), STRINGS + ["<s> inside </s> text"])
    # a character outside the vocabulary falls back to its UTF-8 bytes
    assert ours.encode(" " + OUT_OF_VOCABULARY)[-3:] == [tokens.index(f"<0x{b:02X}>") for b in OUT_OF_VOCABULARY.encode()]


@pytest.fixture(scope="module")
def byte_level_vocab():
    """The first 4000 tokens of SmolLM2's byte-level vocabulary and the merges among them."""
    fields = _gguf_reader_fields(smollm2_gguf())
    tokens = fields["tokenizer.ggml.tokens"][:4000]
    known = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"]
              if (pair := m.split(" ")) and pair[0] in known and pair[1] in known and "".join(pair) in known]
    return tokens, fields["tokenizer.ggml.token_type"][:4000], merges


@pytest.mark.parametrize("pre", [None, "smollm", "llama-bpe", "qwen2", "gpt-4o"])
def test_byte_level_gguf_pre_tokenizers_same_ids_as_transformers(tmp_path, byte_level_vocab, pre):
    tokens, types, merges = byte_level_vocab
    path = write_tokenizer_gguf(tmp_path / "bpe.gguf", model="gpt2", pre=pre, tokens=tokens,
                                token_types=types, merges=merges)
    assert_same_ids(load_tokenizer(path), reference_tokenizer(path), STRINGS)


def test_gguf_without_vocabulary_has_no_tokenizer(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert load_tokenizer(tmp_path / "w.gguf") is None


def test_gguf_tokenizer_ids_beyond_the_vocabulary_are_one_line(tmp_path):
    """A special token id past the vocabulary: one line naming the file, not an IndexError."""
    from cmoe_jax.errors import CheckpointError

    tokens, types, scores, _ = sentencepiece_vocab(300)
    path = write_tokenizer_gguf(tmp_path / "t.gguf", model="llama", tokens=tokens, token_types=types,
                                scores=scores, bos=len(tokens) + 5)
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(path)
    assert str(e.value).startswith(f"{path}: its tokenizer metadata") and "\n" not in str(e.value)


def test_gguf_tokenizer_model_without_tokens_is_one_line(tmp_path):
    import gguf

    from cmoe_jax.errors import CheckpointError

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_bos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(path)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)
