"""LoRA train-step tokens/s of cmoe_jax against `transformers` + `peft` on the same batch.

    python benchmarks/train_step.py [--model smollm2] [--seqlen 2048] [--batch-size 1] [--steps 3] [--repeats 1]

Both sides fine-tune the same dense model (for a GGUF, the file read by `transformers`
itself) with the same LoRA (rank 8, alpha 32, no dropout, on q/k/v/o/gate/up/down
projections), Adam (betas 0.9/0.95, lr 5.95e-5), float32, on the same batch of WikiText-2
validation windows (../shared/data/wikitext-2/valid.txt when present, else --data-path),
in one process:

- cmoe_jax: the `cmoe_jax.train` step (one jit-compiled function: forward, backward, Adam,
  bias update; state donated); compiled and run once untimed, then --steps steps timed.
- transformers + peft: `get_peft_model`, SDPA attention, `model(input_ids, labels=...)`,
  `loss.backward()`, `torch.optim.Adam.step()`, torch's default thread count; one untimed
  warm-up step, then --steps steps timed.

Both first-step losses are printed (same weights, B = 0 adapters: they must agree). With
--repeats R the two alternate R times and the best tokens/s of each is kept (the machine may
be shared). Prints last the ratio `ratio: N.NNx` (cmoe_jax / transformers+peft; above 1
means cmoe_jax is faster).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch_reference import load_torch_causal_lm  # noqa: E402  (benchmarks/ is on sys.path)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def local_wikitext_valid() -> str | None:
    f = ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
    return str(f) if f.exists() else None


def jax_trainer(model_name: str, rank: int, alpha: float, lr: float):
    import jax

    from cmoe_jax.loading import load_model
    from cmoe_jax.train import LoRAConfig, OptimConfig, init_state, make_mesh, make_train_step, split_frozen

    mesh = make_mesh()
    lm = load_model(model_name, mesh=mesh, progress=False)
    lora = LoRAConfig(rank=rank, alpha=alpha, targets=tuple(TARGETS))
    oc = OptimConfig(lr=lr)
    state, shardings, tx = init_state(lm.model, lora, oc, jax.random.key(0), mesh)
    graphdef, frozen, frozen_sh = split_frozen(lm.model, mesh)
    step = make_train_step(graphdef, lora, oc, tx, shardings, frozen_sh, mesh)
    return lm, {"state": state, "frozen": frozen, "step": step, "compiled": None, "mesh": mesh}


def jax_steps(t, batch, steps: int) -> dict:
    import jax

    from cmoe_jax.train.step import batch_sharding

    x = jax.device_put(batch, batch_sharding(t["mesh"]))
    first = None
    if t["compiled"] is None:
        t0 = time.perf_counter()
        t["compiled"] = t["step"].lower(t["state"], t["frozen"], x).compile()
        t["compile_seconds"] = time.perf_counter() - t0
        t["state"], loss, _ = t["compiled"](t["state"], t["frozen"], x)  # untimed warm-up
        first = float(loss)
    t0 = time.perf_counter()
    for _ in range(steps):
        t["state"], loss, _ = t["compiled"](t["state"], t["frozen"], x)
    float(loss)  # wait for the last step
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": batch.size * steps / seconds, "seconds": seconds, "first_loss": first}


def torch_trainer(path: Path, rank: int, alpha: float, lr: float):
    import torch
    from peft import LoraConfig, get_peft_model

    model = load_torch_causal_lm(path)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                             target_modules=TARGETS, bias="none"))
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95))
    return {"model": model, "opt": opt, "warm": False}


def torch_steps(t, batch, steps: int) -> dict:
    import torch

    x = torch.from_numpy(batch.astype(np.int64))

    def one() -> float:
        loss = t["model"](input_ids=x, labels=x).loss
        loss.backward()
        t["opt"].step()
        t["opt"].zero_grad(set_to_none=True)
        return loss.item()

    first = None
    if not t["warm"]:
        first = one()  # warm-up, untimed
        t["warm"] = True
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": batch.size * steps / seconds, "seconds": seconds, "first_loss": first}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a dense model both sides can read")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=5.95e-5)
    p.add_argument("--data-path", default=None, help="WikiText-2 validation file (default: the shared copy)")
    args = p.parse_args(argv)

    import jax
    import torch

    from cmoe_jax.data import calibration_windows, load_text_tokens
    from cmoe_jax.loading import resolve

    data = args.data_path or local_wikitext_valid()
    lm, ours = jax_trainer(args.model, args.rank, args.alpha, args.lr)
    tokens = load_text_tokens("wikitext2", lm.tokenizer, "validation", data)
    batch = calibration_windows(tokens, args.batch_size, args.seqlen, seed=0)
    ref = torch_trainer(resolve(args.model), args.rank, args.alpha, args.lr)
    runs_ours, runs_ref = [], []
    for _ in range(args.repeats):
        runs_ours.append(jax_steps(ours, batch, args.steps))
        runs_ref.append(torch_steps(ref, batch, args.steps))
    best_ours = max(r["tokens_per_s"] for r in runs_ours)
    best_ref = max(r["tokens_per_s"] for r in runs_ref)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform} x{len(jax.devices())}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model: {args.model}; batch: {args.batch_size} x {args.seqlen} tokens of {data or 'datasets'}; "
          f"LoRA r={args.rank} alpha={args.alpha:g} on {','.join(TARGETS)}; "
          f"{args.steps} timed steps x {args.repeats} repeats")
    print(f"first-step loss: cmoe_jax {runs_ours[0]['first_loss']:.5f}, "
          f"transformers+peft {runs_ref[0]['first_loss']:.5f}")
    print(f"cmoe_jax          {best_ours:8.1f} tokens/s "
          f"({ours['compile_seconds']:.1f} s compile, not counted)")
    print(f"transformers+peft {best_ref:8.1f} tokens/s")
    print(f"ratio: {best_ours / best_ref:.2f}x")


if __name__ == "__main__":
    main()
