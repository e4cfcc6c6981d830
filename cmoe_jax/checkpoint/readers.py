"""A model directory's readers' lock: an `flock` on its manifest (or an exported directory's
record), shared while a reader reads it, exclusive while a publish moves it away."""
from __future__ import annotations

import errno
import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path

from cmoe_jax.checkpoint.layout import MANIFEST
from cmoe_jax.errors import CheckpointError

READERS_LOCKED = (MANIFEST, "cmoe_export.json")  # the record whose flock is a directory's readers' lock
# (st_dev, st_ino) of every readers' lock this thread holds shared, with how many times: an
# `flock` taken again by the same thread on another descriptor of the same file would wait on
# itself for ever (another thread's shared lock is waited for, as another process's)
_THREAD = threading.local()


def _held() -> dict[tuple[int, int], int]:
    if not hasattr(_THREAD, "held"):
        _THREAD.held = {}
    return _THREAD.held


def _readers_lock_file(directory: Path) -> Path:
    """The file whose `flock` guards the directory's readers: a converted model's manifest or an
    exported Hugging Face directory's record."""
    for name in READERS_LOCKED:
        if (Path(directory) / name).exists() or (Path(directory) / name).is_symlink():
            return Path(directory) / name
    return Path(directory) / MANIFEST


def _open_manifest(directory: Path) -> int | None:
    path = _readers_lock_file(directory)
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symbolic link: a model "
                                  "directory's files must be its own; write it again") from None
        raise


@contextmanager
def reading(directory: Path):
    """Hold the shared side of the directory's readers' lock (an `flock` on its manifest)
    while reading it: an overwrite waits for it (`readers_excluded`), so a reader sees the
    old model or the new one, never layers of both."""
    while True:
        fd = _open_manifest(directory)
        if fd is None:  # no manifest: read_manifest says so in one line
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.fstat(fd).st_ino == os.stat(_readers_lock_file(directory)).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # replaced between the open and the lock: read the new one
    key, held = _key(fd), _held()
    held[key] = held.get(key, 0) + 1
    try:
        yield
    finally:
        held[key] -= 1
        if not held[key]:
            del held[key]
        os.close(fd)


def _key(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


@contextmanager
def readers_excluded(directory: Path):
    """The exclusive side of `reading`: held while a publish moves `directory` away."""
    fd = _open_manifest(directory) if Path(directory).is_dir() else None
    try:
        if fd is not None and _key(fd) in _held():
            raise CheckpointError(f"{directory} is being read by this job itself: a job never replaces "
                                  "what it reads; choose an --out apart from its inputs")
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)
