"""Token windows: non-overlapping evaluation windows and seeded calibration samples."""
from __future__ import annotations

import numpy as np

from cmoe_jax.data.text_sources import DataError


def text_windows(tokens: np.ndarray, seqlen: int, max_windows: int | None = None,
                 name: str = "the dataset") -> np.ndarray:
    """Non-overlapping [N, seqlen] windows from the start of the token stream (rest dropped)."""
    n = len(tokens) // seqlen
    if n == 0:
        raise DataError(f"{name} has {len(tokens)} tokens, fewer than one window of {seqlen}: "
                        "use a longer text or a smaller --seqlen")
    if max_windows is not None:
        n = min(n, max_windows)
    return np.asarray(tokens[: n * seqlen], np.int32).reshape(n, seqlen)


def calibration_windows(tokens: np.ndarray, n_samples: int, seqlen: int, seed: int,
                        name: str = "the calibration data") -> np.ndarray:
    """n_samples windows at random offsets (GPTQ-style sampling, numpy Generator(seed))."""
    if len(tokens) <= seqlen:
        raise DataError(f"{name} has {len(tokens)} tokens, not more than one window of {seqlen}: "
                        "use a longer text or a smaller --seqlen")
    if n_samples < 1:
        raise DataError(f"--calib-samples must be at least 1, got {n_samples}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - seqlen, size=n_samples)
    return np.stack([tokens[s:s + seqlen] for s in starts]).astype(np.int32)
