"""Files written whole: a reader sees the old content or the new, never half of it."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from cmoe_jax.faults import fault_point


def write_bytes_atomic(path: Path, data: bytes, fault: str | None = None) -> None:
    """Write `data` beside `path` (`.NAME.XXXX.tmp`), then rename it over `path`: readers never see
    half a file; `fault`: the fault point between the write and the rename (`cmoe_jax.faults`)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from other readers
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if fault:  # written, not yet in place: a kill here leaves only the temporary
            fault_point(fault)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a full disk at write() names no file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def write_json_atomic(path: Path, obj) -> None:  # `obj` as indented JSON, written whole
    write_bytes_atomic(path, (json.dumps(obj, indent=1) + "\n").encode(), fault="json:write")


def remove_write_leftovers(directory: Path) -> None:
    """Delete the `.NAME.XXXX.tmp` that killed `write_bytes_atomic` calls left under `directory`."""
    for tmp in Path(directory).rglob(".*.tmp"):
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink(missing_ok=True)
