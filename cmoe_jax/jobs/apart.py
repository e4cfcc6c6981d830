"""A job never writes inside, over, or in the place of what it reads.

Every path a job writes (`--out` with its `OUT.partial` and `OUT.lock`, a `--json` file) is
compared, before any work, with every path it reads (the source model, the data, the
teacher, an ARC file): equal, inside or containing is refused with one line. A written path
is taken as written (its last component not followed: a job replaces a link, never its
target); a read path with its links resolved (what is read is the target).
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


def check_apart(written: dict[str, object], read: dict[str, object]) -> None:
    """One line when a written path equals, lies inside or contains a read one (local read
    paths only: a Hub id or a dataset name is not a path here)."""
    for flag, w in written.items():
        if not w:
            continue
        target = _as_written(w)
        for what, r in read.items():
            if not r or not Path(r).expanduser().exists():
                continue
            source = Path(r).expanduser().resolve()
            relation = ("is" if target == source else "lies inside" if target.is_relative_to(source)
                        else "contains" if source.is_relative_to(target) else None)
            if relation:
                raise InputError(f"{flag} {w} {relation} {what} {r}: a job never writes over, inside "
                                 f"or around what it reads; choose a {flag} outside it")


def output_paths(out, flag: str = "--out") -> dict[str, Path]:
    """What a directory job writes: `OUT`, `OUT.partial` and `OUT.lock`."""
    out = Path(out)
    return {flag: out, f"{flag} (staging)": out.with_name(out.name + ".partial"),
            f"{flag} (lock)": out.with_name(out.name + ".lock")}
