"""How much of the CMoE authors' LoRA training step the routed experts take, and so the most
any routed-expert implementation could gain over it: `benchmarks/train_step.py --model
converted`'s reference side (the authors' MoE with its Python expert loop, in a
`transformers` Llama, peft on every projection), timed with and without its routed experts.

    python benchmarks/routed_share.py [--converted-dir ../bases/smollm2-S1A1E8] [--seqlen 512] [--batch-size 2]

Without the routed experts, the router, the shared MLP, attention, the LM head, the loss and
Adam still run. `ratio` = step time with / without them: the speed-up cmoe_jax would reach
against this reference if its routed experts cost nothing and everything else ran exactly as
fast as torch's (it does not: on the dense model cmoe_jax's LoRA step is slower). A ratio below
2 means the 2x train-step target cannot be met on this machine by the MoE layer alone.
Interleaved with the load averages (`benchmarks/harness.py`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import interleaved_times, load_average, report  # noqa: E402
from benchmarks.train_step import (DEFAULT_CONVERTED, TorchSide, local_wikitext_valid,  # noqa: E402
                                   parse_args as train_args)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--converted-dir", default=str(DEFAULT_CONVERTED))
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data-path", default=None, help="WikiText-2 validation file (default: the shared copy)")
    args = p.parse_args(argv)
    load_start = load_average()

    from benchmarks.cmoe_torch_reference import ReferenceMoE, reference_llama
    from cmoe_jax.data import calibration_windows, load_text_tokens
    from cmoe_jax.loading import load_model

    lm = load_model(args.converted_dir, progress=False)
    batch = calibration_windows(load_text_tokens("wikitext2", lm.tokenizer, "validation",
                                                 args.data_path or local_wikitext_valid()),
                                args.batch_size, args.seqlen, seed=0)
    side = TorchSide(reference_llama(lm.model), train_args(["--model", "converted"]))
    moes = [m for m in side.model.modules() if isinstance(m, ReferenceMoE)]
    del lm

    def run(routed: bool):
        for m in moes:
            m.run_routed = routed
        side.run(args.steps)

    side.first_step(batch)
    print(f"{args.converted_dir}: {len(moes)} MoE layers; batch {args.batch_size} x {args.seqlen}; "
          f"{args.steps} steps x {args.repeats} repeats")
    times = interleaved_times([lambda: run(True), lambda: run(False)], args.repeats)
    report(["with routed experts", "without routed experts"], times, load_start,
           work=batch.size * args.steps)


if __name__ == "__main__":
    main()
