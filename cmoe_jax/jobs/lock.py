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
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
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


MARKER = "cmoe_jax.output_lock"


def _read_record(fd: int) -> dict | None:
    """The lock record in the file open at `fd`: {} when empty, None when not a record of ours."""
    data = os.pread(fd, 1 << 20, 0)
    if not data:
        return {}
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("marker") == MARKER else None


def _recorded_paths(record: dict) -> list[str]:
    """The names a previous holder recorded (plain names beside the output only)."""
    paths = record.get("paths", [])
    return [p for p in paths if isinstance(p, str) and p and "/" not in p and p not in (".", "..")] \
        if isinstance(paths, list) else []


def _holder(path: Path) -> str:
    for _ in range(20):  # the holder writes its record right after locking
        try:
            info = json.loads(path.read_text() or "null")
        except (OSError, ValueError):
            info = None
        if isinstance(info, dict) and info.get("marker") == MARKER:
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
        self.run_id = secrets.token_hex(8)
        self._created = False

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
            fd, created = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._remove_made()
                raise OutputBusyError(
                    f"{self.out} is being written by another job ({_holder(self.path)}): wait for it "
                    "to finish or choose another --out") from None
            if self._at_path(fd):
                break
            os.close(fd)  # the previous holder removed the file after we opened it: retry
        previous = {} if created else self._taken_over(fd)
        self.left = _recorded_paths(previous)  # a released lock's file is gone: a dead job's paths
        self._fd, self._created = fd, created
        self._write_first(previous)
        return self

    def _at_path(self, fd: int) -> bool:
        """Whether the file open at `fd` is still the one at the lock's path."""
        try:
            return os.fstat(fd).st_ino == os.lstat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _refuse(self, fd: int | None, what: str):
        if fd is not None:
            os.close(fd)
        self._remove_made()
        raise OutputPlaceError(f"{self.path} {what}: a job writes only a lock file a job made, and "
                               "leaves this one as it is; remove it or choose another --out")

    def _open(self) -> tuple[int, bool]:
        """(fd, created): `OUT.lock` created exclusively, else the existing one opened as it is
        (never through a symbolic link, never blocking on a FIFO) and checked to be a plain
        file with no other name."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        while True:
            try:
                return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                pass
            except OSError as e:
                self._place_error(e)
            try:
                fd = os.open(self.path, flags)
                break
            except FileNotFoundError:
                continue  # removed between the two opens: create it
            except OSError as e:
                self._place_error(e)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            self._refuse(fd, "is not a regular file")
        if info.st_nlink != 1:
            self._refuse(fd, f"is a hard link ({info.st_nlink} names for one file)")
        return fd, False

    def _place_error(self, e: OSError):
        self._remove_made()
        if e.errno == errno.ELOOP:
            raise OutputPlaceError(f"{self.path} is a symbolic link: a job never writes through "
                                   "one; remove it (it is not ours) or choose another --out") from None
        if e.errno == errno.EISDIR:
            self._refuse(None, "is a directory")
        raise OutputPlaceError(f"cannot write beside {self.out} ({e.strerror}): choose a "
                               "writable --out") from None

    def _taken_over(self, fd: int) -> dict:
        """The record of a dead job's lock file (now locked here), or a refusal when the file
        holds anything else."""
        previous = _read_record(fd)
        if previous is None:
            self._refuse(fd, "holds a file that no cmoe_jax job wrote")
        return previous

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
            self._remove_made()
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
            if not self._paths and self._at_path(self._fd) and \
                    (_read_record(self._fd) or {}).get("run") == self.run_id:
                with contextlib.suppress(OSError):  # a refusal here must not hide the job's own error:
                    self.path.unlink()  # the record stays, and the next job takes it over
        finally:
            os.close(self._fd)
            self._fd = None
            self._remove_made()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
