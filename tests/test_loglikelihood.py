"""Continuation log-likelihoods against transformers (tiny random models) and against each
model's own unpadded forward (converted and LoRA-merged models); tokenisation as lm-eval's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.convert import ConvertConfig, convert_model
from cmoe_jax.data import length_bucket
from cmoe_jax.eval.loglikelihood import encode_pair, score_requests
from cmoe_jax.loading import load_model
from conftest import WORDS


def random_requests(n, seed=0, vocab=96, longest=40):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ctx = rng.integers(0, vocab, rng.integers(1, longest)).tolist()
        cont = rng.integers(0, vocab, rng.integers(1, 9)).tolist()
        out.append((ctx, cont))
    return out


def choice_requests(questions, seed=0, vocab=96, choices=4, longest=40):
    """Multiple-choice shaped requests: each question's context with several continuations."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(questions):
        ctx = rng.integers(0, vocab, rng.integers(1, longest)).tolist()
        out += [(ctx, rng.integers(0, vocab, rng.integers(1, 9)).tolist()) for _ in range(choices)]
    return out


def torch_scores(model, requests, max_length=10_000):
    """Reference: one unpadded transformers forward per request, as lm-eval's HF backend."""
    out = []
    with torch.no_grad():
        for ctx, cont in requests:
            seq = (ctx + cont)[-(max_length + 1):]
            logits = model(torch.tensor([seq[:-1]])).logits[0, -len(cont):].double()
            logp = torch.log_softmax(logits, -1)
            target = torch.tensor(cont)
            out.append((logp.gather(-1, target[:, None]).sum().item(),
                        bool((logits.argmax(-1) == target).all())))
    return out


def own_scores(model, requests, width=64):
    """Reference for any of our models: its plain forward on all requests at once, each row
    right-padded with random tokens (which a causal model must ignore), float64 softmax."""
    rng = np.random.default_rng(7)
    rows = [ctx + cont for ctx, cont in requests]
    tokens = np.stack([np.concatenate([r[:-1], rng.integers(0, 96, width - len(r) + 1)]) for r in rows])
    logits_all = np.asarray(model(jnp.asarray(tokens, jnp.int32)), np.float64)
    out = []
    for (ctx, cont), logits in zip(requests, logits_all):
        logits = logits[len(ctx) - 1:len(ctx) + len(cont) - 1]
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        out.append((float(logp[np.arange(len(cont)), cont].sum()),
                    bool((logits.argmax(-1) == np.array(cont)).all())))
    return out


def assert_same(ours, ref, atol=1e-4):
    np.testing.assert_allclose([x for x, _ in ours], [x for x, _ in ref], atol=atol, rtol=0)
    assert [g for _, g in ours] == [g for _, g in ref]


@pytest.mark.parametrize("family,batch_size,scan", [("llama", 5, True), ("llama", 64, False),
                                                     ("qwen3_moe", 4, True)])
def test_loglikelihoods_match_transformers(save_tiny, family, batch_size, scan):
    ref_model, path = save_tiny(family)
    lm = load_model(str(path), progress=False)
    requests = random_requests(23) + choice_requests(6, seed=11)  # 6 questions share their context
    model = lm.model if scan else lm.model.unstacked()  # stacked layers run as a scan
    ours, stats = score_requests(model, requests, batch_size=batch_size, progress=False)
    assert_same(ours, torch_scores(ref_model, requests))
    assert stats["requests"] == 47 and stats["rows"] == 23 + 6
    assert stats["padded_tokens"] >= stats["tokens"]


def test_greedy_flag_is_true_for_the_argmax_continuation(save_tiny):
    ref_model, path = save_tiny("llama")
    lm = load_model(str(path), progress=False)
    ctx = [5, 17, 33]
    with torch.no_grad():
        best = int(ref_model(torch.tensor([ctx])).logits[0, -1].argmax())
    (_, greedy_best), (_, greedy_other) = score_requests(
        lm.model, [(ctx, [best]), (ctx, [(best + 1) % 96])], progress=False)[0]
    assert greedy_best and not greedy_other


def test_long_requests_are_cut_from_the_left_like_lm_eval(save_tiny):
    ref_model, path = save_tiny("llama")
    lm = load_model(str(path), progress=False)
    requests = random_requests(6, seed=1, longest=60)
    ours, _ = score_requests(lm.model, requests, max_length=24, progress=False)
    assert_same(ours, torch_scores(ref_model, requests, max_length=24))


def test_shared_context_rows_equal_one_row_per_request(save_tiny):
    """Packing the choices of a question into one row (segments that see the context and
    themselves only, at their own positions) gives the numbers of one row per request; a
    group longer than the context limit is split over rows, and cut requests stay alone."""
    ref_model, path = save_tiny("llama")
    lm = load_model(str(path), progress=False)
    requests = choice_requests(5, seed=3, choices=6) + random_requests(4, seed=4, longest=60)
    packed, st_packed = score_requests(lm.model, requests, max_length=40, batch_size=4, progress=False)
    alone, st_alone = score_requests(lm.model, requests, max_length=40, batch_size=4, progress=False,
                                     share_context=False)
    assert_same(packed, alone, atol=1e-4)
    assert_same(packed, torch_scores(ref_model, requests, max_length=40))
    assert st_alone["rows"] == len(requests) and 5 + 4 <= st_packed["rows"] < len(requests)
    assert st_packed["tokens"] < st_alone["tokens"]


def test_converted_and_lora_merged_models_score_as_their_own_forward(save_tiny):
    from cmoe_jax.train import LoRAConfig, init_adapters, merge_adapters

    _, path = save_tiny("llama", intermediate_size=64)
    dense = load_model(str(path), progress=False).model
    calib = np.random.default_rng(0).integers(0, 96, size=(4, 32)).astype(np.int32)
    moe, _ = convert_model(dense, calib, ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=4), progress=False)
    lora = LoRAConfig(rank=4, alpha=32)
    adapters = init_adapters(moe, lora, jax.random.key(1))
    adapters = jax.tree.map(lambda a: 0.05 * jax.random.normal(jax.random.key(2), a.shape), adapters)
    merged = merge_adapters(moe, adapters, lora.scale)
    requests = random_requests(17, seed=2)
    for model in (moe, merged.unstacked()):
        ours, _ = score_requests(model, requests, batch_size=6, progress=False)
        assert_same(ours, own_scores(model, requests), atol=2e-4)


def test_length_ladder_has_few_rungs_and_bounded_padding():
    rungs = sorted({length_bucket(n, 2048) for n in range(1, 2049)})
    assert len(rungs) <= 30 and rungs[-1] == 2048
    assert all(length_bucket(n, 2048) >= n for n in range(1, 2049))
    assert all(length_bucket(n, 2048) <= max(16, 1.25 * n + 8) for n in range(1, 2049))
    assert length_bucket(100, 64) == 100  # never shorter than the input


def test_encode_pair_moves_trailing_spaces_and_splits_the_whole_encoding(tmp_path):
    from conftest import save_tiny_tokenizer
    from cmoe_jax.loading import load_tokenizer

    save_tiny_tokenizer(tmp_path)
    encode = load_tokenizer(tmp_path).encode
    ctx, cont = encode_pair(encode, "w1 w2 ", "w3 w4")
    assert ctx == encode("w1 w2") and cont == encode("w3 w4") and ctx + cont == encode("w1 w2 w3 w4")
    assert encode_pair(encode, "", "w5 w6", prefix_token=1) == ([1], encode("w5 w6"))
    with pytest.raises(ValueError):
        encode_pair(encode, "", "w5", prefix_token=None)


def test_encode_pair_equals_lm_evals_on_a_bpe_tokenizer():
    """A byte-level BPE where "Answer:" + " text" merges differently alone and together."""
    lm_eval_model = pytest.importorskip("lm_eval.api.model")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["Question: what is " + " ".join(WORDS[i:i + 5]) + "?\nAnswer: " + WORDS[i] for i in range(80)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    encode = lambda s: tok.encode(s).ids

    class Split(lm_eval_model.TemplateLM):  # only the tokenisation of lm-eval's base class
        backend = "causal"
        eot_token_id = 0
        tok_encode = staticmethod(encode)
        _loglikelihood_tokens = loglikelihood_rolling = generate_until = None

    ref = Split.__new__(Split)
    for ctx, cont in [("Question: what is w1?\nAnswer:", " w1"), ("Answer: ", "w22 w3"),
                      ("Question:  ", " w7?"), ("x", "y")]:
        assert encode_pair(encode, ctx, cont) == ref._encode_pair(ctx, cont)


@pytest.mark.slow
def test_smollm2_arc_loglikelihoods_match_transformers_on_a_sample():
    import transformers
    from pathlib import Path

    from cmoe_jax.eval.tasks import get_task, load_documents, task_requests
    from cmoe_jax.loading import smollm2_gguf

    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "arc-easy" / "test.jsonl"
    if not data.exists():
        pytest.skip("needs ../shared/data/arc-easy/test.jsonl")
    task = get_task("arc_easy")
    docs = load_documents(task, data)[::300]  # 8 questions spread over the split
    lm = load_model("smollm2", progress=False)
    requests = task_requests(task, docs, lm.tokenizer.encode)
    gguf = smollm2_gguf()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    ours, _ = score_requests(lm.model, requests, batch_size=8, progress=False)
    assert_same(ours, torch_scores(ref, requests), atol=1e-3)
