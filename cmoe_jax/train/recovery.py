"""The recovery modes a fine-tuning job adds to LoRA on the next-token loss: distillation
from the dense teacher (`--distill`) and layer-wise reconstruction (`--recover layerwise`),
alone or together (layer-wise first, then the global training on the recovered model).

`RecoveryModes.of(job)` checks the flags before anything is loaded; `open` checks the
teacher (vocabulary, tokenizer, shape) and returns the settings that go into the run's
fingerprint, the teacher's identity among them; `recover` and `objective` are the two
steps of the run that differ from plain LoRA.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from cmoe_jax.errors import TrainError
from cmoe_jax.jobs import SourceModel, fault_point
from cmoe_jax.train.distill import DistillConfig
from cmoe_jax.train.settings import TrainSettings
from cmoe_jax.train.layerwise import RecoverConfig
from cmoe_jax.train.teacher import open_teacher, teacher_identity, teacher_name

RECOVER_DIR = "recover"  # the layer-wise adapters, in the staging directory and the output


@dataclasses.dataclass
class RecoveryModes:
    distill: DistillConfig | None
    recover: RecoverConfig | None
    teacher_arg: str | None
    teacher: SourceModel | None = None
    teacher_model: object = None
    memory: dict = dataclasses.field(default_factory=dict)
    records: list = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, job: TrainSettings) -> "RecoveryModes":
        distill, recover = job.distill, job.recover
        if distill:
            distill.validate()
        elif job.teacher:
            raise TrainError("--teacher names the model to distil from: add --distill or "
                             "--recover layerwise")
        if recover:
            recover.validate(job.samples)
        if job.max_steps == 0 and not recover:
            raise TrainError("--max-steps 0 (no global training) needs --recover layerwise")
        return cls(distill, recover, job.teacher)

    @property
    def needs_teacher(self) -> bool:
        return self.distill is not None or self.recover is not None

    def open(self, source: SourceModel, tokenizer) -> dict:
        """Check the teacher against the student; the settings this adds to the run."""
        if not self.needs_teacher:
            return {}
        name = teacher_name(Path(source.path), source.name, self.teacher_arg)
        self.teacher = open_teacher(name, source, tokenizer)
        extra = {"teacher": name, "teacher_files": teacher_identity(self.teacher)}
        if self.distill:
            extra["distill"] = self.distill.settings()
        if self.recover:
            extra["recover"] = self.recover.settings()
        return extra

    def load_teacher(self, dtype, mesh, progress: bool):
        if self.needs_teacher:
            self.teacher_model = self.teacher.load(dtype=dtype, mesh=mesh, progress=progress).model

    def recover_model(self, model, windows, lora, seed: int, staging: Path, progress: bool):
        """The student with its layer-wise adapters merged (fitted now, or read back from the
        staging directory of the interrupted run being resumed); `model` without `--recover`."""
        if not self.recover:
            return model
        import jax

        from cmoe_jax import distributed
        from cmoe_jax.train.run_checkpoints import load_adapters, save_adapters
        from cmoe_jax.train.layerwise import layerwise_recover
        from cmoe_jax.models.adapters import merge_adapters

        saved = Path(staging) / RECOVER_DIR
        if saved.is_dir():
            fitted, config = load_adapters(saved)
            adapters, us, self.records = fitted["lora"], fitted["u"], config["layers"]
        else:
            adapters, us, self.records = layerwise_recover(
                model, self.teacher_model, windows[:self.recover.samples], lora, self.recover,
                jax.random.key(seed + 1), progress=progress)
            tmp = saved.with_name(RECOVER_DIR + ".tmp")
            if distributed.is_main():
                shutil.rmtree(tmp, ignore_errors=True)
            save_adapters(tmp, adapters, us, {}, {"scale": lora.scale, "layers": self.records})
            if distributed.is_main():
                tmp.rename(saved)  # whole or not at all
            fault_point("recover")
        if not self.distill:
            self.teacher_model = None  # not needed by the global training
        return merge_adapters(model, adapters, lora.scale, us, None)

    def objective(self, graphdef, frozen, frozen_sh, lora, remat: bool, mesh):
        """(frozen weights, their shardings, the step's loss or None for the LM loss)."""
        if not self.distill:
            return frozen, frozen_sh, None
        import jax

        from cmoe_jax.sharding import placed_split
        from cmoe_jax.train.distill import distill_loss
        from cmoe_jax.train.teacher import SharedTeacher

        t_graphdef, t_state = placed_split(self.teacher_model, mesh)
        teacher = SharedTeacher(t_graphdef, t_state, frozen)
        self.teacher_model = t_state = None  # the shared weights now live once, in `frozen`
        self.memory = teacher.memory()
        own_sh = jax.tree.map(lambda a: a.sharding, teacher.own)
        return ({"model": frozen, "teacher": teacher.own},
                {"model": frozen_sh, "teacher": own_sh},
                distill_loss(graphdef, teacher, lora, self.distill, remat))
