"""Fine-tuning data: seeded windows and a deterministic batch order, so a step number alone
says which batch comes next (what makes `--resume` exact)."""
from __future__ import annotations

import numpy as np

from cmoe_jax.cli_args import STEP_MAX
from cmoe_jax.data import calibration_windows
from cmoe_jax.errors import TrainError


def training_windows(tokens, samples: int, seqlen: int, seed: int, name: str = "the dataset",
                     asked: str = "--samples") -> np.ndarray:
    """`samples` windows of `seqlen` tokens at seeded random offsets (GPTQ-style sampling, as
    the CMoE paper's 2,048 WikiText-2 samples). Fails when the text has fewer distinct
    windows than requested samples (`asked`: the flags that ask for them, for the message)."""
    n_tokens = len(tokens)
    distinct = n_tokens - seqlen
    if distinct < samples:
        raise TrainError(f"{name} has {n_tokens} tokens: only {max(distinct, 0)} distinct windows "
                         f"of {seqlen}, fewer than {asked} {samples}; use a longer text, fewer "
                         "samples or a smaller --seqlen")
    return calibration_windows(tokens, samples, seqlen, seed, name=name)


class BatchOrder:
    """Batch `step` = windows of a seeded per-epoch permutation; the remainder of an epoch
    that does not fill a batch is skipped."""

    def __init__(self, num_windows: int, batch_size: int, epochs: int, seed: int):
        if batch_size < 1:
            raise TrainError(f"--batch-size must be at least 1, got {batch_size}")
        if batch_size > num_windows:
            raise TrainError(f"--batch-size {batch_size} exceeds --samples {num_windows}")
        if epochs < 1:
            raise TrainError(f"--epochs must be at least 1, got {epochs}")
        self.num_windows, self.batch_size, self.epochs, self.seed = num_windows, batch_size, epochs, seed
        self.steps_per_epoch = num_windows // batch_size
        self.total_steps = self.steps_per_epoch * epochs
        if self.total_steps > STEP_MAX:
            raise TrainError(f"--epochs {epochs} of {self.steps_per_epoch} steps make {self.total_steps} steps, "
                             f"more than JAX's 32-bit step counter holds ({STEP_MAX}): lower --epochs")

    def indices(self, step: int) -> np.ndarray:
        epoch, pos = divmod(step, self.steps_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return perm[pos * self.batch_size:(pos + 1) * self.batch_size]

    def position(self, step: int) -> dict:
        epoch, pos = divmod(step, self.steps_per_epoch)
        return {"step": step, "epoch": epoch, "batch_in_epoch": pos,
                "windows_seen": step * self.batch_size}
