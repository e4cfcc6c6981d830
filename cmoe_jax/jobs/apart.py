"""A job never writes inside, over, or in the place of what it reads.

Every path a job writes (`--out` with its `OUT.partial` and `OUT.lock`, a `--json` file) is
compared, before any work, with every path it reads (the source model, the data, the
teacher, an ARC file): equal, inside or containing is refused with one line. Every spelling
of one place is the same place: a written path is compared as written (a job replaces a
link at `--out`, never its target) and with its links and `..` resolved (a link, or a path
through a linked parent, that leads to an input is refused), and by (device, inode) of the
path and its parents (a bind mount of a directory is the directory). The check comes before
any lock is taken, so a job never waits on the readers' lock of its own input.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from cmoe_jax.errors import InputError

READ_NAMES = ("teacher",)  # settings fields that name a read path besides `*_path`


def declared_inputs(settings) -> dict[str, str]:
    """{field: path} of a job's settings that name files it reads: every `*_path` field and
    the teacher, in nested dataclasses, dicts or argparse namespaces."""
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        items = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    elif isinstance(settings, argparse.Namespace):
        items = vars(settings)
    elif isinstance(settings, dict):
        items = settings
    else:
        return {}
    found = {}
    for name, value in items.items():
        if isinstance(value, (str, Path)) and value and (name.endswith("_path") or name in READ_NAMES):
            found[f"--{name.replace('_', '-')}"] = str(value)
        elif not isinstance(value, (str, bytes, Path)):
            found.update(declared_inputs(value))
    return found


def _as_written(path) -> Path:
    path = Path(path).expanduser()
    return path.parent.resolve() / path.name


def _identity(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what `path` leads to, None when nothing is there."""
    try:
        info = path.stat()
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def _chain(path: Path) -> list[tuple[int, int]]:
    """The identities of `path` (links resolved) and of every existing directory above it."""
    path = path.resolve()
    return [i for i in map(_identity, [path, *path.parents]) if i is not None]


def _relation(written: Path, source: Path) -> str | None:
    """How `written` stands to `source` by any spelling: "is", "lies inside", "contains" or None."""
    as_written, resolved = _as_written(written), written.expanduser().resolve()
    for target in (as_written, resolved):
        if target == source:
            return "is"
        if target.is_relative_to(source):
            return "lies inside"
        if source.is_relative_to(target):
            return "contains"
    here, there = _identity(resolved), _identity(source)
    if here is not None and here == there:
        return "is"
    if there is not None and there in _chain(resolved.parent):
        return "lies inside"
    if here is not None and here in _chain(source.parent):
        return "contains"
    return None


def check_apart(written: dict[str, object], read: dict[str, object]) -> None:
    """One line when a written path equals, lies inside or contains a read one (local read
    paths only: a Hub id or a dataset name is not a path here)."""
    for flag, w in written.items():
        if not w:
            continue
        for what, r in read.items():
            if not r or not Path(r).expanduser().exists():
                continue
            relation = _relation(Path(w), Path(r).expanduser().resolve())
            if relation:
                raise InputError(f"{flag} {w} {relation} {what} {r}: a job never writes over, inside "
                                 f"or around what it reads; choose a {flag} outside it")


def output_paths(out, flag: str = "--out") -> dict[str, Path]:
    """What a directory job writes: `OUT`, `OUT.partial` and `OUT.lock`."""
    out = Path(out)
    return {flag: out, f"{flag} (staging)": out.with_name(out.name + ".partial"),
            f"{flag} (lock)": out.with_name(out.name + ".lock")}
