"""The steps of one fine-tuning run, in the order the training job (`api.py`) takes them:
check, open the source, read the data and build the mesh, set up the train state, train,
then merge and write the output.

`FineTuning` carries what one step hands the next (source, data, mesh, state), so each step
is a short method; nothing here touches the output directory's lock or staging (`api.py`).
"""
from __future__ import annotations

import time
from pathlib import Path

from cmoe_jax import distributed
from cmoe_jax.jobs import SourceModel, fault_point
from cmoe_jax.train.run_checkpoints import RunCheckpoints, lora_saved, lora_state, save_adapters
from cmoe_jax.train.recovery import RecoveryModes
from cmoe_jax.train.run_checks import check_finite, check_model, check_settings, training_mesh
from cmoe_jax.train.run_record import run_settings, run_summary
from cmoe_jax.train.settings import TrainSettings


class FineTuning:
    """One fine-tuning run under `settings` (checked here), step by step."""

    def __init__(self, settings: TrainSettings):
        self.t_start = time.perf_counter()
        self.settings = settings
        self.modes = RecoveryModes.of(settings)  # --distill / --recover checked before anything is read
        self.lora = settings.lora.parsed()
        self.lora.validate()
        check_settings(settings)

    def open(self, source: SourceModel) -> None:
        """The source model, checked before any weight is loaded."""
        self.name, self.source = source.name, source
        self.adapted = check_model(source.config, self.settings, self.lora)

    def read_data(self) -> None:
        """Tokenizer, teacher checks, training windows and batch order (output locked)."""
        from cmoe_jax.data import load_text_tokens
        from cmoe_jax.train.data import BatchOrder, training_windows

        s = self.settings
        self.tokenizer = self.source.require_tokenizer("the training text cannot be tokenized")
        self.mode_settings = self.modes.open(self.source, self.tokenizer)  # the teacher fits, or one line
        self.tokens = load_text_tokens(s.dataset, self.tokenizer, split=s.split, data_path=s.data_path)
        self.windows = training_windows(self.tokens, s.samples, s.seqlen, s.seed,
                                        name=f"{s.dataset} ({s.data_path or s.split})")
        self.order = BatchOrder(s.samples, s.batch_size, s.epochs, s.seed)

    def build_mesh(self, devices) -> None:
        """The mesh over all processes' devices, checked against the batch and the experts."""
        self.mesh = training_mesh(self.settings, self.source.config, devices)

    def run_settings(self) -> dict:
        """The settings that decide the trajectory (run_config.json, the fingerprint)."""
        return run_settings(self)

    def set_up(self, staging: Path, resume: bool, progress: bool) -> None:
        """Load (and recover) the model, the train state (resumed from the latest checkpoint
        under `staging`), the compiled step."""
        import jax
        import jax.numpy as jnp

        from cmoe_jax.train.step import init_state, lm_loss, make_train_step, split_frozen

        s, modes, mesh, lora = self.settings, self.modes, self.mesh, self.lora
        self.lm = self.source.load(dtype=getattr(jnp, s.dtype), mesh=mesh, progress=progress)
        modes.load_teacher(getattr(jnp, s.dtype), mesh, progress)
        self.lm.model = modes.recover_model(self.lm.model, self.windows, lora, s.seed, staging, progress)
        state, shardings, tx = init_state(self.lm.model, lora, s.optim, jax.random.key(s.seed), mesh)
        graphdef, frozen, frozen_sh = split_frozen(self.lm.model, mesh)
        self.frozen, frozen_sh, objective = modes.objective(graphdef, frozen, frozen_sh, lora, s.remat, mesh)
        step_fn = make_train_step(objective or lm_loss(graphdef, lora, s.remat), tx, shardings, frozen_sh,
                                  mesh, seed=s.seed, bias_speed=s.optim.bias_speed)
        self.checkpoints = RunCheckpoints(staging / "checkpoints")
        self.log, self.start = [], 0
        latest = self.checkpoints.latest_step() if resume else None
        if latest is not None:
            like = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                state, shardings)
            saved, meta = self.checkpoints.restore(latest, lora_saved(like))
            state = lora_state(saved)
            self.log, self.start = meta["log"], int(meta["position"]["step"])
        self.state, self.saved_at = state, latest
        self.total = self.order.total_steps if s.max_steps is None else min(self.order.total_steps, s.max_steps)
        t_compile = time.perf_counter()
        with jax.set_mesh(mesh):  # an "expert" axis makes the MoE layers run expert-parallel
            self.compiled = (step_fn.lower(state, self.frozen, self._batch(min(self.start, self.total - 1)))
                             .compile() if self.total else None)
        self.compile_seconds = time.perf_counter() - t_compile

    def _batch(self, step: int):
        """Batch `step`: each process builds only the rows its devices hold."""
        import jax

        from cmoe_jax.train.step import batch_sharding

        rows = self.windows[self.order.indices(step)]
        return jax.make_array_from_callback(rows.shape, batch_sharding(self.mesh), lambda index: rows[index])

    def train(self, progress: bool, stop_after_steps: int | None) -> str:
        """The step loop (`cmoe_jax.train.loop`); DONE, OUT_OF_TIME or STOPPED."""
        from cmoe_jax.train.loop import TrainLoop, finite_loss

        s, tokens_per_step = self.settings, self.settings.batch_size * self.settings.seqlen

        def step(i: int) -> dict:
            t0 = time.perf_counter()
            self.state, loss, _ = self.compiled(self.state, self.frozen, self._batch(i))
            loss = finite_loss(float(loss), i + 1, "lower --lr / --router-lr")
            dt = time.perf_counter() - t0
            return {"step": i + 1, "epoch": i // self.order.steps_per_epoch, "loss": loss,
                    "seconds": dt, "tokens_per_s": tokens_per_step / dt}

        def save(n: int) -> None:
            self.checkpoints.save(n, lora_saved(self.state), {"position": self.order.position(n), "log": self.log})
            fault_point("checkpoint")

        def out_of_time(last_seconds: float) -> bool:  # process 0's clock decides for all
            over = time.perf_counter() - self.t_start + last_seconds > s.max_minutes * 60
            return distributed.broadcast_from_main(over)

        loop = TrainLoop(step=step, save=save, save_every=s.save_every, desc="fine-tuning", progress=progress,
                         postfix=lambda r: {"loss": f"{r['loss']:.4f}", "tok_s": f"{r['tokens_per_s']:,.0f}"},
                         out_of_time=None if s.max_minutes is None else out_of_time,
                         stop_after=stop_after_steps)
        how = loop.run(self.log, self.start, self.total, self.saved_at)
        self.checkpoints.close()
        return how

    def summary(self, how: str, settings: dict) -> dict:
        """The run's record (train_log.json without its steps, the command's JSON)."""
        return run_summary(self, how, settings)

    def write_final(self, staging: Path, how: str, settings: dict, manifest: dict) -> dict:
        """The merged model, adapters, checkpoints, run config, log and plot into
        `staging/final` (what is published); returns the summary."""
        import shutil

        from cmoe_jax.checkpoint import save_converted
        from cmoe_jax.models.adapters import merge_adapters
        from cmoe_jax.train.recovery import RECOVER_DIR
        from cmoe_jax.train.report import plot_loss, write_log

        state, lora, s = self.state, self.lora, self.settings
        self.adapters = distributed.to_host((state["trainable"]["lora"], state["trainable"]["u"], state["bias"]))
        adapters, us, bs = self.adapters
        merged = merge_adapters(self.lm.model, adapters, lora.scale, us, bs)
        check_finite(merged)
        summary = self.summary(how, settings)
        manifest["finetune"] = {k: summary[k] for k in (*settings, "steps", "final_loss")}
        final, main = staging / "final", distributed.is_main()
        if main:
            shutil.rmtree(final, ignore_errors=True)
        distributed.barrier("train:final")
        save_converted(merged, manifest, final, tokenizer=self.lm.tokenizer)  # Orbax from all processes
        save_adapters(final / "adapters", adapters, us, bs,
                      {"source_model": str(self.name), "rank": lora.rank, "alpha": lora.alpha,
                       "scale": lora.scale, "dropout": lora.dropout, "targets": list(lora.targets),
                       "steps": len(self.log)})
        if main:
            shutil.move(str(staging / "checkpoints"), str(final / "checkpoints"))
            if (staging / RECOVER_DIR).is_dir():
                shutil.move(str(staging / RECOVER_DIR), str(final / RECOVER_DIR))
            shutil.copy(staging / "run_config.json", final / "run_config.json")
            write_log(final / "train_log.json", summary, self.log)
            plot_loss(final / "loss.png", self.log, title=f"LoRA r={lora.rank} on {Path(str(self.name)).name}")
        return summary
