"""`python -m cmoe_jax.train`: LoRA fine-tuning of a dense or converted model.

Bad input (unknown LoRA targets, a resume directory from another configuration, a dataset
with fewer windows than --samples, ...) prints one `error: ...` line and exits 2 before
any training step.
"""
from __future__ import annotations

import argparse
import json

from cmoe_jax.errors import CmoeError, run_job
from cmoe_jax.train.lora import DEFAULT_TARGETS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cmoe_jax.train",
        description="LoRA fine-tuning (CMoE paper sec. 4: rank 8, alpha 32, Adam 0.9/0.95, "
                    "lr 5.95e-5 for LoRA and 1e-3 for the router scales u, bias speed 1e-3) of a "
                    "dense or converted model; saves the merged model, the adapters, Orbax "
                    "checkpoints, a JSON log and a loss curve in --out.",
        epilog="example: python -m cmoe_jax.train --model out/s1a1e8 --dataset wikitext2 "
               "--data-path ../shared/data/wikitext-2/valid.txt --samples 64 --seqlen 2048 "
               "--batch-size 1 --max-minutes 30 --out runs/ft")
    p.add_argument("--model", required=True,
                   help="converted cmoe_jax model dir, Hugging Face dir / Hub id, .gguf, or 'smollm2'")
    p.add_argument("--dataset", default="wikitext2", choices=["wikitext2", "c4"])
    p.add_argument("--data-path", help="local text file instead of downloading the dataset")
    p.add_argument("--split", default="train", help="dataset split (default train)")
    p.add_argument("--samples", type=int, default=2048, help="training windows (default 2048)")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per step (default 1)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA input dropout (default 0)")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help="comma-separated weights to adapt: q_proj,k_proj,v_proj,o_proj and "
                        "gate_proj,up_proj,down_proj (dense, shared and routed experts), or exact "
                        "names such as shared_up / expert_down (default: all seven)")
    p.add_argument("--lr", type=float, default=5.95e-5, help="LoRA learning rate")
    p.add_argument("--router-lr", type=float, default=1e-3, help="learning rate of the router scales u")
    p.add_argument("--bias-speed", type=float, default=1e-3, help="load-balancing bias step gamma")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="data sampling, order, init and dropout")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default 100)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N steps")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop before a step would end past this wall-clock budget (whole job)")
    p.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                   help="device mesh, e.g. 4x2 (default: all devices on the data axis)")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="split the MoE layers' routed experts over N devices (all-to-all token "
                        "exchange); the mesh becomes data x N x model (default 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the frozen weights (adapters are float32)")
    p.add_argument("--remat", action="store_true", help="recompute each layer in the backward pass (less memory)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace --out (or an interrupted run) if it exists")
    p.add_argument("--no-progress", action="store_true")
    return p


def _mesh(text):
    if text is None:
        return None
    try:
        data, model = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise CmoeError(f"--mesh {text!r} is not of the form DATAxMODEL (e.g. 4x2)") from None
    return data, model


def run(args) -> dict:
    from cmoe_jax import distributed

    distributed.initialize()  # a multi-process job trains data-parallel over all processes
    from cmoe_jax.train.api import finetune

    return finetune(args.model, out=args.out, dataset=args.dataset, data_path=args.data_path,
                    split=args.split, samples=args.samples, seqlen=args.seqlen,
                    batch_size=args.batch_size, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                    dropout=args.dropout, targets=args.targets, lr=args.lr, router_lr=args.router_lr,
                    bias_speed=args.bias_speed, epochs=args.epochs, seed=args.seed,
                    save_every=args.save_every, max_steps=args.max_steps,
                    max_minutes=args.max_minutes, resume=args.resume, overwrite=args.overwrite,
                    mesh_shape=_mesh(args.mesh), expert_parallel=args.expert_parallel,
                    remat=args.remat, dtype=args.dtype,
                    progress=not args.no_progress)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    result, code = run_job(run, args)
    if code:
        return code
    from cmoe_jax import distributed

    if not distributed.is_main():
        return 0
    print(json.dumps({k: result[k] for k in ("out", "steps", "first_loss", "final_loss",
                                             "tokens_per_s", "train_seconds", "compile_seconds",
                                             "stopped_by_time")}, indent=1))
    return 0
