"""Sampling, stop conditions, the few-token MoE path and `python -m cmoe_jax.generate`."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.generate import Decoding, Sampling, choose, generate
from cmoe_jax.generate import main as generate_main
from cmoe_jax.loading import load_model, load_tokenizer
from cmoe_jax.moe import MoEFFN
from cmoe_jax.moe.dispatch import GLUExperts, routed_experts
from cmoe_jax.moe.gmm import get_gmm
from cmoe_jax.moe.hierarchical import HierMoEFFN
from cmoe_jax.moe.dispatch import gathered_experts
from tests.conftest import WORDS

PROMPTS = [[5, 17, 40, 3], [9], [60, 61, 62, 63, 64, 65, 66]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import save_tiny_tokenizer, tiny_hf_model

    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama").save_pretrained(path)
    save_tiny_tokenizer(path)
    return path, load_model(str(path), progress=False).model


def test_sampling_is_reproducible_and_top_k_1_is_greedy(tiny):
    _, model = tiny
    greedy = generate(model, PROMPTS, Decoding(12))
    sample = lambda **kw: generate(model, PROMPTS, Decoding(12, sampling=Sampling(**kw)))
    assert sample(temperature=1.0, top_k=1, seed=3) == greedy
    assert sample(temperature=5.0, top_k=1, top_p=0.5, seed=4) == greedy
    a, b = sample(temperature=1.5, seed=7), sample(temperature=1.5, seed=7)
    assert a == b
    assert a != greedy and sample(temperature=1.5, seed=8) != a  # 36 draws from ~96 tokens


def test_top_k_and_top_p_draw_only_from_their_sets():
    logits = jnp.log(jnp.asarray([[0.4, 0.3, 0.2, 0.1, 0.0]] * 2000, jnp.float32) + 1e-9)
    draw = lambda k, p: np.asarray(choose(logits, jax.random.PRNGKey(0), 1.0, k, p, greedy=False))
    assert set(draw(2, 1.0)) == {0, 1}
    assert set(draw(0, 0.65)) == {0, 1}          # 0.4 < 0.65 <= 0.7: the first two
    assert set(draw(0, 0.75)) == {0, 1, 2}
    counts = np.bincount(draw(0, 1.0), minlength=5) / 2000
    np.testing.assert_allclose(counts, [0.4, 0.3, 0.2, 0.1, 0.0], atol=0.04)


def test_stop_tokens_and_stop_callback_end_rows(tiny):
    _, model = tiny
    free = generate(model, PROMPTS, Decoding(10))
    stop_token = free[0][3]
    stopped = generate(model, PROMPTS, Decoding(10, stop_tokens=[stop_token]))
    for full, cut in zip(free, stopped):
        end = full.index(stop_token) + 1 if stop_token in full else len(full)
        assert cut == full[:end]
    called = generate(model, PROMPTS, Decoding(10, stop=lambda ids: len(ids) >= 4 and ids[-1] % 2 == 0))
    for full, cut in zip(free, called):
        assert cut == full[:len(cut)]
        assert len(cut) == 10 or (len(cut) >= 4 and cut[-1] % 2 == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gathered_experts_equal_the_sort_dispatch(dtype):
    rng = np.random.default_rng(0)
    e, d, m, t, k = 6, 16, 8, 3, 2
    w = [jnp.asarray(rng.normal(size=s), dtype) for s in ((e, d, m), (e, d, m), (e, m, d))]
    x = jnp.asarray(rng.normal(size=(t, d)), dtype)
    ids = jnp.asarray([[1, 4], [4, 0], [1, 5]], jnp.int32)
    gates = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
    y, counts = gathered_experts(x, ids, gates, *w, "silu")
    ref, sizes = routed_experts(x, ids, gates, GLUExperts(*w, get_gmm("dense"), "silu"))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == jnp.bfloat16 else 1e-5)
    np.testing.assert_array_equal(counts, sizes)


@pytest.mark.parametrize("layer", ["cmoe", "linear", "hier"])
def test_moe_layer_one_token_at_a_time_equals_all_at_once(layer):
    """Single tokens take the few-token path; 32 tokens at once take the sort dispatch."""
    if layer == "hier":
        moe = HierMoEFFN(d_model=16, expert_width=4, num_experts=4, top_k=2, sub_experts=4, sub_shared=1, sub_top_k=1, shared_width=8,
                         router="cmoe", activation="silu", rngs=nnx.Rngs(0))
    else:
        moe = MoEFFN(d_model=16, expert_width=8, num_experts=8, top_k=2, shared_width=8 if layer == "cmoe" else 0, router=layer,
                     activation="silu", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 16))
    together, load = moe(x, return_load=True)
    single = [moe(x[i:i + 1], return_load=True) for i in range(32)]
    np.testing.assert_allclose(np.concatenate([np.asarray(y) for y, _ in single]), np.asarray(together),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sum(np.asarray(c) for _, c in single), load)


def test_cli_json_lines_with_stop_strings(tiny, tmp_path, capsys):
    path, model = tiny
    prompts = ["w1 w2 w3", "w40 w41", "w7"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n\n")
    assert generate_main(["--model", str(path), "--prompts-file", str(tmp_path / "p.txt"),
                          "--max-new-tokens", "8"]) == 0
    free = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in free] == prompts
    tok = load_tokenizer(path)
    ids = generate(model, [tok.encode(p) for p in prompts], Decoding(8))
    assert [r["completion"] for r in free] == [tok.decode(o) for o in ids]
    assert [tok.encode(p) for p in prompts] == [[WORDS.index(w) + 2 for w in p.split()] for p in prompts]
    stop = free[0]["completion"].split()[2]
    args = ["--model", str(path), "--max-new-tokens", "8", "--stop", stop]
    assert generate_main([*args, *sum((["--prompt", p] for p in prompts), [])]) == 0
    cut = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for f, c in zip(free, cut):
        assert c["completion"] == f["completion"].split(stop)[0]
        assert c["finish"] == ("stop" if stop in f["completion"] else "length")
    assert generate_main([*args, "--prompt", prompts[0]]) == 0  # one prompt: streamed text
    assert capsys.readouterr().out == cut[0]["completion"] + "\n"


@pytest.mark.parametrize("argv, message", [
    ([], "--prompt"),
    (["--prompt", "w1", "--top-k", "-1"], "--top-k"),
    (["--prompt", "w1", "--temperature", "-0.5"], "--temperature"),
    (["--prompt", "w1", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "does not exist"),
    (["--prompt", "w1", "--chat"], "chat template"),
])
def test_cli_bad_input_is_one_error_line(tiny, argv, message, capsys):
    path, _ = tiny
    assert generate_main(["--model", str(path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
