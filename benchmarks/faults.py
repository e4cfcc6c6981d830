"""A fault-injection campaign larger than the suite's: `--kills N` runs, each SIGKILLed at a
seeded random point, each followed by a `--resume` run to the end.

    python benchmarks/faults.py --kills 100 [--jobs convert,convert-stream,hierarchical,...]
        [--seed 0] [--race 10] [--mid-write]

Each kill is a fresh run of one job (round-robin over `--jobs`: every job that writes an
output by default) killed at a random pass of one of its fault points (`CMOE_FAULT_AT`, see
`cmoe_jax.faults`; the passes of each point are learnt from the uninterrupted reference run):
after it the output must be absent, or complete and equal to the reference ("broken" otherwise).
`--mid-write` kills only inside writes (a shard, a JSON file), between the renames of an
overwrite (the run then replaces a copy of the reference) and inside the cleanup after
publish, and prints its own line ("mid-write kills ...").
A `--resume` run without a fault then finishes the job, and its output must equal the
reference tensor by tensor ("resumes identical"). `--race K` adds K runs of two conversions
started together on one `--out` at seeded offsets. `--adversarial` adds, for every job, the
adversarial round of `fault_campaign.adversarial` (foreign things at OUT.lock, --out inside
the inputs, the source replaced mid-job, continuation with changed text, flipped bytes, a full
tmpfs) and prints its tallies as JSON lines ("wrong_data_exits" and "damaged_foreign" must be 0),
then the bad-input round of `bad_inputs` (--out spelled as an input three ways, every single
edit of a manifest, config values of the wrong type, model directories and GGUF files of every
defect, non-UTF-8 --out, texts that are no text), each case within 3x its job's normal time.
Prints, last:

    kills N, broken outputs B, resumes identical R
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fault_campaign import (SWAP, ForkServer, Tally, _clean, adversarial,  # noqa: E402
                                       differences, jobs, make_inputs, race, reference)
from benchmarks.bad_inputs import BadInputs  # noqa: E402
from benchmarks.harness import cpu_model, load_average  # noqa: E402


def kill_and_resume(server, job, ref, work, point, n, log) -> tuple[bool, bool, str]:
    """(killed, resumed identically, what went wrong) for one kill at `point`:`n`."""
    out = work / f"{job.name}-out"
    _clean(out)
    swap = point in SWAP
    if swap:  # the run replaces an existing output (a copy of the reference)
        shutil.copytree(ref, out)
    code, = server.run([{"module": job.module, "argv": job.command(out, resume=False, overwrite=swap),
                         "env": {"CMOE_FAULT_AT": f"{point}:{n}"}, "log": str(log)}])
    if code != -9:
        return False, False, f"{job.name} {point}:{n}: not killed (exit {code})"
    problem = ""
    leftovers = sorted(p.name for p in work.iterdir() if p.name.startswith(f".{out.name}."))
    if out.exists():  # killed after the publish, or before it replaced the old output
        diffs = differences(ref, out)
        problem = f"{job.name} {point}:{n}: broken output {diffs[:3]}" if diffs else ""
        shutil.rmtree(out)
    # after a kill inside an overwrite, the next run may find the old output put back: it
    # replaces it, as the killed run meant to
    code, = server.run([{"module": job.module, "argv": job.command(out, resume=True, overwrite=swap),
                         "log": str(log)}])
    if code != 0:
        return True, False, problem or f"{job.name} {point}:{n}: resume exited {code}"
    diffs = differences(ref, out)
    stray = sorted(p.name for p in work.iterdir() if p.name.startswith(f".{out.name}."))
    if stray:  # what the killed run recorded must be gone after the next run on the output
        problem = problem or f"{job.name} {point}:{n}: left {stray} (after the kill: {leftovers})"
    _clean(out)
    return True, not diffs, problem or (f"{job.name} {point}:{n}: resume differs {diffs[:3]}" if diffs else "")


def adversarial_round(server, specs, refs, names, work) -> list[str]:
    """`fault_campaign.adversarial` for every job in `names`: one JSON line of tallies per job,
    then the totals; returns the problems (wrong-data exits, damaged foreign paths, failures)."""
    total = Tally()
    for name in names:
        tally = adversarial(server, specs[name], work, ref=refs[name])
        print(json.dumps({"job": name, **dataclasses.asdict(tally)}), flush=True)
        for f in ("adversarial_cases", "wrong_data_exits", "damaged_foreign", "adversarial_failed"):
            setattr(total, f, getattr(total, f) + getattr(tally, f))
        total.notes += tally.notes
        total.skipped += tally.skipped
    counts = {f: getattr(total, f) for f in ("adversarial_cases", "wrong_data_exits", "damaged_foreign",
                                             "adversarial_failed")}
    print(json.dumps({"adversarial": counts, "skipped": len(total.skipped)}), flush=True)
    return [f"adversarial: {n}" for n in total.notes]


def bad_input_round(server, specs, converted, inputs, work) -> list[str]:
    """`bad_inputs.BadInputs` for the jobs and eval: its counts as one JSON line; returns the
    problems (hangs, tracebacks, wrong-data exits, other failures)."""
    t0 = time.perf_counter()
    counts = BadInputs(server, specs, converted, inputs["dense"], inputs["text"], work).run_all()
    summary = {k: v for k, v in dataclasses.asdict(counts).items() if k not in ("notes", "accepted_cases")}
    print(json.dumps({"bad_inputs": summary, "seconds": round(time.perf_counter() - t0)}), flush=True)
    print(json.dumps({"accepted": counts.accepted_cases}), flush=True)
    return [f"bad input: {n}" for n in counts.notes]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--jobs", default="convert,convert-stream,hierarchical,expertweaver,compress,export,train,"
                                     "train-distill,downcycle")
    p.add_argument("--mid-write", action="store_true",
                   help="kill only inside writes, between renames and inside cleanup")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--race", type=int, default=10, help="two-job races on one --out (0: none)")
    p.add_argument("--adversarial", action="store_true",
                   help="also run the adversarial round for every selected job (prints JSON tallies)")
    p.add_argument("--work", help="working directory (default: a temporary one, removed)")
    args = p.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="cmoe_faults_"))
    work.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.jobs.split(",") if n]
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    kills = broken = identical = 0
    problems = []
    try:
        inputs = make_inputs(work / "inputs")
        with ForkServer(work / "jax-cache") as server:
            specs = jobs(inputs, work / "ref-convert")
            refs = {"convert": reference(server, specs["convert"], work / "ref-convert")}
            for name in names:
                if name not in refs:
                    refs[name] = reference(server, specs[name], work / f"ref-{name}")
            for k in range(args.kills):
                job = specs[names[k % len(names)]]
                point = rng.choice(job.choices(args.mid_write))
                n = rng.randint(1, job.points[point])
                killed, same, problem = kill_and_resume(server, job, refs[job.name], work, point, n,
                                                        work / f"run-{k}.log")
                kills += killed
                identical += same
                broken += bool(problem)
                if problem:
                    problems.append(problem)
                print(f"[{k + 1}/{args.kills}] {job.name} killed at {point}:{n}: "
                      f"{problem or 'ok, resumed identically'}", flush=True)
            if args.race:
                offsets = [rng.uniform(0.0, 3.0) for _ in range(args.race)]
                race_problems = race(server, specs["convert"], refs["convert"], work, offsets)
                problems += race_problems
                print(f"races {args.race}, problems {len(race_problems)}", flush=True)
            if args.adversarial:
                problems += adversarial_round(server, specs, refs, names, work)
                problems += bad_input_round(server, {n: specs[n] for n in names}, refs["convert"], inputs, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    for line in problems:
        print("problem:", line)
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()} ({os.cpu_count()} cores, "
          f"load {load_average():.1f}), {time.perf_counter() - t0:.0f} s, jobs {','.join(names)}, "
          f"seed {args.seed}")
    print(f"{'mid-write ' if args.mid_write else ''}kills {kills}, broken outputs {broken}, "
          f"resumes identical {identical}")
    return 0 if not problems and kills == identical == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
