"""LoRA train-step tokens/s of cmoe_jax against a torch + `peft` reference on the same batch.

    python benchmarks/train_step.py [--model smollm2] [--seqlen 2048] [--batch-size 1] [--steps 3] [--repeats 3]
    python benchmarks/train_step.py --model converted [--converted-dir ../bases/smollm2-S1A1E8] [--seqlen 512]

Dense (`--model NAME`, default): both sides fine-tune the same dense model (for a GGUF, the
file read by `transformers` itself); the reference is `transformers` + `peft`. On the dense
model the two run the same matmuls, so about 1.0x is the limit.

Converted (`--model converted`, or `--model DIR` naming a converted directory): LoRA training
of a cmoe_jax converted model (`--converted-dir`, default ../bases/smollm2-S1A1E8) against
the CMoE authors' MoE module (`benchmarks/cmoe_torch_reference.py`: shared MLP, routed
experts run in a Python loop, representative-neuron router with trainable gate scales u and
balancing bias b) holding the same weights, read from the same checkpoint, in a
`transformers` Llama, with peft wrapping every attention, shared and expert projection.

Both sides: LoRA rank 8, alpha 32, no dropout, on q/k/v/o/gate/up/down projections (shared
and routed experts included), the same initial adapters (cmoe_jax's A copied into peft, B =
0), Adam (betas 0.9/0.95; lr 5.95e-5 for LoRA, --router-lr for u), bias speed 1e-3,
float32, the same batch of WikiText-2 validation windows, in one process:

- cmoe_jax: the `cmoe_jax.train` step (one jit-compiled function: forward, backward, Adam,
  bias update; state donated); compiled, then its first step (untimed).
- reference: `get_peft_model`, SDPA attention, `model(input_ids, labels=...)`,
  `loss.backward()`, `torch.optim.Adam.step()`, torch's default thread count; first step
  untimed.

The first-step losses are printed and must agree within --loss-tol (same weights, B = 0).
Then the sides alternate (reference, cmoe_jax, ...) --repeats times, each --steps steps
(`benchmarks/harness.py`): median and min per side, the load average at start and end, and
last `ratio (...): N.NNx` = reference time / cmoe_jax time of the medians (above 1: cmoe_jax
is faster), withheld when the load average exceeds the core count.

Distillation (`--distill`, a converted model): the cmoe_jax LoRA step on the LM loss against
the distillation step (`train --distill`: the dense source as teacher in the same jit, its
shared weights borrowed from the student), interleaved the same way; `ratio` = LoRA time /
distillation time (below 1: distillation is slower). It also prints the teacher's own and
borrowed weight bytes and each compiled step's memory (arguments + temporaries, XLA's
memory analysis), i.e. the step's peak.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import WIKITEXT, interleaved_times, load_average, machine_line, report  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_CONVERTED = ROOT.parent / "bases" / "smollm2-S1A1E8"


def local_wikitext_valid() -> str | None:
    f = WIKITEXT / "valid.txt"
    return str(f) if f.exists() else None


class JaxSide:
    """The cmoe_jax trainer: `first_step` compiles and runs one step, `run` times steps."""

    def __init__(self, model_name: str, args, distill=None):
        import jax

        from cmoe_jax.loading import load_model
        from cmoe_jax.train import (LoRAConfig, OptimConfig, init_state, lm_loss, make_mesh, make_train_step,
                                    split_frozen)

        self.mesh = make_mesh()
        self.lm = load_model(model_name, mesh=self.mesh, progress=False)
        lora = LoRAConfig(rank=args.rank, alpha=args.alpha, targets=tuple(TARGETS))
        oc = OptimConfig(lr=args.lr, router_lr=args.router_lr, bias_speed=args.bias_speed)
        self.state, shardings, tx = init_state(self.lm.model, lora, oc, jax.random.key(0), self.mesh)
        # the initial adapters, for the reference (the state is donated by the first step)
        self.initial_adapters = jax.tree.map(np.asarray, self.state["trainable"]["lora"])
        graphdef, self.frozen, frozen_sh = split_frozen(self.lm.model, self.mesh)
        loss, self.memory = None, {}
        if distill is not None:
            from cmoe_jax.sharding import placed_split
            from cmoe_jax.train import SharedTeacher, distill_loss
            from cmoe_jax.train.teacher import teacher_name

            name = teacher_name(self.lm.path, model_name, args.teacher)
            t_graphdef, t_state = placed_split(load_model(name, mesh=self.mesh, progress=False).model,
                                               self.mesh)
            teacher = SharedTeacher(t_graphdef, t_state, self.frozen)
            del t_state  # the teacher keeps only its own weights (the dense FFNs)
            self.memory = teacher.memory()
            self.frozen = {"model": self.frozen, "teacher": teacher.own}
            frozen_sh = {"model": frozen_sh, "teacher": jax.tree.map(lambda a: a.sharding, teacher.own)}
            loss = distill_loss(graphdef, teacher, lora, distill)
        self.step = make_train_step(loss or lm_loss(graphdef, lora), tx, shardings, frozen_sh, self.mesh,
                                    bias_speed=oc.bias_speed)

    def first_step(self, batch: np.ndarray) -> float:
        import jax

        from cmoe_jax.train.step import batch_sharding

        self.x = jax.device_put(batch, batch_sharding(self.mesh))
        t0 = time.perf_counter()
        self.compiled = self.step.lower(self.state, self.frozen, self.x).compile()
        self.compile_seconds = time.perf_counter() - t0
        mem = self.compiled.memory_analysis()
        self.step_bytes = (None if mem is None else
                           mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                           - mem.alias_size_in_bytes)
        return self.run(1)

    def run(self, steps: int) -> float:
        for _ in range(steps):
            self.state, loss, _ = self.compiled(self.state, self.frozen, self.x)
        return float(loss)  # waits for the last step


class TorchSide:
    """peft LoRA on a torch causal LM; the routers' gate scales u train at `router_lr`."""

    def __init__(self, model, args):
        import torch
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                                                      target_modules=TARGETS, bias="none"))
        self.model.train()
        scales = [p for n, p in self.model.named_parameters() if n.endswith("extra_scale")]
        for p in scales:  # peft froze them with the base weights; the CMoE recipe trains them
            p.requires_grad_(True)
        lora = [p for n, p in self.model.named_parameters() if p.requires_grad and "lora_" in n]
        groups = [{"params": lora, "lr": args.lr}] + ([{"params": scales, "lr": args.router_lr}]
                                                      if scales else [])
        self.opt = torch.optim.Adam(groups, betas=(0.9, 0.95))

    def first_step(self, batch: np.ndarray) -> float:
        import torch

        self.x = torch.from_numpy(batch.astype(np.int64))
        return self.run(1)

    def run(self, steps: int) -> float:
        for _ in range(steps):
            loss = self.model(input_ids=self.x, labels=self.x).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss.item()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="a dense model both sides can read, or 'converted' (see --converted-dir)")
    p.add_argument("--converted-dir", default=str(DEFAULT_CONVERTED),
                   help="with --model converted: a cmoe_jax converted Llama-architecture model")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each side")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=5.95e-5)
    p.add_argument("--router-lr", type=float, default=1e-3, help="Adam lr of the gate scales u")
    p.add_argument("--bias-speed", type=float, default=1e-3, help="balancing bias step per train step")
    p.add_argument("--loss-tol", type=float, default=1e-3,
                   help="largest allowed |difference| of the two first-step losses")
    p.add_argument("--data-path", default=None, help="WikiText-2 validation file (default: the shared copy)")
    p.add_argument("--distill", action="store_true",
                   help="compare the LoRA step with the distillation step (a converted model)")
    p.add_argument("--teacher", default=None, help="with --distill: the teacher (default: the source)")
    p.add_argument("--kd-temperature", type=float, default=1.0)
    p.add_argument("--kd-weight", type=float, default=1.0)
    p.add_argument("--kd-top-k", type=int, default=None)
    p.add_argument("--hidden-weight", type=float, default=0.0)
    return p.parse_args(argv)


def distill_main(args, model_name: str, batch_of, load_start: float) -> None:
    """LoRA on the LM loss against distillation, both cmoe_jax, interleaved (see the docstring)."""
    from cmoe_jax.train import DistillConfig

    cfg = DistillConfig(temperature=args.kd_temperature, kd_weight=args.kd_weight,
                        top_k=args.kd_top_k, hidden_weight=args.hidden_weight)
    plain, kd = JaxSide(model_name, args), JaxSide(model_name, args, distill=cfg)
    batch, data = batch_of(plain.lm.tokenizer)
    loss_plain, loss_kd = plain.first_step(batch), kd.first_step(batch)
    mib = lambda b: "?" if b is None else f"{b / 2**20:,.0f} MiB"  # noqa: E731
    print(machine_line())
    print(f"model: {model_name}; batch: {args.batch_size} x {args.seqlen} tokens of {data}; "
          f"distillation {cfg}; {args.steps} timed steps x {args.repeats} repeats")
    print(f"teacher: own weights {mib(kd.memory['teacher_own_bytes'])}, borrowed from the student "
          f"{mib(kd.memory['teacher_shared_bytes'])}")
    print(f"step memory (arguments + temporaries + outputs): LoRA {mib(plain.step_bytes)}, "
          f"distillation {mib(kd.step_bytes)}; compile {plain.compile_seconds:.1f} s / "
          f"{kd.compile_seconds:.1f} s (not counted)")
    print(f"first-step loss: LM {loss_plain:.5f}, distillation {loss_kd:.5f}")
    times = interleaved_times([lambda: plain.run(args.steps), lambda: kd.run(args.steps)],
                              args.repeats, warmup=0)
    report(["LoRA (LM loss)", "LoRA + distillation"], times, load_start,
           work=batch.size * args.steps)


def model_to_train(args) -> tuple[str, bool]:
    """(model argument, whether it is a converted model); exits with `error:` when missing."""
    from cmoe_jax.checkpoint import is_converted

    if args.model != "converted":
        return args.model, is_converted(Path(args.model))
    path = Path(args.converted_dir)
    if not is_converted(path):
        print(f"error: {path} is not a cmoe_jax converted model: make one with `python -m "
              f"cmoe_jax.convert --model smollm2 --config S1A1E8 --out {path}` or pass --converted-dir",
              file=sys.stderr)
        raise SystemExit(2)
    return str(path), True


def main(argv=None) -> None:
    args = parse_args(argv)
    load_start = load_average()
    model_name, converted = model_to_train(args)

    import torch

    from cmoe_jax.data import calibration_windows, load_text_tokens
    from cmoe_jax.loading import resolve

    data = args.data_path or local_wikitext_valid()

    def batch_of(tokenizer):
        tokens = load_text_tokens("wikitext2", tokenizer, "validation", data)
        return calibration_windows(tokens, args.batch_size, args.seqlen, seed=0), data or "datasets"

    if args.distill:
        if not converted:
            raise SystemExit("error: --distill needs a converted model (--model converted or a "
                             "converted directory)")
        return distill_main(args, model_name, batch_of, load_start)
    ours = JaxSide(model_name, args)
    batch, _ = batch_of(ours.lm.tokenizer)
    if converted:
        from benchmarks.cmoe_torch_reference import reference_llama

        ref_name, torch_model = "CMoE authors' MoE+peft", reference_llama(ours.lm.model, args.bias_speed)
    else:
        from benchmarks.torch_reference import load_torch_causal_lm

        ref_name, torch_model = "transformers+peft", load_torch_causal_lm(resolve(model_name))
    ref = TorchSide(torch_model, args)
    from benchmarks.cmoe_torch_reference import copy_lora_factors

    copy_lora_factors(ref.model, ours.initial_adapters)

    loss_ref, loss_ours = ref.first_step(batch), ours.first_step(batch)
    print(f"{machine_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model: {model_name}{' (converted)' if converted else ''}; batch: {args.batch_size} x "
          f"{args.seqlen} tokens of {data or 'datasets'}; LoRA r={args.rank} alpha={args.alpha:g} on "
          f"{','.join(TARGETS)}; {args.steps} timed steps x {args.repeats} repeats; cmoe_jax compile "
          f"{ours.compile_seconds:.1f} s (not counted)")
    print(f"first-step loss: cmoe_jax {loss_ours:.5f}, {ref_name} {loss_ref:.5f}")
    if not abs(loss_ours - loss_ref) <= args.loss_tol:
        raise SystemExit(f"first-step losses differ by {abs(loss_ours - loss_ref):.2e} > {args.loss_tol}: "
                         "the two sides do not train the same model")
    last = {}
    times = interleaved_times(
        [lambda: last.__setitem__("ref", ref.run(args.steps)),
         lambda: last.__setitem__("ours", ours.run(args.steps))], args.repeats, warmup=0)
    print(f"last-step loss: cmoe_jax {last['ours']:.5f}, {ref_name} {last['ref']:.5f} "
          f"(same adapters and batch: the runs should track each other)")
    report([ref_name, "cmoe_jax"], times, load_start, work=batch.size * args.steps)


if __name__ == "__main__":
    main()
