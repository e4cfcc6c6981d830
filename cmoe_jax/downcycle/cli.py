"""`python -m cmoe_jax.downcycle ...`: weave a dense model into an E-A-S MoE with softmax
routers (ExpertWeaver, a random neuron split, or random expert weights) and train all of it.

The flags build a `DowncycleSettings`, which `downcycle` (the Python API) runs. Work happens
in `DIR.partial/final/` (Orbax checkpoints every --save-every steps; --resume continues from
the latest when the source and settings are unchanged); at the end it is renamed to DIR,
which holds train_log.json, loss.png and the checkpoints.
"""
from __future__ import annotations

import json

from cmoe_jax.cli_args import (Parser, add_data_path, add_model, add_output_dir, add_seed, add_seqlen, command_main,
                               nonneg_float, nonneg_int, nonneg_steps, positive_float, positive_int, step_count)
from cmoe_jax.downcycle.api import downcycle
from cmoe_jax.downcycle.settings import INITS, DowncycleSettings, DowncycleTraining

PROG = "python -m cmoe_jax.downcycle"
EXAMPLE = ("{prog} --model smollm2 --init expertweaver --experts 64 --active 16 --shared-experts 2 "
           "--data-path wikitext-2/wiki.valid.raw --steps 200 --out out/downcycled")


def build_parser(prog: str = PROG) -> Parser:
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


def parse_args(argv=None, prog: str = PROG):
    return build_parser(prog).parse_args(argv)


def settings_from_args(args) -> DowncycleSettings:
    """The settings the flags describe."""
    return DowncycleSettings(
        init=args.init, experts=args.experts, active=args.active, shared_experts=args.shared_experts,
        layers=args.layers, data_path=args.data_path, calib_tasks=args.calib_tasks, seqlen=args.seqlen,
        seed=args.seed, training=DowncycleTraining(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                                   warmup=args.warmup, aux_coef=args.aux_coef,
                                                   save_every=args.save_every))


def run(args) -> dict:
    return downcycle(args.model, settings_from_args(args), out=args.out, resume=args.resume,
                     overwrite=args.overwrite)


def report(args, result: dict) -> None:
    print(json.dumps({k: result[k] for k in ("out", "steps", "first_nll", "final_nll")}, indent=1))


def main(argv=None, prog: str = PROG) -> int:
    return command_main(parse_args, run, report, argv, prog)
