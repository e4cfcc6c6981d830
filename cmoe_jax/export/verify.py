"""The exported directory read back by transformers, its logits against ours on a few windows.

torch is an extra: without it the check is skipped and the record says so (the export itself
never needs torch)."""
from __future__ import annotations

import numpy as np


def verification_windows(model: str, calib: str, split: str, data_path, samples: int,
                         seqlen: int, seed: int) -> np.ndarray:
    """[samples, seqlen] token windows of the calibration text (checked before any export)."""
    from cmoe_jax.data import calibration_windows, load_text_tokens
    from cmoe_jax.errors import CmoeError
    from cmoe_jax.loading import load_config, load_tokenizer

    cfg, path = load_config(model)
    if seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {seqlen} exceeds the model's context ({cfg.max_position_embeddings})")
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise CmoeError(f"{path} has no tokenizer: pass --calib-samples 0 to export without the check")
    tokens = load_text_tokens(calib, tokenizer, split=split, data_path=data_path)
    return calibration_windows(tokens, samples, seqlen, seed)


def _nll(logits: np.ndarray, tokens: np.ndarray) -> float:
    logits = logits[:, :-1].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logz = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    gold = np.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return float((logz - gold).mean())


def compare_with_transformers(model, directory, windows: np.ndarray) -> dict:
    """{max_abs_logit_diff, perplexity_ours, perplexity_transformers, windows, seqlen}, or
    {skipped: why} when torch is not installed."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return {"skipped": "torch is not installed (pip install -e '.[reference]')"}
    ref = AutoModelForCausalLM.from_pretrained(str(directory), trust_remote_code=True,
                                               dtype=torch.float32).eval()
    diff, nll_ours, nll_ref = 0.0, [], []
    for w in windows:
        ours = np.asarray(model(w[None].astype(np.int32)), np.float32)
        with torch.no_grad():
            theirs = ref(torch.from_numpy(w[None].astype(np.int64))).logits.float().numpy()
        diff = max(diff, float(np.abs(ours - theirs).max()))
        nll_ours.append(_nll(ours, w[None]))
        nll_ref.append(_nll(theirs, w[None]))
    return {"max_abs_logit_diff": diff, "perplexity_ours": float(np.exp(np.mean(nll_ours))),
            "perplexity_transformers": float(np.exp(np.mean(nll_ref))),
            "windows": int(windows.shape[0]), "seqlen": int(windows.shape[1])}
