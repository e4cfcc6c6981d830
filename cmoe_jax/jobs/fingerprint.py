"""What a resumable job started from: its settings, its source files by content (size and
sha256) and the calibration or training data by content (a digest of the tokens it uses),
so a resume only keeps staged work that the same inputs would produce again. A data file
rewritten between a kill and `--resume` is refused, not mixed in.

Hashing streams each file once at the job's start: sha256 runs at about 1.3 GB/s on one
core of the machine the guide names (docs/guides/outputs.md), seconds for a 7B checkpoint."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from cmoe_jax.errors import CmoeError


class ResumeMismatchError(CmoeError):
    """`--resume` found staged work from other settings or another source."""


def content_digest(path: Path) -> str:
    """sha256 of a file's content, streamed in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(path: Path):
    """(relative name, path) of a checkpoint file, or of every file under a checkpoint
    directory (hidden files and the tokenizer's cache skipped), in a fixed order."""
    path = Path(path)
    if path.is_file():
        yield path.name, path
        return
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if not name.startswith("."):
                yield str((Path(root) / name).relative_to(path)), Path(root) / name


def source_files(path: Path) -> dict[str, list]:
    """{relative name: [size, sha256]} of a checkpoint file or directory (see `_files`)."""
    return {name: [p.stat().st_size, content_digest(p)] for name, p in _files(path)}


class InputChangedError(CmoeError):
    """A file the job reads was replaced or written while the job ran."""


def input_stamps(paths: dict) -> dict:
    """{what: {name: (inode, size, mtime, ctime)}} of every local input path: any write or
    replacement changes a file's ctime or inode (a user cannot set ctime back), so comparing
    stamps taken at the start and before publishing sees a change without hashing again."""
    stamps = {}
    for what, path in paths.items():
        if path and Path(path).exists():
            stamps[what] = {"": [os.stat(path).st_ino],  # the path itself: replaced or not
                            **{name: _stamp(p) for name, p in _files(path)}}
    return stamps


def _stamp(path: Path) -> list:
    st = os.stat(path)
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class InputWatch:
    """`InputWatch(paths)` stamps a job's inputs ({what: path}) now; `check()` before publishing
    gives one line if any of them was written or replaced since."""

    def __init__(self, paths: dict):
        self.paths, self.stamps = paths, input_stamps(paths)

    def check(self) -> None:
        check_unchanged(self.stamps, self.paths)


def check_unchanged(before: dict, paths: dict) -> None:
    """One line when an input's files changed since `before` (`input_stamps`)."""
    now = input_stamps({what: paths[what] for what in before})
    for what, stamps in before.items():
        changed = sorted(k for k in set(stamps) | set(now.get(what, {}))
                         if stamps.get(k) != now.get(what, {}).get(k))
        if changed:
            raise InputChangedError(
                f"{what} {paths[what]} changed while the job ran ({len(changed)} file(s) written or "
                f"replaced, e.g. {changed[0] or paths[what]}); nothing was published: rerun once it no "
                "longer changes")


def data_digest(*arrays) -> str | None:
    """sha256 over the token arrays a job uses (shape, dtype and values); None without data."""
    arrays = [a for a in arrays if a is not None]
    if not arrays:
        return None
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def fingerprint(job: str, settings: dict, source: Path | None, data=None) -> dict:
    """The record a resume is checked against; `data`: the token array(s) the job uses."""
    data = data if isinstance(data, (list, tuple)) else [data]
    return {"job": job, "settings": settings,
            "source": source_files(source) if source is not None else {},
            "data": data_digest(*data)}


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_same(saved: dict, now: dict, where: Path) -> None:
    """Raise a one-line ResumeMismatchError naming what differs between two fingerprints."""
    if saved.get("job") != now["job"]:
        raise ResumeMismatchError(f"--resume: {where} was staged by another job ({saved.get('job')!r}, "
                                  f"this is {now['job']!r}); rerun without --resume to start over")
    old, new = saved.get("settings", {}), now["settings"]
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if diff:
        detail = ", ".join(f"{k}: {_short(old.get(k))} there, {_short(new.get(k))} now" for k in diff[:4])
        raise ResumeMismatchError(f"--resume: {where} was started with different settings ({detail}); "
                                  "rerun with the same settings, or without --resume to start over")
    old, new = saved.get("source", {}), now["source"]
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
        raise ResumeMismatchError(
            f"--resume: the source model changed since {where} was started ({len(changed)} file(s) "
            f"differ in content, e.g. {changed[0]}); rerun without --resume to start over")
    if saved.get("data") != now.get("data"):
        raise ResumeMismatchError(
            f"--resume: the calibration or training text differs from the one {where} was started "
            "with (its tokens have another digest); restore that text, or rerun without --resume "
            "to start over")
