"""One output-writing job: the output checked, locked, staged, published, cleaned up.

    with OutputDir(out, "convert", overwrite=..., resume=...) as job:   # lock taken here
        ...check the inputs...
        resuming = job.open(fingerprint)       # OUT.partial made, or verified for --resume
        ...work, saving resumable pieces under job.staging.dir...
        job.publish(job.staging.dir / "final")

Leaving the block by an error removes the staging directory when nothing resumable was
saved in it (`resumable`: globs under it), and always releases the lock. Over several
processes only process 0 touches files; errors reach every process (none waits forever).
"""
from __future__ import annotations

import os
from pathlib import Path

from cmoe_jax import distributed
from cmoe_jax.errors import CmoeError
from cmoe_jax.jobs.lock import OutputLock, OutputPlaceError, lock_path
from cmoe_jax.jobs.staging import Staging


class OutputExistsError(CmoeError):
    """`--out` exists and `--overwrite` was not given."""


def check_output_free(out: Path, overwrite: bool, hint: str = "", repair: bool = True) -> None:
    """Refuse a `--out` that exists (without `overwrite`) or is a symbolic link to nothing, before
    any work; a refused job still clears what a job killed after publishing left (`repair`)."""
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise OutputPlaceError(f"--out {out} is a symbolic link to nothing ({os.readlink(out)}): "
                               "remove the link or choose another --out")
    if out.exists() and not overwrite:
        if repair:
            _repair(out)
        raise OutputExistsError(f"output directory {out} exists: pass --overwrite to replace it{hint}")


def _repair(out: Path) -> None:
    """Remove the recorded leftovers (`.OUT.trash-*`, a stale `OUT.lock`) of a dead job on `out`,
    when its lock is free and a job's; anything else is left as it is."""
    if not distributed.is_main() or not lock_path(out).is_file():
        return
    lock = OutputLock(out)
    try:
        lock.acquire()
    except (CmoeError, OSError):
        return  # held by a live job, or not a job's file: not ours to touch
    try:
        Staging(out, lock).recover()
    finally:
        lock.release()


class OutputDir:
    """Lock, staging directory and publish of one job's `--out` (see the module docstring)."""

    def __init__(self, out: Path, job: str, *, overwrite: bool = False, resume: bool = False,
                 resumable: tuple[str, ...] = (), out_may_exist: bool | None = None):
        self.out, self.job, self.overwrite, self.resume = Path(out), job, overwrite, resume
        self.resumable = resumable
        self.out_may_exist = overwrite if out_may_exist is None else out_may_exist
        self.main = distributed.is_main()
        self._lock = OutputLock(self.out)
        self.staging = Staging(self.out, self._lock)
        self._opened = False

    def __enter__(self) -> "OutputDir":
        distributed.on_main(self._take)
        return self

    def _take(self) -> None:
        """Lock the output, then finish what a killed job of it left half done."""
        self._lock.acquire()
        try:
            self.staging.recover()  # what a killed job of this output recorded and left half done
            if not self.out_may_exist:  # again under the lock: a job may have published it
                check_output_free(self.out, False, repair=False)
        except CmoeError:
            self._lock.release()
            raise

    def open(self, fingerprint: dict) -> bool:
        """Create or verify the staging directory (see `Staging.open`); True when resuming."""
        return self.on_main(lambda staging: staging.open(fingerprint, self.resume))

    def on_main(self, prepare):
        """`prepare(staging)` run by process 0 alone (a job's own way of opening its staging
        directory); its result is shared with every process, its error raised on all."""
        self._opened = True
        return distributed.on_main(lambda: prepare(self.staging))

    def has_resumable_work(self) -> bool:
        d = self.staging.dir
        return d.exists() and any(any(d.glob(g)) for g in self.resumable)

    def publish(self, finished: Path, overwrite: bool | None = None) -> None:
        if self.main:
            self.staging.publish(finished, self.overwrite if overwrite is None else overwrite)

    def __exit__(self, kind, value, tb):
        try:
            if kind is not None and self.main and self._opened and not self.has_resumable_work():
                try:
                    self.staging.discard()
                except (CmoeError, OSError):  # a full disk may refuse even this: the error in flight
                    pass                      # is the one to report; the next job clears it
        finally:
            if self.main:
                self._lock.release()
        return False
