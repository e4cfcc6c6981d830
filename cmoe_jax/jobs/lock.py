"""An exclusive lock per output directory, so two jobs never write the same `--out`.

The lock is an `fcntl.flock` on `OUT.lock` beside the output, taken before any work and
held to the end; the kernel drops it when the holder dies, so a killed job never leaves a
stale lock. The holder writes its pid, host and command into the file, and a second job
names them in its one-line error. The file is removed when the lock is released (a job
that takes it checks that the file it locked is still the one at the path).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from cmoe_jax.errors import CmoeError


class OutputBusyError(CmoeError):
    """Another job holds the lock of the same output directory."""


class OutputPlaceError(CmoeError):
    """The output's directory cannot be created or written."""


def lock_path(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".lock")


def _holder(path: Path) -> str:
    for _ in range(20):  # the holder writes its record right after locking
        try:
            info = json.loads(path.read_text() or "null")
        except (OSError, ValueError):
            info = None
        if info:
            command = info.get("command", "?")
            command = command if len(command) <= 120 else command[:117] + "..."
            return f"pid {info.get('pid')} on {info.get('host')}: {command}"
        time.sleep(0.01)
    return "holder not recorded"


class OutputLock:
    """`with OutputLock(out):` - exclusive right to write `out` and `out.partial`."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = lock_path(self.out)
        self._fd = None
        self._made: list[Path] = []  # parent directories made here (removed again if left empty)

    def _make_parents(self) -> None:
        missing = [p for p in [self.out.parent, *self.out.parent.parents] if not p.exists()]
        try:
            for p in reversed(missing):
                p.mkdir()
                self._made.append(p)
        except OSError as e:
            self._remove_made()
            raise OutputPlaceError(f"cannot create the directory of {self.out} ({e.strerror}): "
                                   "choose a writable --out") from None

    def _remove_made(self) -> None:
        for p in reversed(self._made):
            try:
                p.rmdir()  # only while empty: a published output keeps its parents
            except OSError:
                break
        self._made = []

    def acquire(self) -> "OutputLock":
        self._make_parents()
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                self._remove_made()
                raise OutputPlaceError(f"cannot write beside {self.out} ({e.strerror}): choose a "
                                       "writable --out") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._remove_made()
                raise OutputBusyError(
                    f"{self.out} is being written by another job ({_holder(self.path)}): wait for it "
                    "to finish or choose another --out") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed the file after we opened it: retry
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None
            self._remove_made()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
