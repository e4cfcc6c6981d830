"""The settings of a fine-tuning job, as one object (what `python -m cmoe_jax.train` builds).

The LoRA, optimiser, distillation and layer-wise settings are the sub-configs `LoRAConfig`,
`OptimConfig`, `DistillConfig` and `RecoverConfig`, held whole (one definition each);
`distill` / `recover` are None when the run does not distil / recover. `from_flags` builds
the settings from the CLI's flat flag names (`lora_rank`, `lr`, `kd_weight`, ...)."""
from __future__ import annotations

import dataclasses

from cmoe_jax.errors import TrainError
from cmoe_jax.train.distill import DistillConfig
from cmoe_jax.train.layerwise import RecoverConfig
from cmoe_jax.train.lora_targets import LoRAConfig
from cmoe_jax.train.step import OptimConfig

# the CLI's flat flag names of the sub-configs' fields: flag -> (settings field, sub-config field)
FLAGS = {
    "lora_rank": ("lora", "rank"), "lora_alpha": ("lora", "alpha"), "dropout": ("lora", "dropout"),
    "targets": ("lora", "targets"),
    "lr": ("optim", "lr"), "router_lr": ("optim", "router_lr"), "bias_speed": ("optim", "bias_speed"),
    "kd_temperature": ("distill", "temperature"), "kd_weight": ("distill", "kd_weight"),
    "kd_top_k": ("distill", "top_k"), "hidden_weight": ("distill", "hidden_weight"),
    "recover_samples": ("recover", "samples"), "recover_steps": ("recover", "steps"),
    "recover_lr": ("recover", "lr"),
}
SUB_CONFIGS = {"lora": LoRAConfig, "optim": OptimConfig, "distill": DistillConfig, "recover": RecoverConfig}


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """A fine-tuning job's settings (what the CLI's flags build): data, LoRA, optimiser,
    schedule, mesh and recovery. `mesh_shape = (data, model)`; None: every device on "data".
    `lora.targets` may be a comma-separated string; `FineTuning` parses it."""

    dataset: str = "wikitext2"
    data_path: str | None = None
    split: str = "train"
    samples: int = 2048
    seqlen: int = 2048
    batch_size: int = 1
    lora: LoRAConfig = LoRAConfig()
    optim: OptimConfig = OptimConfig()
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
    distill: DistillConfig | None = None  # distillation from the dense teacher (`--distill`)
    teacher: str | None = None  # None: the converted model's source
    recover: RecoverConfig | None = None  # layer-wise reconstruction first (`--recover layerwise`)

    def __post_init__(self):
        for name, kind in (("distill", DistillConfig), ("recover", RecoverConfig)):
            if not isinstance(getattr(self, name), (kind, type(None))):
                raise TrainError(f"TrainSettings.{name} is a {kind.__name__} or None, got "
                                 f"{getattr(self, name)!r} (TrainSettings.from_flags reads the flag)")

    @classmethod
    def from_flags(cls, **flags) -> "TrainSettings":
        """The settings of the CLI's flat names: `distill` a bool, `recover` None or
        "layerwise", the sub-configs' fields by their flag names (`FLAGS`); a whole
        sub-config may be given too (its fields then replaced by the flags given)."""
        sub = {name: {} for name in SUB_CONFIGS}
        for flag, (name, field) in FLAGS.items():
            if flag in flags:
                sub[name][field] = flags.pop(flag)
        distill, recover = flags.pop("distill", None), flags.pop("recover", None)
        if recover not in (None, "layerwise") and not isinstance(recover, RecoverConfig):
            raise TrainError(f"--recover must be 'layerwise', got {recover!r}")
        whole = {"lora": flags.pop("lora", LoRAConfig()), "optim": flags.pop("optim", OptimConfig()),
                 "distill": DistillConfig() if distill is True else distill or None,
                 "recover": RecoverConfig() if recover == "layerwise" else recover}
        return cls(**flags, **{name: config if config is None else dataclasses.replace(config, **sub[name])
                               for name, config in whole.items()})

    @classmethod
    def split_options(cls, options: dict) -> tuple["TrainSettings", dict]:
        """(the settings among `options`, given by the CLI's flat names as `from_flags`
        takes them; the rest): for callers holding one dict."""
        names = {f.name for f in dataclasses.fields(cls)} | set(FLAGS)
        return (cls.from_flags(**{k: v for k, v in options.items() if k in names}),
                {k: v for k, v in options.items() if k not in names})
