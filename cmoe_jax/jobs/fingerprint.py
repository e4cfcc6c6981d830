"""What a resumable job started from: its settings and its source files (size, mtime), so
a resume only keeps staged work that the same inputs would produce again."""
from __future__ import annotations

import os
from pathlib import Path

from cmoe_jax.errors import CmoeError


class ResumeMismatchError(CmoeError):
    """`--resume` found staged work from other settings or another source."""


def source_files(path: Path) -> dict[str, list[int]]:
    """{relative name: [size, mtime_ns]} of a checkpoint file or of every file under a
    checkpoint directory (hidden files and the tokenizer's cache skipped)."""
    path = Path(path)
    if path.is_file():
        st = path.stat()
        return {path.name: [st.st_size, st.st_mtime_ns]}
    files = {}
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue
            p = Path(root) / name
            st = p.stat()
            files[str(p.relative_to(path))] = [st.st_size, st.st_mtime_ns]
    return files


def fingerprint(job: str, settings: dict, source: Path | None) -> dict:
    return {"job": job, "settings": settings,
            "source": source_files(source) if source is not None else {}}


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
            f"differ in size or time, e.g. {changed[0]}); rerun without --resume to start over")
