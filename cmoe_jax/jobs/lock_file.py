"""The file `OUT.lock` itself, for `cmoe_jax.jobs.lock.OutputLock`: opened only when a job
made it (created exclusively, or an existing plain file with one name, never through a
symbolic link, never blocking on a FIFO), its record read, and its holder named.

Everything here refuses by raising `OutputPlaceError` after closing what it opened; the lock
removes the parent directories it made (`MadeParents`)."""
from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path

from cmoe_jax.errors import CmoeError

MARKER = "cmoe_jax.output_lock"


class OutputPlaceError(CmoeError):
    """The output's directory cannot be created or written."""


def lock_path(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".lock")


def read_record(fd: int) -> dict | None:
    """The lock record in the file open at `fd`: {} when empty, None when not a record of ours."""
    data = os.pread(fd, 1 << 20, 0)
    if not data:
        return {}
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("marker") == MARKER else None


def recorded_paths(record: dict) -> list[str]:
    """The names a previous holder recorded (plain names beside the output only)."""
    paths = record.get("paths", [])
    return [p for p in paths if isinstance(p, str) and p and "/" not in p and p not in (".", "..")] \
        if isinstance(paths, list) else []


def holder(path: Path) -> str:
    """Who holds the lock at `path`, as its record names it (pid, host, command)."""
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


def at_path(fd: int, path: Path) -> bool:
    """Whether the file open at `fd` is still the one at `path`."""
    try:
        return os.fstat(fd).st_ino == os.lstat(path).st_ino
    except FileNotFoundError:
        return False


def refuse(fd: int | None, path: Path, what: str):
    if fd is not None:
        os.close(fd)
    raise OutputPlaceError(f"{path} {what}: a job writes only a lock file a job made, and "
                           "leaves this one as it is; remove it or choose another --out")


def open_lock_file(path: Path, out: Path) -> tuple[int, bool]:
    """(fd, created): `path` created exclusively, else the existing file opened as it is
    (never through a symbolic link, never blocking on a FIFO) and checked to be a plain
    file with no other name."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    while True:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            pass
        except OSError as e:
            _place_error(e, path, out)
        try:
            fd = os.open(path, flags)
            break
        except FileNotFoundError:
            continue  # removed between the two opens: create it
        except OSError as e:
            _place_error(e, path, out)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        refuse(fd, path, "is not a regular file")
    if info.st_nlink != 1:
        refuse(fd, path, f"is a hard link ({info.st_nlink} names for one file)")
    return fd, False


def taken_over(fd: int, path: Path) -> dict:
    """The record of a dead job's lock file (now locked here), or a refusal when the file
    holds anything else."""
    previous = read_record(fd)
    if previous is None:
        refuse(fd, path, "holds a file that no cmoe_jax job wrote")
    return previous


def _place_error(e: OSError, path: Path, out: Path):
    if e.errno == errno.ELOOP:
        raise OutputPlaceError(f"{path} is a symbolic link: a job never writes through "
                               "one; remove it (it is not ours) or choose another --out") from None
    if e.errno == errno.EISDIR:
        refuse(None, path, "is a directory")
    raise OutputPlaceError(f"cannot write beside {out} ({e.strerror}): choose a "
                           "writable --out") from None


class MadeParents:
    """The missing parent directories of `out`, made (`make`) and removed again while empty
    (`remove`): a refused or released lock leaves no directory it made, a published output
    keeps its parents."""

    def __init__(self, out: Path):
        self.out, self.made = out, []

    def make(self) -> None:
        missing = [p for p in [self.out.parent, *self.out.parent.parents] if not p.exists()]
        try:
            for p in reversed(missing):
                p.mkdir()
                self.made.append(p)
        except OSError as e:
            self.remove()
            raise OutputPlaceError(f"cannot create the directory of {self.out} ({e.strerror}): "
                                   "choose a writable --out") from None

    def remove(self) -> None:
        for p in reversed(self.made):
            try:
                p.rmdir()  # only while empty
            except OSError:
                break
        self.made = []
