"""The exported directory read back by transformers, its logits against ours on a few windows.

torch is an extra: without it the check is skipped and the record says so (the export itself
never needs torch). With it, an export whose logits differ from ours by more than
`LOGIT_TOLERANCE` times the logits' own scale (max |logit|, at least 1) fails: a float32
export of the same weights differs by about 1e-6 of that scale, a wrong or missing tensor by
far more.
"""
from __future__ import annotations

import numpy as np

from cmoe_jax.data import calibration_windows, load_text_tokens
from cmoe_jax.errors import CmoeError
from cmoe_jax.export.hf_config import ExportError

LOGIT_TOLERANCE = 1e-3


def verification_windows(source, calib: str, split: str, data_path, samples: int,
                         seqlen: int, seed: int) -> np.ndarray:
    """[samples, seqlen] token windows of the calibration text (checked before any export);
    `source` is the job's `cmoe_jax.jobs.SourceModel`."""
    cfg = source.config
    if seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {seqlen} exceeds the model's context ({cfg.max_position_embeddings})")
    tokenizer = source.require_tokenizer("the verification text cannot be tokenized",
                                         "; pass --calib-samples 0 to export without the check")
    tokens = load_text_tokens(calib, tokenizer, split=split, data_path=data_path)
    return calibration_windows(tokens, samples, seqlen, seed, flag="--calib-samples")


def require_match(check: dict) -> dict:
    """`check` (from `compare_with_transformers`) when the exported logits match ours within
    the tolerance (or the check was skipped); else an ExportError, so nothing is published."""
    if "skipped" in check:
        return check
    allowed = LOGIT_TOLERANCE * max(1.0, check["max_abs_logit"])
    check = dict(check, tolerance=allowed)
    if not check["max_abs_logit_diff"] <= allowed:
        raise ExportError(f"the exported model's logits differ from ours by up to "
                          f"{check['max_abs_logit_diff']:.3g} (tolerance {allowed:.3g}): the export "
                          "is wrong and was not published; rerun without --resume")
    return check


def _nll(logits: np.ndarray, tokens: np.ndarray) -> float:
    logits = logits[:, :-1].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logz = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    gold = np.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return float((logz - gold).mean())


def compare_with_transformers(model, directory, windows: np.ndarray) -> dict:
    """{max_abs_logit_diff, max_abs_logit, perplexity_ours, perplexity_transformers, windows,
    seqlen}, or
    {skipped: why} when torch is not installed."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return {"skipped": "torch is not installed (pip install -e '.[reference]')"}
    ref = AutoModelForCausalLM.from_pretrained(str(directory), trust_remote_code=True,
                                               dtype=torch.float32).eval()
    diff, scale, nll_ours, nll_ref = 0.0, 0.0, [], []
    for w in windows:
        ours = np.asarray(model(w[None].astype(np.int32)), np.float32)
        with torch.no_grad():
            theirs = ref(torch.from_numpy(w[None].astype(np.int64))).logits.float().numpy()
        diff = max(diff, float(np.abs(ours - theirs).max()))
        scale = max(scale, float(np.abs(ours).max()))
        nll_ours.append(_nll(ours, w[None]))
        nll_ref.append(_nll(theirs, w[None]))
    return {"max_abs_logit_diff": diff, "max_abs_logit": scale, "perplexity_ours": float(np.exp(np.mean(nll_ours))),
            "perplexity_transformers": float(np.exp(np.mean(nll_ref))),
            "windows": int(windows.shape[0]), "seqlen": int(windows.shape[1])}
