"""LoRA fine-tuning of dense and converted models (CMoE paper, section 4), and the training
machinery downcycling shares (`RunCheckpoints`, `TrainLoop`, `FullTrainer`).

`finetune` is the job behind `python -m cmoe_jax.train`; the pieces are usable alone:
`init_adapters` / `merge_adapters` (LoRA on q/k/v/o and the gate/up/down projections of
dense, shared and routed-expert MLPs), `with_adapters` (the adapters as variables of the
model, run by its own forward; `cmoe_jax.models.adapters`), `lora_loss` / `lora_logits` on an
`AdapterSet`, `init_state` / `lm_loss` / `make_train_step` (Optax, sharding, one jitted
step); `distill_objective` / `kd_tile` (distillation from the dense teacher, `--distill`)
and `layerwise_recover` (layer-wise reconstruction of the converted FFNs, `--recover layerwise`).
"""
from cmoe_jax.errors import TrainError
from cmoe_jax.models.adapters import AdapterSet, adapted_run, merge_adapters, router_params, with_adapters
from cmoe_jax.sharding import make_mesh
from cmoe_jax.train.api import finetune
from cmoe_jax.train.settings import TrainSettings
from cmoe_jax.train.run_checkpoints import RunCheckpoints, load_adapters
from cmoe_jax.train.distill import DistillConfig, chunked_kd, distill_loss, distill_objective, kd_tile
from cmoe_jax.train.full import FullTrainer
from cmoe_jax.train.layerwise import RecoverConfig, layerwise_recover
from cmoe_jax.train.loop import TrainLoop
from cmoe_jax.train.teacher import SharedTeacher
from cmoe_jax.train.lora_targets import (
    DEFAULT_TARGETS,
    LoRAConfig,
    adapted_weights,
    init_adapters,
    lora_hidden,
    lora_logits,
    lora_loss,
    parse_targets,
)
from cmoe_jax.train.step import OptimConfig, init_state, lm_loss, make_train_step, split_frozen


__all__ = ["finetune", "TrainSettings", "load_adapters", "AdapterSet", "adapted_run", "lora_hidden",
           "lora_logits", "lora_loss", "DistillConfig", "chunked_kd", "distill_loss", "distill_objective",
           "kd_tile", "RecoverConfig", "layerwise_recover", "SharedTeacher", "RunCheckpoints",
           "FullTrainer", "TrainLoop", "DEFAULT_TARGETS", "LoRAConfig", "TrainError", "adapted_weights",
           "init_adapters", "merge_adapters", "parse_targets", "router_params", "with_adapters",
           "OptimConfig", "init_state", "lm_loss", "make_mesh", "make_train_step", "split_frozen"]
