"""`OUT.partial`: where a job works until it publishes, owned by the job that holds the lock.

A staging directory is created whole (a temporary directory holding its owner record,
`cmoe_job.json`, renamed into place), so a directory at `OUT.partial` without that record
was not made by a cmoe_jax job and is never deleted; a symbolic link there is refused. The
record holds the job's fingerprint; `--resume` keeps the staged work only when the
fingerprint is the same.

Every other path a job makes beside the output (the temporary staging directory, the old
output moved aside by an overwrite, a directory being deleted) has a name unique to the run
(`.OUT.new-PID-XXXXXXXX`, `.OUT.old-...`, `.OUT.trash-...`), made with `mkdir` (never an
existing one) and recorded in the lock file before it exists. The next job on the output
repairs exactly those paths of a killed job (an old output put back when `OUT` is missing,
the rest removed) and never touches a sibling that merely matches the pattern.

Publishing renames the finished directory to `OUT`; replacing an existing converted model
first takes the exclusive side of its readers' lock (`cmoe_jax.checkpoint.readers_excluded`),
so a reader loading it sees the old model or the new one, never a mix.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

from cmoe_jax.atomic_files import remove_write_leftovers, write_json_atomic
from cmoe_jax.checkpoint import MANIFEST, readers_excluded
from cmoe_jax.checkpoint.seal import write_sealed
from cmoe_jax.errors import CheckpointError, CmoeError
from cmoe_jax.faults import fault_point
from cmoe_jax.jobs.fingerprint import ResumeMismatchError, check_same
from cmoe_jax.jobs.lock import OutputLock

OWNER = "cmoe_job.json"
TAGS = ("new", "old", "trash")


def staging_dir(out: Path) -> Path:
    """Where a job writing `out` works until it publishes: `out.partial`."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


class StagingError(CmoeError):
    """The staging directory cannot be used (not ours, or left in a state we cannot resume)."""


def remove_tree(path: Path) -> None:
    """Delete a directory of ours file by file (a fault point per file: a kill inside the
    cleanup is part of what the fault campaign tries)."""
    for root, dirs, files in os.walk(path, topdown=False):
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]  # a link, never its target
        for name in files + links:
            os.unlink(os.path.join(root, name))
            fault_point("cleanup")
        for name in dirs:
            if name not in links:
                os.rmdir(os.path.join(root, name))
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.isdir(path):
        os.rmdir(path)


class Staging:
    """The staging directory of output `out` (only touched while its `OutputLock` is held)."""

    def __init__(self, out: Path, lock: OutputLock):
        self.out = Path(out)
        self.dir = staging_dir(self.out)
        self.parent = self.out.parent
        self.lock = lock  # held by the job: where the paths made here are recorded
        self.owned = False  # set once the directory is known to be this job's (made or verified)
        self.fingerprint: dict | None = None

    def _unique(self, tag: str) -> Path:
        """A new empty directory beside the output, recorded in the lock before it exists."""
        name = f".{self.out.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"
        self.lock.record(name)
        try:
            os.mkdir(self.parent / name, 0o700)
        except OSError as e:
            self.lock.forget(name)
            raise StagingError(f"cannot create a directory beside {self.out} ({e.strerror}): "
                               "choose a writable --out") from None
        return self.parent / name

    def _drop(self, path: Path) -> None:
        """Remove a directory of ours (recorded), then its record."""
        if path.is_dir() and not path.is_symlink():
            remove_tree(path)
        self.lock.forget(path.name)

    def recover(self) -> None:
        """Undo what a killed job of this output left half done, by its lock's record only:
        an old output it moved aside is put back when `OUT` is missing; the rest is removed."""
        for name in self.lock.left:
            tag = name.removeprefix(f".{self.out.name}.").split("-", 1)[0]
            path = self.parent / name
            if tag not in TAGS or not name.startswith(f".{self.out.name}.") or path.is_symlink():
                continue
            self.lock.record(name)  # ours now, until it is gone
            held = path / self.out.name
            if tag == "old" and (held.exists() or held.is_symlink()) and not (
                    self.out.exists() or self.out.is_symlink()):
                os.replace(held, self.out)
            self._drop(path)
        self.lock.left = []

    def owner_record(self) -> dict:
        path = self.dir / OWNER
        if self.dir.is_symlink():
            raise StagingError(f"{self.dir} is a symbolic link, not a staging directory of ours: "
                               "remove it or choose another --out")
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise StagingError(f"{self.dir} exists but was not made by a cmoe_jax job (no {OWNER}): "
                               "move it away or choose another --out") from None
        except ValueError:
            raise StagingError(f"{path} is damaged: remove {self.dir} to start over") from None

    def exists(self) -> bool:
        return self.dir.exists() or self.dir.is_symlink()

    def open(self, fingerprint: dict, resume: bool, files: dict | None = None) -> bool:
        """Make the staging directory ready; True when it holds work to resume from.

        With `resume` an existing staging directory must carry the same fingerprint (else a
        one-line error); without it, a staging directory of ours is started over. `files`
        ({name: JSON object}) are written into a new staging directory before it appears."""
        self.fingerprint = fingerprint
        if self.exists():
            saved = self.owner_record()
            if resume:
                check_same(saved, fingerprint, self.dir)
                remove_write_leftovers(self.dir)  # a kill inside a JSON write left its temporary
                self.owned = True
                return True
            self._discard_dir()
        tmp = self._unique("new")
        write_json_atomic(tmp / OWNER, fingerprint)
        for name, obj in (files or {}).items():
            write_json_atomic(tmp / name, obj)
        os.chmod(tmp, 0o755)
        os.rename(tmp, self.dir)
        self.lock.forget(tmp.name)
        self.owned = True
        fault_point("staged")
        return False

    def publish(self, finished: Path, overwrite: bool) -> None:
        """Rename `finished` (inside the staging directory) to `out`, then remove the
        staging directory. An existing `out` is replaced only with `overwrite`."""
        finished = Path(finished)
        self._record_inputs(finished)
        fault_point("publish")
        if self.out.exists() or self.out.is_symlink():
            if not overwrite:
                raise CheckpointError(f"{self.out} exists: pass --overwrite to replace it")
            aside = self._unique("old")
            with readers_excluded(self.out):
                os.replace(self.out, aside / self.out.name)
                fault_point("publish:swap")
                os.replace(finished, self.out)
            fault_point("published:swap")
            self._drop(aside)
        else:
            os.replace(finished, self.out)
        fault_point("published")
        self._discard_dir()

    def _record_inputs(self, finished: Path) -> None:
        """The fingerprint's content digests, added to the finished output's manifest."""
        if self.fingerprint is None:
            return
        for name in (MANIFEST, "cmoe_export.json"):
            path = finished / name
            if path.is_file():
                manifest = json.loads(path.read_text())
                manifest["inputs"] = input_digests(self.fingerprint)
                (write_sealed if name == MANIFEST else write_json_atomic)(path, manifest)

    def _discard_dir(self) -> None:
        """Move the staging directory to a recorded trash name, then delete it there: a kill
        in between leaves nothing at `OUT.partial` that a rerun could not clear."""
        trash = self._unique("trash")
        os.replace(self.dir, trash / self.dir.name)
        fault_point("discarded")
        self._drop(trash)

    def discard(self) -> None:
        """Remove the staging directory, only when it is this job's."""
        if self.owned and self.exists():
            self._discard_dir()


def input_digests(fingerprint: dict) -> dict:
    """What a manifest records of a job's inputs: the data's token digest, the source's
    total size and one sha256 over its files' (name, size, sha256)."""
    source = fingerprint.get("source", {})
    return {"data_sha256": fingerprint.get("data"),
            "source_bytes": sum(v[0] for v in source.values()),
            "source_sha256": hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()}


def check_continued_inputs(out: Path, fingerprint: dict, data_may_differ: bool = False) -> dict:
    """Continuing a finished run in `out` follows the rule of a resume: the source and the data
    it was published from (its manifest's `inputs`, returned) must be what the job reads now;
    other data only when the user asked for it (`data_may_differ`)."""
    try:
        recorded = json.loads((Path(out) / MANIFEST).read_text()).get("inputs")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if not isinstance(recorded, dict):
        raise ResumeMismatchError(f"--resume: {out} does not record the inputs it was made from, so "
                                  "continuing it could mix two of them: rerun with --overwrite to start over")
    now = input_digests(fingerprint)
    if recorded.get("source_sha256") != now["source_sha256"]:
        raise ResumeMismatchError(f"--resume: the source model changed since {out} was made (its files "
                                  "differ in content); restore it, or rerun with --overwrite to start over")
    if recorded.get("data_sha256") != now["data_sha256"] and not data_may_differ:
        raise ResumeMismatchError(f"--resume: the training text differs from the one {out} was made with "
                                  "(its tokens have another digest); restore that text, pass --new-data "
                                  "to continue on this one, or rerun with --overwrite to start over")
    return recorded
