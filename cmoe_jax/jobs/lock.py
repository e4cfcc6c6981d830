"""An exclusive lock per output directory, so two jobs never write the same `--out`.

The lock is an `fcntl.flock` on `OUT.lock` beside the output, taken before any work and
held to the end; the kernel drops it when the holder dies, so a killed job never leaves a
stale lock. The holder writes a record into the file (a marker, its run id, pid, host and
command), and a second job names them in its one-line error. The file is removed when the
lock is released, unless it still lists paths to clean up (below), and only while it is
still the file this run locked, carrying this run's id.

A job writes only a lock file that a job made: it creates `OUT.lock` exclusively
(`O_EXCL`), or takes over one whose content is a lock record (or empty: a job killed
between creating and recording it) and that has no other name (one hard link). Anything
else at the path (a user's file, a hard link to one, a FIFO, a symbolic link) is refused
and left exactly as it is. A job that cannot write its record (a full disk) removes the
file it created.

The record also lists every path the holder is about to create beside the output (each
name unique to its run: pid plus a random suffix), written before the path exists, so the
next job on the output cleans up exactly what a killed holder left, and never a sibling
that merely looks like one.

The lock file's own handling (opening it safely, reading its record, naming its holder,
the parent directories made for it) is `cmoe_jax.jobs.lock_file`.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import sys
from pathlib import Path

from cmoe_jax.errors import CmoeError
from cmoe_jax.jobs.lock_file import (MARKER, MadeParents, OutputPlaceError, at_path, holder, lock_path,
                                     open_lock_file, read_record, recorded_paths, taken_over)

__all__ = ["MARKER", "OutputBusyError", "OutputLock", "OutputPlaceError", "lock_path"]


class OutputBusyError(CmoeError):
    """Another job holds the lock of the same output directory."""


class OutputLock:
    """`with OutputLock(out):` - exclusive right to write `out` and `out.partial`."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = lock_path(self.out)
        self._fd = None
        self.left: list[str] = []  # paths a killed previous holder recorded (see `record`)
        self._paths: list[str] = []
        self._parents = MadeParents(self.out)  # removed again if left empty
        self.run_id = secrets.token_hex(8)
        self._created = False

    def acquire(self) -> "OutputLock":
        self._parents.make()
        try:
            fd, created = self._lock()
            previous = {} if created else taken_over(fd, self.path)
        except Exception:
            self._parents.remove()
            raise
        self.left = recorded_paths(previous)  # a released lock's file is gone: a dead job's paths
        self._fd, self._created = fd, created
        self._write_first(previous)
        return self

    def _lock(self) -> tuple[int, bool]:
        """(fd, created) of the lock file, locked here; `OutputBusyError` when another job holds it."""
        while True:
            fd, created = open_lock_file(self.path, self.out)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputBusyError(
                    f"{self.out} is being written by another job ({holder(self.path)}): wait for it "
                    "to finish or choose another --out") from None
            if at_path(fd, self.path):
                return fd, created
            os.close(fd)  # the previous holder removed the file after we opened it: retry

    def _write_first(self, previous: dict) -> None:
        """The first record; on failure (a full disk) a file made here is removed, a dead job's
        record is put back, and the error goes on."""
        try:
            self._write()
        except OSError:
            if self._created:
                os.unlink(self.path)
            elif previous:
                with contextlib.suppress(OSError):
                    data = json.dumps(previous).encode()
                    os.pwrite(self._fd, data, 0)
                    os.ftruncate(self._fd, len(data))
            os.close(self._fd)
            self._fd = None
            self._parents.remove()
            raise

    def _write(self) -> None:
        record = {"marker": MARKER, "run": self.run_id, "pid": os.getpid(), "host": socket.gethostname(),
                  "command": " ".join(sys.argv), "paths": self._paths}
        data = json.dumps(record).encode()
        try:
            os.pwrite(self._fd, data, 0)
            os.ftruncate(self._fd, len(data))
            os.fsync(self._fd)
        except OSError as e:  # name the file: a write on a descriptor carries no path
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def record(self, name: str) -> None:
        """Note `name` (a path beside the output, by name) before creating it."""
        self._paths.append(name)
        self._write()

    def forget(self, name: str) -> None:
        """`name` is gone again: drop it from the record."""
        if name in self._paths:
            self._paths.remove(name)
            self._write()

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if not self._paths and at_path(self._fd, self.path) and \
                    (read_record(self._fd) or {}).get("run") == self.run_id:
                with contextlib.suppress(OSError):  # a refusal here must not hide the job's own error:
                    self.path.unlink()  # the record stays, and the next job takes it over
        finally:
            os.close(self._fd)
            self._fd = None
            self._parents.remove()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
