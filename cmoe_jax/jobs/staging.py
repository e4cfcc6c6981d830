"""`OUT.partial`: where a job works until it publishes, owned by the job that holds the lock.

A staging directory is created whole (a temporary directory holding its owner record,
`cmoe_job.json`, renamed into place), so a directory at `OUT.partial` without that record
was not made by a cmoe_jax job and is never deleted. The record holds the job's
fingerprint; `--resume` keeps the staged work only when the fingerprint is the same.

Publishing renames the finished directory to `OUT`. Replacing an existing `OUT` moves it
first into a fresh hidden directory beside it (`.OUT.old-XXXX`, created here and removed
after the swap), so no path the job did not create is ever deleted; a crash between the two
renames is repaired by the next job on that output, which puts the old `OUT` back.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from cmoe_jax.checkpoint import staging_dir, write_json_atomic
from cmoe_jax.errors import CheckpointError, CmoeError
from cmoe_jax.jobs.faults import fault_point
from cmoe_jax.jobs.fingerprint import check_same

OWNER = "cmoe_job.json"


class StagingError(CmoeError):
    """The staging directory cannot be used (not ours, or left in a state we cannot resume)."""


class Staging:
    """The staging directory of output `out` (only touched while its `OutputLock` is held)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.dir = staging_dir(self.out)
        self.parent = self.out.parent
        self.owned = False  # set once the directory is known to be this job's (made or verified)

    def _hidden(self, tag: str) -> str:
        return f".{self.out.name}.{tag}-"

    def recover(self) -> None:
        """Undo what a killed job of this output left half done: temporary staging
        directories (never renamed into place) are removed; an old output moved aside by an
        interrupted publish is put back when `OUT` is missing, else removed."""
        if not self.parent.is_dir():
            return
        for p in sorted(self.parent.glob(self._hidden("new") + "*")):
            shutil.rmtree(p, ignore_errors=True)
        for p in sorted(self.parent.glob(self._hidden("old") + "*")):
            held = p / self.out.name
            if held.exists() and not self.out.exists():
                os.replace(held, self.out)
            shutil.rmtree(p, ignore_errors=True)

    def owner_record(self) -> dict:
        path = self.dir / OWNER
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise StagingError(f"{self.dir} exists but was not made by a cmoe_jax job (no {OWNER}): "
                               "move it away or choose another --out") from None
        except ValueError:
            raise StagingError(f"{path} is damaged: remove {self.dir} to start over") from None

    def exists(self) -> bool:
        return self.dir.exists()

    def open(self, fingerprint: dict, resume: bool, files: dict | None = None) -> bool:
        """Make the staging directory ready; True when it holds work to resume from.

        With `resume` an existing staging directory must carry the same fingerprint (else a
        one-line error); without it, a staging directory of ours is started over. `files`
        ({name: JSON object}) are written into a new staging directory before it appears."""
        if self.dir.exists():
            saved = self.owner_record()
            if resume:
                check_same(saved, fingerprint, self.dir)
                self.owned = True
                return True
            shutil.rmtree(self.dir)
        try:
            tmp = Path(tempfile.mkdtemp(dir=self.parent, prefix=self._hidden("new")))
        except OSError as e:
            raise StagingError(f"cannot create a staging directory beside {self.out} ({e.strerror}): "
                               "choose a writable --out") from None
        write_json_atomic(tmp / OWNER, fingerprint)
        for name, obj in (files or {}).items():
            write_json_atomic(tmp / name, obj)
        os.chmod(tmp, 0o755)
        os.rename(tmp, self.dir)
        self.owned = True
        fault_point("staged")
        return False

    def publish(self, finished: Path, overwrite: bool) -> None:
        """Rename `finished` (inside the staging directory) to `out`, then remove the
        staging directory. An existing `out` is replaced only with `overwrite`."""
        finished = Path(finished)
        fault_point("publish")
        if self.out.exists() or self.out.is_symlink():
            if not overwrite:
                raise CheckpointError(f"{self.out} exists: pass --overwrite to replace it")
            aside = Path(tempfile.mkdtemp(dir=self.parent, prefix=self._hidden("old")))
            os.replace(self.out, aside / self.out.name)
            fault_point("publish:swap")
            os.replace(finished, self.out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(finished, self.out)
        fault_point("published")
        shutil.rmtree(self.dir, ignore_errors=True)

    def discard(self) -> None:
        """Remove the staging directory, only when it is this job's."""
        if self.owned:
            shutil.rmtree(self.dir, ignore_errors=True)
