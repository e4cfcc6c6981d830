"""The calibration text of a job (conversion or compression): a corpus or a local file, cut
into random windows, with the names its fingerprint and its manifest record it under."""
from __future__ import annotations

import dataclasses

import numpy as np

from cmoe_jax.data.text_sources import DataError, load_text_tokens
from cmoe_jax.data.windows import calibration_windows, held_out_windows


@dataclasses.dataclass(frozen=True)
class Calibration:
    """`samples` windows of `seqlen` tokens drawn from `dataset`'s `split` (or `data_path`);
    with `bos`, each opened by BOS as the model's evaluation windows open (the job passes
    `cmoe_jax.loading.window_bos` to `windows`)."""

    dataset: str = "wikitext2"
    split: str = "validation"
    data_path: str | None = None
    samples: int = 8
    seqlen: int = 2048
    bos: bool = False

    def check_bos(self, cfg) -> None:
        """`bos` on a family that reads its evaluation windows as plain text is an error."""
        if self.bos and not cfg.family.bos_per_window:
            raise DataError(f"--calib-bos: a {cfg.model_type} model reads its evaluation windows as plain "
                            "text (no BOS per window); drop --calib-bos")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def tokens(self, tokenizer) -> np.ndarray:
        """The whole text, tokenized."""
        return load_text_tokens(self.dataset, tokenizer, split=self.split, data_path=self.data_path)

    def windows(self, tokens: np.ndarray, seed: int, bos: int | None = None) -> np.ndarray:
        """[samples, seqlen] random windows of `tokens` (a shortage names --calib-samples),
        each opened by `bos` when given."""
        return calibration_windows(tokens, self.samples, self.seqlen, seed, flag="--calib-samples", bos=bos)

    def held_out(self, tokens: np.ndarray, seed: int, limit: int, bos: int | None = None) -> np.ndarray:
        """Up to `limit` windows of `seqlen` tokens that none of `windows(tokens, seed)` touches."""
        return held_out_windows(tokens, self.samples, self.seqlen, seed, limit, bos=bos)

    def settings(self) -> dict:
        """The fields a resume fingerprint records, under the command line's names."""
        opened = {"calib_bos": True} if self.bos else {}  # plain windows: as before the option
        return {"calib": self.dataset, "calib_split": self.split, "data_path": self.data_path,
                "calib_samples": self.samples, "seqlen": self.seqlen, **opened}

    def manifest(self, seed: int, bos: int | None = None) -> dict:
        """The manifest's "calibration" entry (`bos`: the token opening each window, or None)."""
        return {"dataset": self.dataset, "split": self.split, "data_path": self.data_path,
                "samples": self.samples, "seqlen": self.seqlen, "seed": seed, "bos": bos}
