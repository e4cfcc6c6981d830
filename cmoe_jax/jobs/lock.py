"""An exclusive lock per output directory, so two jobs never write the same `--out`.

The lock is an `fcntl.flock` on `OUT.lock` beside the output, taken before any work and
held to the end; the kernel drops it when the holder dies, so a killed job never leaves a
stale lock. The holder writes its pid, host and command into the file, and a second job
names them in its one-line error. The file is removed when the lock is released, unless it
still lists paths to clean up (below); a job that takes it checks that the file it locked is
still the one at the path.

The record also lists every path the holder is about to create beside the output (each
name unique to its run: pid plus a random suffix), written before the path exists, so the
next job on the output cleans up exactly what a killed holder left, and never a sibling
that merely looks like one. The lock file is opened with `O_NOFOLLOW` and must be a
regular file: a symbolic link planted at `OUT.lock` is refused, never written through.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
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


def _recorded_paths(fd: int) -> list[str]:
    """The names a previous holder recorded in the lock file open at `fd`."""
    try:
        info = json.loads(os.pread(fd, 1 << 20, 0) or b"null")
        paths = info.get("paths", []) if isinstance(info, dict) else []
    except ValueError:
        return []
    return [p for p in paths if isinstance(p, str) and p and "/" not in p and p not in (".", "..")]


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
        self.left: list[str] = []  # paths a killed previous holder recorded (see `record`)
        self._paths: list[str] = []
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
            fd = self._open()
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
        self.left = _recorded_paths(fd)  # a released lock's file is gone: these are a dead job's
        self._fd = fd
        self._write()
        return self

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._remove_made()
            if e.errno == errno.ELOOP:
                raise OutputPlaceError(f"{self.path} is a symbolic link: a job never writes through "
                                       "one; remove it (it is not ours) or choose another --out") from None
            raise OutputPlaceError(f"cannot write beside {self.out} ({e.strerror}): choose a "
                                   "writable --out") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self._remove_made()
            raise OutputPlaceError(f"{self.path} is not a regular file: remove it (it is not ours) "
                                   "or choose another --out")
        return fd

    def _write(self) -> None:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                  "paths": self._paths}
        data = json.dumps(record).encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        os.fsync(self._fd)

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
            if not self._paths:  # else keep the record: the next job removes what it lists
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None
            self._remove_made()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
