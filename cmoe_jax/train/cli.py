"""`python -m cmoe_jax.train`: LoRA fine-tuning of a dense or converted model.

Bad input (unknown LoRA targets, a resume directory from another configuration, a dataset
with fewer windows than --samples, ...) prints one `error: ...` line and exits 2 before
any training step.
"""
from __future__ import annotations

import argparse
import json
import math

from cmoe_jax import distributed
from cmoe_jax.cli_args import (Parser, add_data, add_model, add_output_dir, add_progress, add_seed,
                               add_seqlen, check_writable_dir, command_main, FLOAT32_MAX, nonneg_float, nonneg_steps,
                               number_type, positive_float, positive_int, step_count)
from cmoe_jax.errors import CmoeError
from cmoe_jax.train.api import finetune
from cmoe_jax.train.settings import TrainSettings
from cmoe_jax.train.lora_targets import DEFAULT_TARGETS

EXAMPLE = ("{prog} --model out/s1a1e8 --data-path wikitext-2/wiki.valid.raw --samples 64 "
           "--seqlen 2048 --batch-size 1 --max-minutes 30 --out out/ft")


def build_parser(prog: str = "python -m cmoe_jax.train") -> Parser:
    p = Parser(prog, "LoRA fine-tuning (CMoE paper sec. 4: rank 8, alpha 32, Adam 0.9/0.95, "
                     "lr 5.95e-5 for LoRA and 1e-3 for the router scales u, bias speed 1e-3) of a "
                     "dense or converted model; saves the merged model, the adapters, Orbax "
                     "checkpoints, a JSON log and a loss curve in --out.", EXAMPLE.format(prog=prog))
    add_model(p, None, "model to fine-tune")
    data = add_data(p, "train", "training")
    data.add_argument("--samples", type=positive_int, default=2048, help="training windows")
    add_seqlen(p, 2048)
    p.add_argument("--batch-size", type=positive_int, default=1, help="windows per step")
    lora = p.add_argument_group("LoRA and optimiser")
    lora.add_argument("--lora-rank", type=positive_int, default=8, help="adapter rank r")
    lora.add_argument("--lora-alpha", type=positive_float, default=32.0, help="adapter scale alpha (update alpha/r)")
    lora.add_argument("--dropout", type=dropout_rate, default=0.0, help="LoRA input dropout")
    lora.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                      help="comma-separated weights to adapt: q_proj,k_proj,v_proj,o_proj and "
                           "gate_proj,up_proj,down_proj (dense, shared and routed experts), or exact "
                           "names such as shared_up / expert_down")
    lora.add_argument("--lr", type=positive_float, default=5.95e-5, help="LoRA learning rate")
    lora.add_argument("--router-lr", type=nonneg_float, default=1e-3, help="learning rate of the router scales u")
    lora.add_argument("--bias-speed", type=nonneg_float, default=1e-3, help="load-balancing bias step gamma")
    lora.add_argument("--epochs", type=step_count, default=1, help="passes over the --samples windows")
    add_seed(p)
    add_recovery(p)
    job = p.add_argument_group("run")
    job.add_argument("--save-every", type=step_count, default=100, help="checkpoint every N steps")
    job.add_argument("--max-steps", type=nonneg_steps, default=None,
                     help="stop after N steps (0: none, only the --recover layerwise pass)")
    job.add_argument("--max-minutes", type=positive_float, default=None,
                     help="stop before a step would end past this wall-clock budget (whole job)")
    job.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                     help="device mesh, e.g. 4x2 (default: all devices on the data axis)")
    job.add_argument("--expert-parallel", type=positive_int, default=1, metavar="N",
                     help="split the MoE layers' routed experts over N devices (all-to-all token "
                          "exchange); the mesh becomes data x N x model")
    job.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                     help="dtype of the frozen weights (adapters are float32)")
    job.add_argument("--remat", action="store_true", help="recompute each layer in the backward pass (less memory)")
    add_output_dir(p, "merged model, adapters, checkpoints, log",
                   "continue the run in --out from its last checkpoint")
    p.add_argument("--new-data", action="store_true",
                   help="with --resume on a finished run: continue it on another text (--dataset, "
                        "--split, --data-path), recorded in its log's data_history")
    add_progress(p)
    return p


def add_recovery(p: Parser) -> None:
    kd = p.add_argument_group("recovery from the dense model (distillation, layer-wise)")
    kd.add_argument("--distill", action="store_true",
                    help="train on the KL divergence to the teacher's next-token distribution")
    kd.add_argument("--teacher", default=None, metavar="MODEL",
                    help="model to distil from (default: the converted model's source)")
    kd.add_argument("--kd-temperature", type=kd_temperature, default=1.0, help="softmax temperature T")
    kd.add_argument("--kd-weight", type=unit_weight, default=1.0,
                    help="weight of the KL term; the LM loss gets 1 - weight")
    kd.add_argument("--kd-top-k", type=positive_int, default=None, metavar="K",
                    help="compare only the teacher's K most likely tokens (default: all)")
    kd.add_argument("--hidden-weight", type=nonneg_float, default=0.0,
                    help="weight of per-layer matching of the FFN inputs to the teacher's")
    kd.add_argument("--recover", choices=["layerwise"], default=None,
                    help="first fit each converted FFN's adapters / router scales to the dense "
                         "FFN's output, layer by layer (then the global training)")
    kd.add_argument("--recover-samples", type=positive_int, default=16,
                    help="calibration windows of --recover (the first training windows)")
    kd.add_argument("--recover-steps", type=step_count, default=200, help="Adam steps per layer")
    kd.add_argument("--recover-lr", type=positive_float, default=1e-3, help="layer-wise learning rate")


kd_temperature = number_type(float, 0.0, False, "above 0", math.sqrt(FLOAT32_MAX),
                             "the distillation loss is scaled by its square, in float32")


def unit_weight(text: str) -> float:
    value = nonneg_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def dropout_rate(text: str) -> float:
    value = nonneg_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be below 1, got {text}")
    return value


def parse_args(argv=None, prog: str = "python -m cmoe_jax.train"):
    p = build_parser(prog)
    args = p.parse_args(argv)
    if not args.resume:
        p.reject(args, ("new_data",), "without --resume (it continues a finished run on another text)")
    return args


def _mesh(text):
    if text is None:
        return None
    try:
        data, model = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise CmoeError(f"--mesh {text!r} is not of the form DATAxMODEL (e.g. 4x2)") from None
    return data, model


def run(args) -> dict:
    check_writable_dir(args.out)
    distributed.initialize()  # a multi-process job trains data-parallel over all processes

    settings = TrainSettings.from_flags(
        dataset=args.dataset, data_path=args.data_path, split=args.split, samples=args.samples,
        seqlen=args.seqlen, batch_size=args.batch_size, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        dropout=args.dropout, targets=args.targets, lr=args.lr, router_lr=args.router_lr,
        bias_speed=args.bias_speed, epochs=args.epochs, seed=args.seed, save_every=args.save_every,
        max_steps=args.max_steps, max_minutes=args.max_minutes, new_data=args.new_data,
        mesh_shape=_mesh(args.mesh), expert_parallel=args.expert_parallel, remat=args.remat, dtype=args.dtype,
        distill=args.distill, teacher=args.teacher, kd_temperature=args.kd_temperature,
        kd_weight=args.kd_weight, kd_top_k=args.kd_top_k, hidden_weight=args.hidden_weight,
        recover=args.recover, recover_samples=args.recover_samples, recover_steps=args.recover_steps,
        recover_lr=args.recover_lr)
    return finetune(args.model, settings, out=args.out, resume=args.resume, overwrite=args.overwrite,
                    progress=not args.no_progress)


def report(args, result: dict) -> None:
    if distributed.is_main():
        print(json.dumps({k: result[k] for k in ("out", "steps", "first_loss", "final_loss",
                                                 "tokens_per_s", "train_seconds", "compile_seconds",
                                                 "stopped_by_time")}, indent=1))


def main(argv=None, prog: str = "python -m cmoe_jax.train") -> int:
    return command_main(parse_args, run, report, argv, prog)

