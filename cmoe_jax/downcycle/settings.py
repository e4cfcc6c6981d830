"""The settings of a downcycling job, as one object (what `python -m cmoe_jax.downcycle`
builds from its flags): the initialisation, the E-A-S shape, the text, and the training
(`DowncycleTraining`, the command's "training" flags). Every default is the flag's."""
from __future__ import annotations

import argparse
import dataclasses

from cmoe_jax.cli_args import (check_readable_file, nonneg_float, nonneg_int, nonneg_steps, positive_float,
                               positive_int, seed_int, seqlen_int, step_count)
from cmoe_jax.errors import CmoeError

INITS = ("expertweaver", "random-split", "random")


@dataclasses.dataclass(frozen=True)
class DowncycleTraining:
    """How the woven model is trained: `steps` AdamW steps of `batch_size` windows, peak `lr`
    after `warmup` linear steps (then cosine to 10%), load-balancing weight `aux_coef`, an
    Orbax checkpoint every `save_every` steps."""

    steps: int = 200
    batch_size: int = 2
    lr: float = 4e-4
    warmup: int = 20
    aux_coef: float = 0.01
    save_every: int = 50


@dataclasses.dataclass(frozen=True, kw_only=True)
class DowncycleSettings:
    """A downcycling job's settings. `init`: the expert weights (ExpertWeaver's partition, a
    random neuron split, or random); `experts` N_e per layer, `active` k per token and
    `shared_experts` N_se of those always on (shared included in both, unlike convert's
    --active); `layers`: keep only the first N decoder layers (None: all); `data_path`: the
    WikiText-2 text whose first `calib_tasks` articles are the calibration tasks and whose
    windows of `seqlen` tokens are trained on; `seed`: the weave's, data's and init's."""

    data_path: str
    init: str = "expertweaver"
    experts: int = 64
    active: int = 16
    shared_experts: int = 2
    layers: int | None = None
    calib_tasks: int = 32
    seqlen: int = 256
    seed: int = 0
    training: DowncycleTraining = DowncycleTraining()

    def check(self) -> None:
        """Every check on the settings alone, before any work: the same bounds as the flags'
        types, the shape, and the text file."""
        if self.init not in INITS:
            raise CmoeError(f"--init {self.init!r} must be one of {', '.join(INITS)}")
        t = self.training
        for flag, value, kind in (("--experts", self.experts, positive_int),
                                  ("--active", self.active, positive_int),
                                  ("--shared-experts", self.shared_experts, nonneg_int),
                                  ("--layers", self.layers, positive_int),
                                  ("--calib-tasks", self.calib_tasks, positive_int),
                                  ("--seqlen", self.seqlen, seqlen_int), ("--seed", self.seed, seed_int),
                                  ("--steps", t.steps, step_count), ("--batch-size", t.batch_size, positive_int),
                                  ("--lr", t.lr, positive_float), ("--warmup", t.warmup, nonneg_steps),
                                  ("--aux-coef", t.aux_coef, nonneg_float),
                                  ("--save-every", t.save_every, step_count)):
            if value is not None:
                _as_flag(flag, value, kind)
        if not 0 <= self.shared_experts < self.active <= self.experts:
            raise CmoeError(f"need 0 <= --shared-experts ({self.shared_experts}) < --active ({self.active}) "
                            f"<= --experts ({self.experts})")
        if not self.data_path:
            raise CmoeError("downcycling needs --data-path: the raw WikiText-2 validation file (its "
                            "articles are the calibration tasks, its text the training windows)")
        check_readable_file(self.data_path, "--data-path")

    def record(self) -> dict:
        """The settings as the run records them (train_log.json, the fingerprint a --resume
        is checked against, the result): flat, in the command's flag order, without
        `save_every` (it does not change the run)."""
        t = self.training
        return {"init": self.init, "experts": self.experts, "active": self.active,
                "shared_experts": self.shared_experts, "layers": self.layers, "data_path": self.data_path,
                "calib_tasks": self.calib_tasks, "seqlen": self.seqlen, "steps": t.steps,
                "batch_size": t.batch_size, "lr": float(t.lr), "warmup": t.warmup,
                "aux_coef": float(t.aux_coef), "seed": self.seed}


def _as_flag(flag: str, value, kind) -> None:
    """`value` through the type its flag parses with: one line in the flag's words when the
    command line would have refused it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CmoeError(f"{flag} must be a number, got {value!r}")
    try:
        kind(str(value))
    except argparse.ArgumentTypeError as e:  # worded as the command line's error
        raise CmoeError(f"{flag}{' ' if str(e).startswith('must') else ': '}{e}") from None
