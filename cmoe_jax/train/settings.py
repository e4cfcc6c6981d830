"""The settings of a fine-tuning job, as one object (what `python -m cmoe_jax.train` builds).

The LoRA, optimiser, distillation and layer-wise defaults are those of `LoRAConfig`,
`OptimConfig`, `DistillConfig` and `RecoverConfig` (one definition each); the settings are
flat, as the CLI's flags."""
from __future__ import annotations

import dataclasses

from cmoe_jax.train.distill import DistillConfig
from cmoe_jax.train.layerwise import RecoverConfig
from cmoe_jax.train.lora_targets import LoRAConfig, parse_targets
from cmoe_jax.train.step import OptimConfig


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """A fine-tuning job's settings (what the CLI's flags build): data, LoRA, optimiser,
    schedule and mesh. `mesh_shape = (data, model)`; None: every device on "data"."""

    dataset: str = "wikitext2"
    data_path: str | None = None
    split: str = "train"
    samples: int = 2048
    seqlen: int = 2048
    batch_size: int = 1
    lora_rank: int = LoRAConfig.rank
    lora_alpha: float = LoRAConfig.alpha
    dropout: float = LoRAConfig.dropout
    targets: tuple | str = LoRAConfig.targets
    lr: float = OptimConfig.lr
    router_lr: float = OptimConfig.router_lr
    bias_speed: float = OptimConfig.bias_speed
    epochs: int = 1
    seed: int = 0
    save_every: int = 100
    max_steps: int | None = None
    max_minutes: float | None = None
    new_data: bool = False  # with --resume on a finished run: continue it on another text
    mesh_shape: tuple | None = None
    expert_parallel: int = 1
    remat: bool = False
    dtype: str = "float32"
    # distillation from the dense teacher (`cmoe_jax.train.distill`)
    distill: bool = False
    teacher: str | None = None  # None: the converted model's source
    kd_temperature: float = DistillConfig.temperature
    kd_weight: float = DistillConfig.kd_weight
    kd_top_k: int | None = DistillConfig.top_k
    hidden_weight: float = DistillConfig.hidden_weight
    # layer-wise reconstruction before the global training (`cmoe_jax.train.layerwise`)
    recover: str | None = None
    recover_samples: int = RecoverConfig.samples
    recover_steps: int = RecoverConfig.steps
    recover_lr: float = RecoverConfig.lr

    def lora(self) -> LoRAConfig:
        """The LoRA settings, targets parsed (unknown names fail here)."""
        return LoRAConfig(rank=self.lora_rank, alpha=float(self.lora_alpha), dropout=float(self.dropout),
                          targets=parse_targets(self.targets))

    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, router_lr=self.router_lr, bias_speed=self.bias_speed)

    @classmethod
    def split_options(cls, options: dict) -> tuple["TrainSettings", dict]:
        """(the settings among `options`, the rest): for callers holding one dict."""
        names = {f.name for f in dataclasses.fields(cls)}
        return (cls(**{k: v for k, v in options.items() if k in names}),
                {k: v for k, v in options.items() if k not in names})
