"""`python -m cmoe_jax.downcycle ...`: weave a dense model into an E-A-S MoE with softmax
routers (ExpertWeaver, a random neuron split, or random expert weights) and train all of it.

The job behind the command (`cmoe_jax.downcycle` is its entry point): the objective is
ExpertWeaver's (`cmoe_jax.methods.expertweaver`), the train state, checkpoints and step loop
are the training package's, shared with fine-tuning.

Work happens in `DIR.partial/final/` (Orbax checkpoints every --save-every steps; --resume
continues from the latest when the source and settings are unchanged); at the end it is
renamed to DIR, which holds train_log.json, loss.png and the checkpoints. The job skeleton
(`cmoe_jax.jobs.run_job`) runs it, as every other output-writing job.
"""
from __future__ import annotations

import json
from pathlib import Path

from cmoe_jax.cli_args import (Parser, add_data_path, add_model, add_output_dir, add_seed, add_seqlen,
                               check_readable_file, check_writable_dir, nonneg_float, nonneg_int, nonneg_steps, command_main,
                               positive_float, positive_int, step_count)
from cmoe_jax.errors import CmoeError
from cmoe_jax.jobs import Job, JobRun, Outcome, RunOptions, SourceModel, fault_point, run_job

INITS = ("expertweaver", "random-split", "random")


EXAMPLE = ("{prog} --model smollm2 --init expertweaver --experts 64 --active 16 --shared-experts 2 "
           "--data-path wikitext-2/wiki.valid.raw --steps 200 --out out/downcycled")


def build_parser(prog: str = "python -m cmoe_jax.downcycle") -> Parser:
    p = Parser(prog, __doc__.split("\n")[0], EXAMPLE.format(prog=prog))
    add_model(p, what="dense model to weave")
    p.add_argument("--init", choices=INITS, default="expertweaver",
                   help="expert weights: ExpertWeaver's partition, a random neuron split, or random")
    moe = p.add_argument_group("experts", "every layer: --experts in all, --active of them per "
                                          "token, --shared-experts of those always on")
    moe.add_argument("--experts", type=positive_int, default=64, help="N_e, experts per layer (shared included)")
    moe.add_argument("--active", type=positive_int, default=16,
                     help="k, experts per token, shared included (unlike convert's --active, which "
                          "counts routed experts only)")
    moe.add_argument("--shared-experts", type=nonneg_int, default=2, help="N_se, shared experts per layer")
    moe.add_argument("--layers", type=positive_int, help="keep only the first N decoder layers (a small "
                                                         "config for CPU runs; default: all)")
    data = p.add_argument_group("data", "WikiText-2 text for calibration tasks and training")
    add_data_path(data, required=True)
    data.add_argument("--calib-tasks", type=positive_int, default=32, help="WikiText-2 articles used as tasks")
    add_seqlen(p, 256)
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=step_count, default=200, help="optimiser steps")
    train.add_argument("--batch-size", type=positive_int, default=2, help="windows per step")
    train.add_argument("--lr", type=positive_float, default=4e-4, help="peak learning rate")
    train.add_argument("--warmup", type=nonneg_steps, default=20, help="linear warm-up steps")
    train.add_argument("--aux-coef", type=nonneg_float, default=0.01, help="lambda of the load-balancing loss")
    train.add_argument("--save-every", type=step_count, default=50, help="checkpoint every N steps")
    add_seed(p)
    add_output_dir(p, "train_log.json, loss.png and the checkpoints",
                   "continue from the latest checkpoint in OUT.partial")
    return p


def parse_args(argv=None, prog: str = "python -m cmoe_jax.downcycle"):
    return build_parser(prog).parse_args(argv)


def initial_model(args, source: SourceModel):
    """The dense model woven per --init (every FFN a MoEFFN with a "linear" router)."""
    import jax.numpy as jnp

    from cmoe_jax.methods.expertweaver import (TaskCalibration, WeaveConfig, calibration_tasks,
                                               randomize_experts, weave_model)

    source.require_tokenizer("the calibration and training text cannot be tokenized")
    lm = source.load(dtype=jnp.float32, progress=False)
    dense = lm.model if args.layers is None else first_layers(lm.model, args.layers)
    cc = WeaveConfig(experts=args.experts, sparsity=1 - args.active / args.experts,
                     n_shared=args.shared_experts, router="linear", seed=args.seed,
                     random_split=args.init == "random-split")
    windows, ids, _ = calibration_tasks(lm.tokenizer, TaskCalibration(args.data_path, None, args.calib_tasks, 1,
                                                                      args.seqlen))
    model, _ = weave_model(dense, windows, ids, cc, progress=False)
    if args.init == "random":  # same shapes, expert/shared/router weights drawn afresh
        model = randomize_experts(model, args.seed)
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
    checkpointed in `final/checkpoints` (kept there for --resume and published with the log)."""

    kind, resumable, fresh_final = "downcycle", ("final/checkpoints/[0-9]*",), False
    manifest_name = None  # no manifest: `save` writes train_log.json, the run's record

    def __init__(self, args):
        self.args = args
        self.settings = {k: v for k, v in vars(args).items()
                         if k not in ("resume", "overwrite", "save_every", "out", "given")}

    def prepare(self, source: SourceModel) -> tuple[dict, object]:
        import numpy as np

        return self.settings, np.fromfile(self.args.data_path, dtype=np.uint8)  # the text by content

    def work(self, run: JobRun) -> Outcome:
        run.final.mkdir(exist_ok=True)
        log = _train(self.args, run.source, run.final / "checkpoints")
        summary = dict(self.settings, steps=len(log), first_nll=log[0]["nll"], final_nll=log[-1]["nll"])
        return Outcome(None, summary, extra=log)

    def save(self, run: JobRun, outcome: Outcome) -> None:
        """The log and the loss plot beside the checkpoints."""
        from cmoe_jax.train.report import plot_loss, write_log

        write_log(run.final / "train_log.json", outcome.manifest, outcome.extra)
        plot_loss(run.final / "loss.png", [dict(s, loss=s["nll"]) for s in outcome.extra],
                  title=f"downcycling, {self.args.init} init")

    def result(self, outcome: Outcome, out: Path) -> dict:
        return dict(outcome.manifest, out=str(out))


def run(args) -> dict:
    from cmoe_jax import distributed

    distributed.require_single_process("python -m cmoe_jax.downcycle")
    if not 0 <= args.shared_experts < args.active <= args.experts:
        raise CmoeError(f"need 0 <= --shared-experts ({args.shared_experts}) < --active ({args.active}) "
                        f"<= --experts ({args.experts})")
    check_readable_file(args.data_path, "--data-path")
    check_writable_dir(args.out)
    return run_job(DowncycleJob(args), args.model, args.out,
                   RunOptions(resume=args.resume, overwrite=args.overwrite))


def _train(args, source: SourceModel, directory: Path) -> list:
    """Weave, then train with checkpoints in `directory`; returns the log."""
    from cmoe_jax.data import load_text_tokens
    from cmoe_jax.methods.expertweaver import downcycle_loss, downcycle_optimizer
    from cmoe_jax.train.checkpoint import RunCheckpoints
    from cmoe_jax.train.data import BatchOrder, training_windows
    from cmoe_jax.train.full import FullTrainer
    from cmoe_jax.train.loop import TrainLoop, finite_loss

    model, tokenizer = initial_model(args, source)
    tokens = load_text_tokens("wikitext2", tokenizer, data_path=args.data_path)
    samples = args.steps * args.batch_size
    windows = training_windows(tokens, samples, args.seqlen, args.seed + 1, asked="--steps x --batch-size =")
    order = BatchOrder(samples, args.batch_size, 1, args.seed)
    trainer = FullTrainer(model, downcycle_optimizer(args.lr, args.steps, args.warmup),
                          lambda m, t: downcycle_loss(m, t, args.aux_coef), metrics=("nll", "aux"))
    checkpoints = RunCheckpoints(directory)
    log = trainer.restore(checkpoints) if args.resume else []

    def save(step: int) -> None:
        trainer.save(checkpoints, log)
        fault_point("checkpoint")

    def step(i: int) -> dict:
        record = trainer.train_step(windows[order.indices(i)])
        finite_loss(record["loss"], i + 1, "lower --lr or --aux-coef")
        return record

    loop = TrainLoop(step=step, save=save,
                     save_every=args.save_every, postfix=lambda r: {"loss": f"{r['nll']:.3f}"},
                     desc=f"downcycling ({args.init})")
    loop.run(log, len(log), args.steps, checkpoints.latest_step())
    checkpoints.close()
    return log


def report(args, result: dict) -> None:
    print(json.dumps({k: result[k] for k in ("out", "steps", "first_nll", "final_nll")}, indent=1))


def main(argv=None, prog: str = "python -m cmoe_jax.downcycle") -> int:
    return command_main(parse_args, run, report, argv, prog)

