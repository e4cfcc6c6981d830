"""The settings of a fine-tuning job, as one object (what `python -m cmoe_jax.train` builds)."""
from __future__ import annotations

import dataclasses

from cmoe_jax.train.lora import DEFAULT_TARGETS


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """A fine-tuning job's settings (what the CLI's flags build): data, LoRA, optimiser,
    schedule and mesh. `mesh_shape = (data, model)`; None: every device on "data"."""

    dataset: str = "wikitext2"
    data_path: str | None = None
    split: str = "train"
    samples: int = 2048
    seqlen: int = 2048
    batch_size: int = 1
    lora_rank: int = 8
    lora_alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple | str = DEFAULT_TARGETS
    lr: float = 5.95e-5
    router_lr: float = 1e-3
    bias_speed: float = 1e-3
    epochs: int = 1
    seed: int = 0
    save_every: int = 100
    max_steps: int | None = None
    max_minutes: float | None = None
    mesh_shape: tuple | None = None
    expert_parallel: int = 1
    remat: bool = False
    dtype: str = "float32"
    # distillation from the dense teacher (`cmoe_jax.train.distill`)
    distill: bool = False
    teacher: str | None = None  # None: the converted model's source
    kd_temperature: float = 1.0
    kd_weight: float = 1.0
    kd_top_k: int | None = None
    hidden_weight: float = 0.0
    # layer-wise reconstruction before the global training (`cmoe_jax.train.layerwise`)
    recover: str | None = None
    recover_samples: int = 16
    recover_steps: int = 200
    recover_lr: float = 1e-3

    @classmethod
    def split_options(cls, options: dict) -> tuple["TrainJob", dict]:
        """(the job of the settings among `options`, the rest): for callers holding one dict."""
        names = {f.name for f in dataclasses.fields(cls)}
        return (cls(**{k: v for k, v in options.items() if k in names}),
                {k: v for k, v in options.items() if k not in names})
