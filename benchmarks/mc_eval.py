"""Multiple-choice scoring speed: our bucketed scorer against a plain transformers loop.

    python benchmarks/mc_eval.py --data-path ../shared/data/arc-easy/test.jsonl --items 40 --repeats 3

Both sides score the same (context, continuation) token pairs of the first --items ARC
questions (our encode_pair, i.e. lm-eval's split) and must agree on every log-likelihood
(1e-3). A: `score_requests` (compiled once in an untimed warm-up pass, then timed). B: one
unpadded transformers forward per continuation under torch.no_grad (what a plain loop does),
reading the same GGUF file. Repeats alternate A, B; the table shows the median and minimum per
side and the ratio of the medians, with the load average at start and end. The ratio is not
printed when the load average exceeds the core count (the machine is too busy to compare).
Needs the `reference` extra (torch, accelerate).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


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
    load_start = os.getloadavg()

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

    ours = lambda: [ll for ll, _ in score_requests(lm.model, requests, batch_size=args.batch_size,
                                                   progress=False)[0]]
    warm = ours()  # compiles every shape; the timed passes reuse them
    base = transformers_loop(ref, requests)
    assert np.abs(np.array(warm) - np.array(base)).max() <= 1e-3, "the two sides disagree"
    times = {"ours": [], "transformers": []}
    for _ in range(args.repeats):
        for name, fn in (("ours", ours), ("transformers", lambda: transformers_loop(ref, requests))):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    load_end = os.getloadavg()
    cores = os.cpu_count()
    print(f"ARC-Easy, first {len(docs)} questions ({len(requests)} continuations), SmolLM2-135M fp32, "
          f"batch {args.batch_size}; load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end, "
          f"{cores} cores")
    print(f"{'side':14s} {'median s':>9s} {'min s':>8s} {'questions/s':>12s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:14s} {med:9.2f} {min(ts):8.2f} {len(docs) / med:12.2f}")
    ratio = statistics.median(times["transformers"]) / statistics.median(times["ours"])
    if max(load_start[0], load_end[0]) > cores:
        print(f"ratio not reported: load average above the {cores} cores (machine too busy to compare)")
    else:
        print(f"speed-up (median transformers / median ours): {ratio:.2f}x")


if __name__ == "__main__":
    main()
