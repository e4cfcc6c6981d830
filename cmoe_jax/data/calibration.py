"""The calibration text of a job (conversion or compression): a corpus or a local file, cut
into random windows, with the names its fingerprint and its manifest record it under."""
from __future__ import annotations

import dataclasses

import numpy as np

from cmoe_jax.data.text_sources import load_text_tokens
from cmoe_jax.data.windows import calibration_windows, held_out_windows


@dataclasses.dataclass(frozen=True)
class Calibration:
    """`samples` windows of `seqlen` tokens drawn from `dataset`'s `split` (or `data_path`)."""

    dataset: str = "wikitext2"
    split: str = "validation"
    data_path: str | None = None
    samples: int = 8
    seqlen: int = 2048

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def tokens(self, tokenizer) -> np.ndarray:
        """The whole text, tokenized."""
        return load_text_tokens(self.dataset, tokenizer, split=self.split, data_path=self.data_path)

    def windows(self, tokens: np.ndarray, seed: int) -> np.ndarray:
        """[samples, seqlen] random windows of `tokens` (a shortage names --calib-samples)."""
        return calibration_windows(tokens, self.samples, self.seqlen, seed, flag="--calib-samples")

    def held_out(self, tokens: np.ndarray, seed: int, limit: int) -> np.ndarray:
        """Up to `limit` windows of `seqlen` tokens that none of `windows(tokens, seed)` touches."""
        return held_out_windows(tokens, self.samples, self.seqlen, seed, limit)

    def settings(self) -> dict:
        """The fields a resume fingerprint records, under the command line's names."""
        return {"calib": self.dataset, "calib_split": self.split, "data_path": self.data_path,
                "calib_samples": self.samples, "seqlen": self.seqlen}

    def manifest(self, seed: int) -> dict:
        """The manifest's "calibration" entry."""
        return {"dataset": self.dataset, "split": self.split, "data_path": self.data_path,
                "samples": self.samples, "seqlen": self.seqlen, "seed": seed}
