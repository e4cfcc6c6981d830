"""Multiple-choice scoring speed: our bucketed scorer against a plain transformers loop.

    python benchmarks/mc_eval.py --data-path ../shared/data/arc-easy/test.jsonl --items 40 --repeats 3

Both sides score the same (context, continuation) token pairs of the first --items ARC
questions (our encode_pair, i.e. lm-eval's split) and must agree on every log-likelihood
(1e-3). Ours: `score_requests` (compiled once in the untimed warm-up pass, then timed).
transformers: one unpadded transformers forward per continuation under torch.no_grad (what a
plain loop does), reading the same GGUF file. After one untimed pass each, repeats alternate
(transformers, ours, ...) (`benchmarks/harness.py`): median and min per side, the load
average at start and end, and last `ratio (...): N.NNx` = transformers time / our time of the
medians, withheld when the load average at start exceeds the core count (the machine is too
busy to compare). Needs the `reference` extra (torch, accelerate).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, report  # noqa: E402


def transformers_loop(model, requests):
    import torch

    out = []
    with torch.no_grad():
        for ctx, cont in requests:
            logits = model(torch.tensor([(ctx + cont)[:-1]])).logits[0, -len(cont):]
            logp = torch.log_softmax(logits.double(), -1)
            out.append(float(logp.gather(-1, torch.tensor(cont)[:, None]).sum()))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-path", default="../shared/data/arc-easy/test.jsonl")
    p.add_argument("--items", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    load_start = load_average()

    import torch
    import transformers

    from cmoe_jax.eval.loglikelihood import score_requests
    from cmoe_jax.eval.tasks import get_task, load_documents, task_requests
    from cmoe_jax.loading import load_model, smollm2_gguf

    torch.set_num_threads(os.cpu_count())
    task = get_task("arc_easy")
    docs = load_documents(task, args.data_path, args.items)
    lm = load_model("smollm2", progress=False)
    requests = task_requests(task, docs, lm.tokenizer.encode)
    gguf = smollm2_gguf()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32).eval()

    out = {}
    ours = lambda: out.__setitem__("ours", [ll for ll, _ in score_requests(
        lm.model, requests, batch_size=args.batch_size, progress=False)[0]])
    theirs = lambda: out.__setitem__("transformers", transformers_loop(ref, requests))
    times = interleaved_times([theirs, ours], args.repeats)  # the warm-up compiles every shape
    diff = np.abs(np.array(out["ours"]) - np.array(out["transformers"])).max()
    assert diff <= 1e-3, f"the two sides disagree by {diff}"
    print(f"ARC-Easy, first {len(docs)} questions ({len(requests)} continuations), SmolLM2-135M fp32, "
          f"batch {args.batch_size}; log-likelihoods agree within {diff:.1e}; "
          f"{torch.get_num_threads()} torch threads")
    report(["transformers", "ours"], times, load_start, work=len(docs), unit="questions/s")


if __name__ == "__main__":
    main()
