"""The downcycling job: weave a dense model into an E-A-S MoE with softmax routers
(ExpertWeaver, a random neuron split, or random expert weights) and train all of it.

The objective is ExpertWeaver's (`cmoe_jax.methods.expertweaver`); the train state,
checkpoints and step loop are the training package's, shared with fine-tuning. The job
skeleton (`cmoe_jax.jobs.run_job`) runs it, as every other output-writing job: work happens
in `OUT.partial/final/` (Orbax checkpoints every `save_every` steps; a resume continues from
the latest when the source and settings are unchanged); at the end it is renamed to OUT,
which holds train_log.json, loss.png and the checkpoints.
"""
from __future__ import annotations

from pathlib import Path

from cmoe_jax.downcycle.settings import DowncycleSettings
from cmoe_jax.errors import CmoeError
from cmoe_jax.faults import fault_point
from cmoe_jax.jobs import Job, JobRun, Outcome, SourceModel


def initial_model(settings: DowncycleSettings, source: SourceModel):
    """The dense model woven per `settings.init` (every FFN a MoEFFN with a "linear" router)."""
    import jax.numpy as jnp

    from cmoe_jax.methods.expertweaver import (TaskCalibration, WeaveConfig, calibration_tasks,
                                               randomize_experts, weave_model)

    s = settings
    source.require_tokenizer("the calibration and training text cannot be tokenized")
    lm = source.load(dtype=jnp.float32, progress=False)
    dense = lm.model if s.layers is None else first_layers(lm.model, s.layers)
    cc = WeaveConfig(experts=s.experts, sparsity=1 - s.active / s.experts,
                     n_shared=s.shared_experts, router="linear", seed=s.seed,
                     random_split=s.init == "random-split")
    windows, ids, _ = calibration_tasks(lm.tokenizer, TaskCalibration(s.data_path, None, s.calib_tasks, 1,
                                                                      s.seqlen))
    model, _ = weave_model(dense, windows, ids, cc, progress=False)
    if s.init == "random":  # same shapes, expert/shared/router weights drawn afresh
        model = randomize_experts(model, s.seed)
    return model, lm.tokenizer


def first_layers(model, n: int):
    """The decoder cut to its first `n` layers (embeddings, final norm and head kept)."""
    import dataclasses

    from cmoe_jax.models import Decoder
    from flax import nnx

    from cmoe_jax.models.stack import layered_state

    if not 1 <= n <= model.config.num_layers:
        raise CmoeError(f"--layers {n} must be between 1 and {model.config.num_layers}")
    cfg = dataclasses.replace(model.config, num_layers=n)
    pure = nnx.to_pure_dict(layered_state(model))
    pure["layers"] = {i: pure["layers"][i] for i in range(n)}
    return Decoder.from_pure(cfg, pure, model.dtype)


class DowncycleJob(Job):
    """A downcycling run as a job (`cmoe_jax.jobs.run_job`): its units of work are the steps,
    checkpointed in `final/checkpoints` (kept there for a resume and published with the log)."""

    kind, resumable, fresh_final = "downcycle", ("final/checkpoints/[0-9]*",), False
    manifest_name = None  # no manifest: `save` writes train_log.json, the run's record

    def __init__(self, settings: DowncycleSettings):
        self.settings = settings

    def check(self) -> None:
        self.settings.check()

    def prepare(self, source: SourceModel) -> tuple[dict, object]:
        import numpy as np

        self.record = {"model": source.name, **self.settings.record()}
        return self.record, np.fromfile(self.settings.data_path, dtype=np.uint8)  # the text by content

    def work(self, run: JobRun) -> Outcome:
        run.final.mkdir(exist_ok=True)
        log = train(self.settings, run.source, run.final / "checkpoints", run.options)
        summary = dict(self.record, steps=len(log), first_nll=log[0]["nll"], final_nll=log[-1]["nll"])
        return Outcome(None, summary, extra=log)

    def save(self, run: JobRun, outcome: Outcome) -> None:
        """The log and the loss plot beside the checkpoints."""
        from cmoe_jax.train.report import plot_loss, write_log

        write_log(run.final / "train_log.json", outcome.manifest, outcome.extra)
        plot_loss(run.final / "loss.png", [dict(s, loss=s["nll"]) for s in outcome.extra],
                  title=f"downcycling, {self.settings.init} init")

    def result(self, outcome: Outcome, out: Path) -> dict:
        return dict(outcome.manifest, out=str(out))


def train(settings: DowncycleSettings, source: SourceModel, directory: Path, options) -> list:
    """Weave, then train with checkpoints in `directory` (continuing from the latest with
    `options.resume`); returns the log."""
    from cmoe_jax.data import load_text_tokens
    from cmoe_jax.methods.expertweaver import downcycle_loss, downcycle_optimizer
    from cmoe_jax.train.run_checkpoints import RunCheckpoints
    from cmoe_jax.train.data import BatchOrder, training_windows
    from cmoe_jax.train.full import FullTrainer
    from cmoe_jax.train.loop import TrainLoop, finite_loss

    s, t = settings, settings.training
    model, tokenizer = initial_model(s, source)
    tokens = load_text_tokens("wikitext2", tokenizer, data_path=s.data_path)
    samples = t.steps * t.batch_size
    windows = training_windows(tokens, samples, s.seqlen, s.seed + 1, asked="--steps x --batch-size =")
    order = BatchOrder(samples, t.batch_size, 1, s.seed)
    trainer = FullTrainer(model, downcycle_optimizer(t.lr, t.steps, t.warmup),
                          lambda m, tok: downcycle_loss(m, tok, t.aux_coef), metrics=("nll", "aux"))
    checkpoints = RunCheckpoints(directory)
    log = trainer.restore(checkpoints) if options.resume else []

    def save(step: int) -> None:
        trainer.save(checkpoints, log)
        fault_point("checkpoint")

    def step(i: int) -> dict:
        record = trainer.train_step(windows[order.indices(i)])
        finite_loss(record["loss"], i + 1, "lower --lr or --aux-coef")
        return record

    loop = TrainLoop(step=step, save=save, save_every=t.save_every,
                     postfix=lambda r: {"loss": f"{r['nll']:.3f}"}, desc=f"downcycling ({s.init})",
                     progress=options.progress)
    loop.run(log, len(log), t.steps, checkpoints.latest_step())
    checkpoints.close()
    return log
