"""`python -m cmoe_jax.downcycle ...`: weave a dense model into an E-A-S MoE with softmax
routers (ExpertWeaver, a random neuron split, or random expert weights) and train all of it.

    python -m cmoe_jax.downcycle --model smollm2 --init expertweaver --experts 64 \\
        --active 16 --shared-experts 2 --data-path valid.txt --steps 200 --out DIR

Work happens in `DIR.partial/final/` (Orbax checkpoints every --save-every steps; --resume
continues from the latest when the source and settings are unchanged); at the end it is
renamed to DIR, which holds train_log.json, loss.png and the checkpoints.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from cmoe_jax.errors import CmoeError, run_job
from cmoe_jax.jobs import JobModel, OutputJob, check_output_free, fault_point, fingerprint

INITS = ("expertweaver", "random-split", "random")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cmoe_jax.downcycle", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--init", choices=INITS, default="expertweaver")
    p.add_argument("--experts", type=int, default=64, help="N_e (shared included)")
    p.add_argument("--active", type=int, default=16, help="k experts per token, shared included")
    p.add_argument("--shared-experts", type=int, default=2, help="N_se in every layer")
    p.add_argument("--data-path", required=True, help="raw WikiText-2 file: calibration and training text")
    p.add_argument("--calib-tasks", type=int, default=32)
    p.add_argument("--layers", type=int, help="keep only the first N decoder layers (a small config for CPU runs)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--aux-coef", type=float, default=0.01, help="lambda of the load-balancing loss")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    return p


def initial_model(args, source: JobModel):
    """The dense model woven per --init (every FFN a MoEFFN with a "linear" router)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cmoe_jax.convert.expertweaver import WeaveConfig, weave_model
    from cmoe_jax.convert.expertweaver_job import calibration_tasks

    source.require_tokenizer("the calibration and training text cannot be tokenized")
    lm = source.load(dtype=jnp.float32, progress=False)
    dense = lm.model if args.layers is None else first_layers(lm.model, args.layers)
    cc = WeaveConfig(experts=args.experts, sparsity=1 - args.active / args.experts,
                     n_shared=args.shared_experts, router="linear", seed=args.seed,
                     random_split=args.init == "random-split")
    windows, ids, _ = calibration_tasks(lm.tokenizer, args.data_path, None, args.calib_tasks, 1, args.seqlen)
    model, _ = weave_model(dense, windows, ids, cc, progress=False)
    if args.init == "random":  # same shapes, expert/shared/router weights drawn afresh
        key = jax.random.key(args.seed)
        for i, layer in enumerate(model.layers):
            for j, (_, var) in enumerate(nnx.to_flat_state(nnx.state(layer.mlp, nnx.Param))):
                value = var.get_value()
                var.set_value(0.02 * jax.random.normal(jax.random.fold_in(key, 1000 * i + j), value.shape,
                                                       value.dtype))
    return model, lm.tokenizer


def first_layers(model, n: int):
    """The decoder cut to its first `n` layers (embeddings, final norm and head kept)."""
    import dataclasses

    from cmoe_jax.models import Decoder
    from cmoe_jax.models.stack import layered_pure

    if not 1 <= n <= model.config.num_layers:
        raise CmoeError(f"--layers {n} must be between 1 and {model.config.num_layers}")
    cfg = dataclasses.replace(model.config, num_layers=n)
    pure = layered_pure(model)
    pure["layers"] = {i: pure["layers"][i] for i in range(n)}
    return Decoder.from_pure(cfg, pure, model.dtype)


def run(args) -> dict:
    from cmoe_jax import distributed

    distributed.require_single_process("python -m cmoe_jax.downcycle")
    from tqdm.auto import tqdm

    from cmoe_jax.data import load_text_tokens
    from cmoe_jax.train.data import BatchOrder, training_windows
    from cmoe_jax.train.downcycle import Downcycler, checkpoint_manager
    from cmoe_jax.train.report import plot_loss, write_log

    if not 0 <= args.shared_experts < args.active <= args.experts:
        raise CmoeError(f"need 0 <= --shared-experts ({args.shared_experts}) < --active ({args.active}) "
                        f"<= --experts ({args.experts})")
    if args.steps < 1 or args.batch_size < 1:
        raise CmoeError("--steps and --batch-size must be at least 1")
    out = Path(args.out)
    settings = {k: v for k, v in vars(args).items() if k not in ("resume", "overwrite", "save_every", "out")}
    check_output_free(out, args.overwrite)
    source = JobModel(args.model)
    with OutputJob(out, "downcycle", overwrite=args.overwrite, resume=args.resume,
                   resumable=("final/checkpoints/[0-9]*",)) as job:
        job.open(fingerprint("downcycle", settings, source.path))
        work = job.staging.dir / "final"
        work.mkdir(exist_ok=True)
        model, tokenizer = initial_model(args, source)
        tokens = load_text_tokens("wikitext2", tokenizer, data_path=args.data_path)
        samples = args.steps * args.batch_size
        windows = training_windows(tokens, samples, args.seqlen, args.seed + 1)
        order = BatchOrder(samples, args.batch_size, 1, args.seed)
        trainer = Downcycler(model, steps=args.steps, lr=args.lr, warmup=args.warmup,
                             aux_coef=args.aux_coef)
        manager = checkpoint_manager(work / "checkpoints")
        log = trainer.restore(manager) if args.resume else []
        bar = tqdm(range(len(log), args.steps), desc=f"downcycling ({args.init})")
        for step in bar:
            log.append(trainer.train_step(windows[order.indices(step)]))
            bar.set_postfix(loss=f"{log[-1]['nll']:.3f}")
            fault_point("step")
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                trainer.save(manager, log)
                fault_point("checkpoint")
        manager.close()
        summary = dict(settings, steps=len(log), first_nll=log[0]["nll"], final_nll=log[-1]["nll"])
        write_log(work / "train_log.json", summary, log)
        plot_loss(work / "loss.png", [dict(s, loss=s["nll"]) for s in log],
                  title=f"downcycling, {args.init} init")
        job.publish(work)
    return dict(summary, out=str(out))


def main(argv=None) -> int:
    result, code = run_job(run, build_parser().parse_args(argv))
    if code:
        return code
    print(json.dumps({k: result[k] for k in ("out", "steps", "first_nll", "final_nll")}, indent=1))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
