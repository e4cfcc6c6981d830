"""Kill jobs with SIGKILL at seeded random points and check what they leave behind.

Shared by `tests/test_faults.py` (a small campaign in the suite) and `benchmarks/faults.py`
(a larger one). Each run is a child forked from one server process that has imported the
job modules but not started JAX (so a run costs the job itself, not a Python and JAX start);
the child sets `CMOE_FAULT_AT=<point>:<n>` and the job layer SIGKILLs it at that pass.

After every kill the output must be absent or complete and equal to the uninterrupted
reference; the next run passes `--resume`, and a run that finishes must equal the reference
(tensor by tensor, JSON without timings). Two jobs started together on one `--out` must
give exactly one complete output and one single `error:` line.

The adversarial round (`adversarial`) changes what a job reads and where it writes, under it:
foreign things at OUT.lock, --out inside its inputs, its source replaced mid-job (paused by
`CMOE_FAULT_PAUSE`), continuation with changed text, flipped bytes in a converted source, a
full tmpfs. Each must be refused with exit 2 and one `error:` line: it counts the exit-0 runs
("wrong-data exits") and every foreign path a run changed ("damaged foreign paths").
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

SERVER = r"""
import importlib, json, os, sys, time, traceback
MODULES = ("cmoe_jax.convert.cli", "cmoe_jax.compress.cli", "cmoe_jax.export.cli",
           "cmoe_jax.train.cli", "cmoe_jax.downcycle.cli", "cmoe_jax.convert.api", "cmoe_jax.compress.api",
           "cmoe_jax.export.api", "cmoe_jax.train.api")
for m in MODULES:
    importlib.import_module(m)   # imports only: JAX's backend starts in each child
import transformers, orbax.checkpoint, safetensors.numpy
transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast  # resolve the lazy imports
print("ready", flush=True)


def wait(pid, limit):
    # the child's exit code, or "hang" after killing it when it outlives `limit` seconds
    end = None if limit is None else time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, 0 if end is None else os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return "hang"
        time.sleep(0.02)


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
    codes = [wait(pid, run.get("limit")) for pid, run in zip(pids, runs)]
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
        """Exit codes of the runs (started `delay` seconds apart, run together; -9: killed;
        "hang": killed by the server after the run's `limit` seconds)."""
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
            "resumed_from", "state_disk_bytes", "stopped_by_time",
            "manifest_sha256"}  # a manifest's seal covers its timings too


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
        from cmoe_jax.train.run_checkpoints import load_adapters
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
        "downcycle": Job("downcycle", "cmoe_jax.downcycle.cli",
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
    # the adversarial round (`adversarial`)
    adversarial_cases: int = 0
    wrong_data_exits: int = 0
    damaged_foreign: int = 0
    adversarial_failed: int = 0  # refused otherwise than with exit 2 and one line, or left files
    skipped: list = field(default_factory=list)


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


# ---- the adversarial round ------------------------------------------------------------------
# Inputs and places that a user or another program changes under a job: every case must be
# refused with exit 2 and one `error:` line, leaving what is not the job's own untouched.
# A "wrong-data exit" is exit 0 where the job had to refuse (it published or continued from
# inputs other than the ones it was started on); a "damaged foreign path" is any file that is
# not the job's own (a lock-place file, a user's file, the source, the data) changed by a run.
PAUSE_POINTS = ("layer", "shard", "step")  # passed during the work of convert/compress, export, train


def snapshot(path: Path) -> list:
    """(relative path, file type, inode, size, sha256) of `path` and everything under it;
    [] when nothing is there."""
    if not os.path.lexists(path):
        return []
    walk = path.is_dir() and not path.is_symlink()
    return [_entry(p, path) for p in ([path, *sorted(path.rglob("*"))] if walk else [path])]


def _entry(p: Path, root: Path) -> tuple:
    st = os.lstat(p)
    digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
    return str(p.relative_to(root)), stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, digest


def _private(job: Job, base: Path) -> Job:
    """`job` reading private copies of its source and data (under `base`), so that a case may
    change them and a refusal that fails cannot touch the campaign's shared inputs."""
    argv = list(job.argv)
    for flag in ("--model", "--data-path"):
        if flag in argv:
            i = argv.index(flag) + 1
            original, copy = Path(argv[i]), base / flag.strip("-") / Path(argv[i]).name
            copy.parent.mkdir(parents=True)
            (shutil.copytree if original.is_dir() else shutil.copy2)(original, copy)
            argv[i] = str(copy)
    return Job(job.name, job.module, argv, dict(job.points), job.resume_flag)


def _modified_copy(src: Path) -> Path:
    """A copy of `src` beside it with one file changed (a newline added to a top-level JSON
    file of a directory, a byte appended to a file)."""
    fresh = src.with_name(src.name + ".new")
    if src.is_dir():
        shutil.copytree(src, fresh)
        target = sorted(fresh.glob("*.json"))[0]
        target.write_text(target.read_text() + "\n")
    else:
        shutil.copy2(src, fresh)
        with open(fresh, "ab") as f:
            f.write(b"\0")
    return fresh


class Adversary:
    """The adversarial cases for one job (see `adversarial`), counted in a `Tally`."""

    def __init__(self, server: ForkServer, job: Job, work: Path, tally: Tally, ref: Path | None):
        self.server, self.original, self.tally, self.ref = server, job, tally, ref
        self.base = work / f"adv-{job.name}"
        shutil.rmtree(self.base, ignore_errors=True)
        self.job = _private(job, self.base)
        self.out = self.base / "out"

    def arg(self, flag: str) -> Path | None:
        argv = self.job.argv
        return Path(argv[argv.index(flag) + 1]) if flag in argv else None

    def run(self, argv: list, case: str, env: dict | None = None, job: Job | None = None) -> tuple[int, str]:
        log = self.base / f"{case.replace(' ', '-').replace('/', '_')}.log"
        code, = self.server.run([{"module": (job or self.job).module, "argv": argv, "env": env or {},
                                  "log": str(log)}])
        return code, log.read_text(errors="replace")

    def note(self, field_name: str, case: str, what: str) -> None:
        setattr(self.tally, field_name, getattr(self.tally, field_name) + 1)
        self.tally.notes.append(f"{self.job.name} {case}: {what}")

    def refused(self, case: str, code: int, text: str, needle: str = "", out: Path | None = None,
                leftovers_ok: bool = False) -> None:
        """One case that must end in exit 2 with one `error:` line holding `needle`, and no
        output (nor, unless `leftovers_ok`, a staging directory) written."""
        out = out or self.out
        self.tally.adversarial_cases += 1
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        made = [p.name for p in (out, out.with_name(out.name + ".partial"))[:1 if leftovers_ok else 2]
                if os.path.lexists(p)]
        if code == 0:
            self.note("wrong_data_exits", case, f"exit 0 (output made: {made})")
        elif code != 2 or len(errors) != 1 or needle not in errors[0] or "Traceback" in text:
            self.note("adversarial_failed", case, f"exit {code}, printed {text.strip().splitlines()[-3:]}")
        elif made:
            self.note("adversarial_failed", case, f"refused but left {made}")

    def intact(self, case: str, before: dict) -> None:
        """Count each path of `before` ({path: snapshot}) that a run changed."""
        for path, snap in before.items():
            if snapshot(path) != snap:
                self.note("damaged_foreign", case, f"{path} changed")

    def skip(self, case: str, why: str) -> None:
        self.tally.skipped.append(f"{self.job.name} {case}: {why}")

    # -- the cases ----------------------------------------------------------------------------
    def foreign_locks(self) -> None:
        """A plain file, a hard link to a user's file and a FIFO at OUT.lock: refused, kept."""
        lock, user = self.out.with_name(self.out.name + ".lock"), self.base / "user-notes.txt"
        user.write_text("a user's own notes, not a lock\n")
        makers = {"plain file": lambda: lock.write_text("some text, not a lock record\n"),
                  "hard link": lambda: os.link(user, lock), "FIFO": lambda: os.mkfifo(lock)}
        for what, make in makers.items():
            make()
            case, before = f"{what} at OUT.lock", {lock: snapshot(lock), user: snapshot(user)}
            code, text = self.run(self.job.command(self.out, resume=False), case)
            self.refused(case, code, text)
            self.intact(case, before)
            _clean(self.out)
            lock.unlink(missing_ok=True)

    def out_inside_inputs(self) -> None:
        """--out inside the source and equal to the data file's directory (--overwrite)."""
        src, data = self.arg("--model"), self.arg("--data-path")
        places = {}
        if src is not None and src.is_dir():
            places["--out inside the source"] = src / "sub"
        if data is not None:
            places["--out = the data's directory"] = data.parent
        for case, out in places.items():
            before = {p: snapshot(p) for p in (src, data.parent if data else None) if p is not None}
            code, text = self.run(self.job.command(out, resume=False, overwrite=True), case)
            self.refused(case, code, text, out=out / "never")  # out itself may exist: the data's dir
            self.intact(case, before)

    def source_replaced(self) -> None:
        """The source replaced by a changed copy while the job is paused at its first
        `PAUSE_POINTS` pass: nothing published, one line saying so."""
        case, src = "source replaced mid-job", self.arg("--model")
        point = next((p for p in PAUSE_POINTS if p in self.job.points), None)
        if point is None or src is None:
            return self.skip(case, f"no pause point among {PAUSE_POINTS} or no --model")
        old = src.with_name(src.name + ".old")

        def swap():
            fresh = _modified_copy(src)
            src.rename(old)
            fresh.rename(src)

        code, text, paused = self.paused_run(point, swap, case)
        if not paused:
            self.skip(case, f"the job never paused at {point}:1 (exit {code})")
        else:
            # its staging directory may stay: a --resume checks the source against it
            self.refused(case, code, text, needle="changed while the job ran", leftovers_ok=True)
            (shutil.rmtree if src.is_dir() else os.unlink)(src)
            old.rename(src)
        _clean(self.out)

    def paused_run(self, point: str, act, case: str) -> tuple[int, str, bool]:
        """Run the job paused at `point`:1 (`CMOE_FAULT_PAUSE`), `act()` while paused, then let
        it go on: (exit code, log, whether it paused)."""
        pause = self.base / "pause"
        shutil.rmtree(pause, ignore_errors=True)
        pause.mkdir()
        done, acted = threading.Event(), []

        def watch():
            while not (pause / "paused").exists():
                if done.wait(0.02):
                    return
            try:
                acted.append(act())
            finally:
                (pause / "go").touch()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        code, text = self.run(self.job.command(self.out, resume=False), case,
                              env={"CMOE_FAULT_PAUSE": f"{point}:1:{pause}"})
        done.set()
        watcher.join()
        return code, text, bool(acted)

    def changed_continuation(self) -> None:
        """A finished train run continued with `--resume` after its text was rewritten."""
        case, data = "continuation with changed text", self.arg("--data-path")
        _clean(self.out)
        code, text = self.run(self.job.command(self.out, resume=False), "continuation-first")
        if code != 0:
            return self.note("adversarial_failed", case, f"first run exited {code}: {text[-300:]}")
        original = data.read_text()
        data.write_text(" ".join(reversed(original.split())) + "\n")
        before = {self.out: snapshot(self.out)}  # the user's finished run: kept as it is
        code, text = self.run(self.job.command(self.out, resume=True), case)
        self.refused(case, code, text, needle="training text differs", out=self.out / "never")
        self.intact(case, before)
        data.write_text(original)
        _clean(self.out)

    def flipped_bytes(self) -> None:
        """Two bytes flipped in the middle of the largest file of the source's first layer."""
        case, src = "flipped bytes in the source's layer_0000", self.arg("--model")
        layer = src / "state" / "layer_0000" if src is not None else None
        files = [p for p in layer.rglob("*") if p.is_file()] if layer is not None and layer.is_dir() else []
        if not files:
            return  # not a converted source: the case does not apply
        big = max(files, key=lambda p: p.stat().st_size)
        with open(big, "r+b") as f:
            f.seek(big.stat().st_size // 2)
            two = f.read(2)
            f.seek(-len(two), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in two))
        code, text = self.run(self.job.command(self.out, resume=False), case)
        self.refused(case, code, text, needle="layer_0000")
        _clean(self.out)

    def full_tmpfs(self) -> None:
        """--out on a tmpfs too small for the output (root only): one line, nothing left but
        the staging directory, which a `--resume` on a larger tmpfs finishes into the reference."""
        case, mnt = "full tmpfs", self.base / "tmpfs"
        if os.geteuid() != 0:
            return self.skip(case, "not root: cannot mount a tmpfs")
        mnt.mkdir()
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self._small()}", "tmpfs", str(mnt)],
                               capture_output=True, text=True)
        if mount.returncode != 0:
            return self.skip(case, f"mount failed: {mount.stderr.strip()}")
        try:
            self._on_full(case, mnt / "out")
        finally:
            subprocess.run(["umount", str(mnt)], check=True)

    def _small(self) -> int:
        """A third of the reference output's bytes (whole pages), or 64 KiB without one."""
        if self.ref is None:
            return 64 << 10
        total = sum(p.stat().st_size for p in self.ref.rglob("*") if p.is_file())
        return max(8192, (total // 3) // 4096 * 4096)

    def _on_full(self, case: str, out: Path) -> None:
        # the shared inputs, not the private copies: the output must equal the reference
        code, text = self.run(self.original.command(out, resume=False), case, job=self.original)
        self.refused(case, code, text, out=out, leftovers_ok=True)
        left = sorted(p.name for p in out.parent.iterdir() if p.name != out.name + ".partial")
        if left:
            self.note("adversarial_failed", case, f"left {left} on the tmpfs")
        if self.ref is None or code == 0:
            return
        subprocess.run(["mount", "-o", "remount,size=256m", str(out.parent)], check=True)
        code, text = self.run(self.original.command(out, resume=True), f"{case} resume", job=self.original)
        if code != 0:
            self.note("adversarial_failed", case, f"--resume on a larger tmpfs exited {code}: {text[-300:]}")
        elif differences(self.ref, out):
            self.note("wrong_data_exits", case, f"--resume differs: {differences(self.ref, out)[:3]}")


def adversarial(server: ForkServer, job: Job, work: Path, tally: Tally | None = None,
                ref: Path | None = None) -> Tally:
    """The adversarial round for `job` (its fault points learnt by `reference`): foreign
    things at OUT.lock, --out inside its inputs, its source replaced mid-job, continuation with
    changed text (train), flipped bytes in a converted source, a full tmpfs (root). Counts
    `adversarial_cases`, `wrong_data_exits`, `damaged_foreign`, `adversarial_failed` and the
    skipped cases in `tally`; `ref` (the job's reference output) checks the tmpfs resume."""
    tally = tally or Tally()
    adv = Adversary(server, job, work, tally, ref)
    cases = [adv.foreign_locks, adv.out_inside_inputs, adv.source_replaced, adv.full_tmpfs]
    if job.module == "cmoe_jax.train.cli":
        cases.append(adv.changed_continuation)
    for case in [*cases, adv.flipped_bytes]:  # last: it damages the private source for good
        case()
    shutil.rmtree(adv.base, ignore_errors=True)
    return tally
