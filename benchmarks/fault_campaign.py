"""Kill jobs with SIGKILL at seeded random points and check what they leave behind.

Shared by `tests/test_faults.py` (a small campaign in the suite) and `benchmarks/faults.py`
(a larger one). Each run is a child forked from one server process that has imported the
job modules but not started JAX (so a run costs the job itself, not a Python and JAX start);
the child sets `CMOE_FAULT_AT=<point>:<n>` and the job layer SIGKILLs it at that pass.

After every kill the output must be absent or complete and equal to the uninterrupted
reference; the next run passes `--resume`, and a run that finishes must equal the reference
(tensor by tensor, JSON without timings). Two jobs started together on one `--out` must
give exactly one complete output and one single `error:` line.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

SERVER = r"""
import importlib, json, os, sys, time, traceback
MODULES = ("cmoe_jax.convert.cli", "cmoe_jax.compress.cli", "cmoe_jax.export.cli",
           "cmoe_jax.train.cli", "cmoe_jax.downcycle", "cmoe_jax.convert.api", "cmoe_jax.compress.api",
           "cmoe_jax.export.api", "cmoe_jax.train.api")
for m in MODULES:
    importlib.import_module(m)   # imports only: JAX's backend starts in each child
import transformers, orbax.checkpoint, safetensors.numpy
transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast  # resolve the lazy imports
print("ready", flush=True)
for line in sys.stdin:
    runs, pids, t0 = json.loads(line), [], time.monotonic()
    for run in runs:
        time.sleep(max(0.0, t0 + run.get("delay", 0.0) - time.monotonic()))
        pid = os.fork()
        if pid == 0:
            try:
                fd = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                for name in ("CMOE_FAULT_AT", "CMOE_FAULT_COUNT"):
                    os.environ.pop(name, None)
                os.environ.update(run.get("env", {}))
                code = importlib.import_module(run["module"]).main(run["argv"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 0)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print(json.dumps(codes), flush=True)
"""


class ForkServer:
    """One Python process that forks a child per job run (see the module docstring)."""

    def __init__(self, cache: Path | None = None):
        """`cache`: a JAX compilation cache directory shared by the children (each run then
        compiles only what no earlier run compiled)."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   TOKENIZERS_PARALLELISM="false", JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        if cache is not None:
            env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        assert self.proc.stdout.readline().strip() == "ready", "fork server did not start"

    def run(self, runs: list[dict]) -> list[int]:
        """Exit codes of the runs (started `delay` seconds apart, run together; -9: killed)."""
        self.proc.stdin.write(json.dumps(runs) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- comparing outputs ----------------------------------------------------------------------
VOLATILE = {"seconds", "tokens_per_s", "wall_seconds", "compile_seconds", "train_seconds",
            "resumed_from", "state_disk_bytes", "stopped_by_time"}


def _stable(obj):
    """JSON without timings (and without what only says how the run went, not what it made)."""
    if isinstance(obj, dict):
        return {k: _stable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_stable(v) for v in obj]
    return obj


def _state(directory: Path) -> dict:
    from flax import nnx

    from cmoe_jax.checkpoint import restore_model

    model = restore_model(directory)
    return {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def _tensors(directory: Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def differences(ref: Path, got: Path) -> list[str]:
    """What differs between two job outputs ([] when equal): the file names at the top level,
    every JSON file without timings, every tensor (model state, safetensors, adapters)."""
    diffs = []
    names = lambda d: sorted(p.name for p in d.iterdir())  # noqa: E731
    if names(ref) != names(got):
        return [f"files {names(ref)} != {names(got)}"]
    for f in sorted(ref.rglob("*.json")):
        rel = f.relative_to(ref)
        if any(part in ("state", "checkpoints") for part in rel.parts):
            continue  # Orbax's own metadata (timestamps): the tensors are compared below
        other = got / rel
        if not other.exists() or _stable(json.loads(f.read_text())) != _stable(json.loads(other.read_text())):
            diffs.append(f"{rel} differs")
    if (ref / "cmoe_manifest.json").exists():
        a, b = _state(ref), _state(got)
        diffs += [f"tensor {k}" for k in a if k not in b or not np.array_equal(a[k], b[k])]
    if any(ref.glob("*.safetensors")):
        a, b = _tensors(ref), _tensors(got)
        diffs += [f"tensor {k}" for k in a if k not in b or not np.array_equal(a[k], b[k])]
    if (ref / "adapters").is_dir():
        from cmoe_jax.train.checkpoint import load_adapters
        import jax

        a, b = load_adapters(ref / "adapters")[0], load_adapters(got / "adapters")[0]
        if not all(np.array_equal(np.asarray(x), np.asarray(y))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))):
            diffs.append("adapters differ")
    return diffs


# ---- the jobs -------------------------------------------------------------------------------
# points inside a write (a shard, a JSON file), between the renames of an overwrite, inside
# the cleanup after publish: the campaign's mid-write mode kills only at these
MID_WRITE = ("shard:write", "json:write", "publish:swap", "published:swap", "cleanup", "discarded")
SWAP = ("publish:swap", "published:swap")  # passed only when an existing output is replaced


@dataclass
class Job:
    name: str
    module: str
    argv: list  # without --out / --resume
    points: dict = field(default_factory=dict)  # point -> passes of one uninterrupted run (learnt)
    resume_flag: str = "--resume"
    extra_dirs: list = field(default_factory=list)

    def command(self, out: Path, resume: bool, overwrite: bool = False) -> list:
        return [*self.argv, "--out", str(out), *([self.resume_flag] if resume else []),
                *(["--overwrite"] if overwrite else [])]

    def choices(self, mid_write: bool) -> list[str]:
        """The points a kill may choose: all but the loading reader's, or the mid-write ones."""
        return sorted(p for p in self.points if not p.startswith("read:") and (p in MID_WRITE or not mid_write))


def make_inputs(root: Path) -> dict:
    """A tiny random Llama (HF directory with a tokenizer) and a calibration text file."""
    sys.path.insert(0, str(ROOT))
    from tests.conftest import save_tiny_tokenizer, tiny_hf_model, write_random_text

    root.mkdir(parents=True, exist_ok=True)
    dense = root / "dense"
    if not dense.exists():
        tiny_hf_model("llama", intermediate_size=64).save_pretrained(dense)
        save_tiny_tokenizer(dense)
    text = root / "calib.txt"
    if not text.exists():
        write_random_text(text, 3000)
    articles = root / "articles.txt"  # WikiText-style articles: ExpertWeaver's calibration tasks
    if not articles.exists():
        from tests.test_expertweaver import _articles

        _articles(articles)
    return {"dense": dense, "text": text, "articles": articles}


def jobs(inputs: dict, converted: Path) -> dict[str, Job]:
    """The jobs of a campaign; `converted` (the convert job's reference output) is the
    source of compress, export and train."""
    d, t, a = str(inputs["dense"]), str(inputs["text"]), str(inputs["articles"])
    calib = ["--data-path", t, "--calib-samples", "2", "--seqlen", "32", "--k-act", "4"]
    conv = ["--model", d, *calib, "--config", "S1A1E8"]
    return {
        "convert": Job("convert", "cmoe_jax.convert.cli", conv),
        "convert-stream": Job("convert-stream", "cmoe_jax.convert.cli", [*conv, "--stream"]),
        "hierarchical": Job("hierarchical", "cmoe_jax.convert.cli",
                            ["--model", str(converted), *calib, "--config", "S0A2E2", "--router-neurons", "2"]),
        "expertweaver": Job("expertweaver", "cmoe_jax.convert.cli",
                            ["--method", "expertweaver", "--model", d, "--data-path", a, "--experts", "8",
                             "--calib-tasks", "4", "--samples-per-task", "2", "--seqlen", "32"]),
        "compress": Job("compress", "cmoe_jax.compress.cli",
                        ["--model", str(converted), "--data-path", t, "--calib-samples", "2",
                         "--seqlen", "32", "--method", "conmoe", "--ratio", "0.5"]),
        "export": Job("export", "cmoe_jax.export.cli",
                      ["--model", str(converted), "--calib-samples", "0", "--max-shard-mb", "0.01",
                       "--no-progress"]),
        "train": Job("train", "cmoe_jax.train.cli",
                     ["--model", str(converted), "--data-path", t, "--samples", "4", "--seqlen", "16",
                      "--batch-size", "2", "--lora-rank", "2", "--epochs", "2", "--save-every", "1",
                      "--lr", "1e-2", "--no-progress"]),
        # distillation from the converted model's dense source, after layer-wise recovery
        "train-distill": Job("train-distill", "cmoe_jax.train.cli",
                             ["--model", str(converted), "--data-path", t, "--samples", "4",
                              "--seqlen", "16", "--batch-size", "2", "--lora-rank", "2", "--epochs",
                              "2", "--save-every", "1", "--lr", "1e-2", "--no-progress", "--distill",
                              "--kd-temperature", "2", "--kd-weight", "0.5", "--hidden-weight", "0.5",
                              "--recover", "layerwise", "--recover-samples", "2", "--recover-steps",
                              "5"]),
        "downcycle": Job("downcycle", "cmoe_jax.downcycle",
                         ["--model", d, "--data-path", a, "--experts", "8", "--active", "4",
                          "--shared-experts", "1", "--calib-tasks", "4", "--steps", "4", "--batch-size", "2",
                          "--seqlen", "16", "--save-every", "1", "--layers", "1"]),
    }


def _clean(out: Path) -> None:
    for p in (out, out.with_name(out.name + ".partial")):
        shutil.rmtree(p, ignore_errors=True)


@dataclass
class Tally:
    kills: int = 0
    broken: int = 0
    finished: int = 0
    identical: int = 0
    notes: list = field(default_factory=list)


def campaign(server: ForkServer, job: Job, ref: Path, work: Path, kills: int, seed: int,
             tally: Tally | None = None, mid_write: bool = False) -> Tally:
    """`kills` runs of `job`, each SIGKILLed at a seeded random (point, pass); every run after
    the first resumes. Outputs checked against `ref` after each run (see module docstring).
    `mid_write`: kill only inside writes, renames and cleanup (`MID_WRITE`)."""
    tally = tally or Tally()
    rng = random.Random(seed)
    out = work / f"{job.name}-out"
    _clean(out)
    points = job.choices(mid_write)
    done_kills = 0
    while done_kills < kills:
        point = rng.choice(points)
        n = rng.randint(1, job.points[point])
        log = work / f"{job.name}-{done_kills}.log"
        if point in SWAP and not out.exists():  # an output to replace: the reference's copy
            shutil.copytree(ref, out)
        # every run may replace: after a kill inside an overwrite the old output is put back
        code, = server.run([{"module": job.module, "argv": job.command(out, resume=True, overwrite=True),
                             "env": {"CMOE_FAULT_AT": f"{point}:{n}"}, "log": str(log)}])
        if code == -9:
            done_kills += 1
            tally.kills += 1
            if out.exists():  # killed after the publish: the output must be complete
                diffs = differences(ref, out)
                if diffs:
                    tally.broken += 1
                    tally.notes.append(f"{job.name} killed at {point}:{n}: {diffs[:3]}")
                shutil.rmtree(out)
            continue
        if code != 0:
            tally.broken += 1
            tally.notes.append(f"{job.name} at {point}:{n} exited {code}: {log.read_text()[-400:]}")
            _clean(out)
            continue
        _finished(tally, job, ref, out, f"{point}:{n}")
    # the last kill's work is finished by one more --resume run
    log = work / f"{job.name}-final.log"
    code, = server.run([{"module": job.module, "argv": job.command(out, resume=True, overwrite=True), "log": str(log)}])
    if code != 0:
        tally.broken += 1
        tally.notes.append(f"{job.name} final resume exited {code}: {log.read_text()[-400:]}")
    else:
        _finished(tally, job, ref, out, "final resume")
    _clean(out)
    return tally


def _finished(tally: Tally, job: Job, ref: Path, out: Path, where: str) -> None:
    tally.finished += 1
    diffs = differences(ref, out)
    if diffs:
        tally.broken += 1
        tally.notes.append(f"{job.name} resumed after {where} differs: {diffs[:3]}")
    else:
        tally.identical += 1
    shutil.rmtree(out)
    shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)


def reference(server: ForkServer, job: Job, out: Path) -> Path:
    """The uninterrupted output of `job`; its fault points' passes learnt on the way (a second
    run replacing the first gives the passes of the overwrite's points, and must equal it)."""
    _clean(out)
    log, counts = out.with_name(out.name + ".log"), out.with_name(out.name + ".points.json")
    for overwrite in (False, True):
        code, = server.run([{"module": job.module, "argv": job.command(out, resume=False, overwrite=overwrite),
                             "env": {"CMOE_FAULT_COUNT": str(counts)}, "log": str(log)}])
        assert code == 0, log.read_text()[-2000:]
        passes = json.loads(counts.read_text())
        job.points.update({k: v for k, v in passes.items() if (k in SWAP) == overwrite})
        if not overwrite:
            first = out.with_name(out.name + ".first")
            shutil.rmtree(first, ignore_errors=True)
            shutil.copytree(out, first)
    assert differences(first, out) == [], "two uninterrupted runs differ"
    shutil.rmtree(first)
    return out


def race(server: ForkServer, job: Job, ref: Path, work: Path, offsets: list[float]) -> list[str]:
    """Two runs of `job` on one `--out`, the second started `offset` seconds after the first:
    exactly one must publish an output equal to `ref`, the other fail with one `error:` line
    (exit 2) and write nothing. Returns what went wrong (empty: all good)."""
    problems = []
    out = work / f"{job.name}-race"
    for k, offset in enumerate(offsets):
        _clean(out)
        logs = [work / f"race-{k}-{i}.log" for i in range(2)]
        codes = server.run([{"module": job.module, "argv": job.command(out, resume=False),
                             "log": str(logs[i]), "delay": [0.0, offset][i]} for i in range(2)])
        if sorted(codes) != [0, 2]:
            problems.append(f"offset {offset:.2f}s: exit codes {codes}")
            continue
        loser = logs[codes.index(2)].read_text().strip().splitlines()
        errors = [line for line in loser if line.startswith("error:")]
        if len(errors) != 1:
            problems.append(f"offset {offset:.2f}s: loser printed {loser[-3:]}")
        diffs = differences(ref, out)
        if diffs:
            problems.append(f"offset {offset:.2f}s: published output differs: {diffs[:3]}")
        leftovers = sorted(p.name for p in work.iterdir() if p.name.startswith(out.name) and p != out)
        if leftovers:
            problems.append(f"offset {offset:.2f}s: left behind {leftovers}")
    _clean(out)
    return problems
