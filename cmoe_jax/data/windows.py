"""Token windows: non-overlapping evaluation windows and seeded calibration samples."""
from __future__ import annotations

import numpy as np

from cmoe_jax.data.text_sources import C4_WINDOWS, DataError


def _as_tokens(tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise DataError(f"expected a 1-D token stream, got an array of shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"token ids must be integers, got dtype {tokens.dtype}")
    return tokens


def _check_seqlen(seqlen: int) -> None:
    if seqlen < 2:
        raise DataError(f"seqlen must be at least 2 (a window predicts its last seqlen-1 tokens), got {seqlen}")


def text_windows(tokens, seqlen: int, max_windows: int | None = None,
                 name: str = "the dataset", bos: int | None = None) -> np.ndarray:
    """Non-overlapping int32 [N, seqlen] windows from the start of the stream (remainder dropped).

    N = len(tokens) // seqlen, capped at `max_windows` (the first windows are kept). With
    `bos` (a token id; families whose tokenizer adds BOS, as lm-eval's `add_bos_token`)
    every window is that token followed by the next seqlen - 1 tokens of the stream, so each
    window is read as a fresh document (Gemma needs BOS; without it its NLL is far worse).
    """
    tokens = _as_tokens(tokens)
    _check_seqlen(seqlen)
    if max_windows is not None and max_windows < 1:
        raise DataError(f"max_windows must be at least 1, got {max_windows}")
    if bos is not None:
        body = text_windows(tokens, seqlen - 1, max_windows, name) if seqlen > 2 else None
        if body is None:
            raise DataError(f"seqlen must be at least 3 with a BOS token per window, got {seqlen}")
        return np.concatenate([np.full((len(body), 1), bos, np.int32), body], axis=1)
    n = len(tokens) // seqlen
    if n == 0:
        raise DataError(f"{name} has {len(tokens)} tokens, fewer than one window of {seqlen}: "
                        "use a longer text or a smaller --seqlen")
    if max_windows is not None:
        n = min(n, max_windows)
    return np.ascontiguousarray(tokens[: n * seqlen], dtype=np.int32).reshape(n, seqlen)


def eval_windows(tokens, dataset: str, seqlen: int, max_windows: int | None = None,
                 name: str | None = None, bos: int | None = None) -> np.ndarray:
    """The GPTQ evaluation windows of a dataset: all of WikiText-2's, the first 256 of C4's
    (`bos`: a BOS token opening every window, see `text_windows`)."""
    cap = max_windows
    if dataset == "c4":
        cap = C4_WINDOWS if max_windows is None else min(max_windows, C4_WINDOWS)
    return text_windows(tokens, seqlen, cap, name=name or dataset, bos=bos)


def calibration_windows(tokens, n_samples: int, seqlen: int, seed: int,
                        name: str = "the calibration data", flag: str | None = None,
                        bos: int | None = None) -> np.ndarray:
    """`n_samples` int32 [n_samples, seqlen] windows at random start offsets (GPTQ sampling).

    Starts are drawn uniformly from [0, len(tokens) - seqlen - 1] (GPTQ's
    ``random.randint(0, n - seqlen - 1)``) by ``numpy.random.default_rng(seed)``, so a seed
    gives the same windows on every machine; windows may overlap. With `flag` (the command
    line's name for `n_samples`) no more windows are drawn than the text holds side by side:
    more would repeat its tokens and only add time (and a typo such as 100000 would run for
    hours before running out of memory). With `bos` each window is that token followed by
    the first seqlen - 1 tokens at its start (the same starts): shaped as the evaluation
    windows of a family that reads every window as a document (`text_windows`).
    """
    tokens = _as_tokens(tokens)
    _check_seqlen(seqlen)
    if n_samples < 1:
        raise DataError(f"the number of calibration samples must be at least 1, got {n_samples}")
    if len(tokens) <= seqlen:
        raise DataError(f"{name} has {len(tokens)} tokens, not more than one window of {seqlen}: "
                        "use a longer text or a smaller --seqlen")
    if flag is not None and n_samples > len(tokens) // seqlen:
        raise DataError(f"{flag} {n_samples}: {name} has {len(tokens)} tokens, {len(tokens) // seqlen} "
                        f"windows of {seqlen}; give at most that many samples, a longer text or a "
                        "smaller --seqlen")
    starts = _calibration_starts(len(tokens), n_samples, seqlen, seed)
    return _open_with(bos, np.stack([tokens[s:s + seqlen] for s in starts]).astype(np.int32))


def _open_with(bos: int | None, windows: np.ndarray) -> np.ndarray:
    """`windows` [N, seqlen] with `bos` in front of each and its last token dropped (None: as
    they are)."""
    if bos is None:
        return windows
    return np.concatenate([np.full((len(windows), 1), bos, np.int32), windows[:, :-1]], axis=1)


def _calibration_starts(n_tokens: int, n_samples: int, seqlen: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_tokens - seqlen, size=n_samples)


def held_out_windows(tokens, n_samples: int, seqlen: int, seed: int, limit: int,
                     bos: int | None = None) -> np.ndarray:
    """Up to `limit` int32 [N, seqlen] windows of `tokens` that no calibration window of
    (`n_samples`, `seqlen`, `seed`) touches: the aligned windows from the start of the stream,
    in order, skipping each that overlaps one (N may be 0). A choice made on them is made on
    text the conversion did not fit to. `bos`: opened as `calibration_windows` opens them."""
    tokens = _as_tokens(tokens)
    _check_seqlen(seqlen)
    if len(tokens) <= seqlen:
        return np.zeros((0, seqlen), np.int32)
    starts = _calibration_starts(len(tokens), n_samples, seqlen, seed)
    free = [i * seqlen for i in range(len(tokens) // seqlen)
            if not np.any(np.abs(starts - i * seqlen) < seqlen)]
    return _open_with(bos, np.asarray([tokens[s:s + seqlen] for s in free[:limit]], np.int32).reshape(-1, seqlen))


def length_bucket(n: int, limit: int) -> int:
    """Smallest rung >= n of the ladder 16, 24, 32, 40, 48, 64, 80, 96, 128, ... (capped at limit).

    Rungs grow by ~1.25x (rounded up to multiples of 8), so padding wastes at most ~25% while
    a whole ARC-sized task compiles half a dozen shapes.
    """
    rung = 16
    while rung < n:
        rung = -(-int(rung * 1.25) // 8) * 8
    return min(rung, max(limit, n))
