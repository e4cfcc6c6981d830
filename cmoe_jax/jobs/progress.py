"""Resume bookkeeping: the per-layer results a job saves in its staging directory as it
goes, and reads back on `--resume` (each file written whole, so a kill never leaves half)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from cmoe_jax.atomic_files import write_bytes_atomic, write_json_atomic
from cmoe_jax.faults import fault_point


class LayerLog:
    """`directory/NNNN.json` (or `.npz`): one saved result per finished layer."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def _file(self, i: int, ext: str) -> Path:
        return self.directory / f"{i:04d}.{ext}"

    def save_json(self, i: int, record) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self._file(i, "json"), record)
        fault_point("layer")

    def records(self, parse=dict) -> list:
        """The records of layers 0, 1, ... up to the first missing one, each read by `parse`."""
        done = []
        while self._file(len(done), "json").exists():
            done.append(parse(json.loads(self._file(len(done), "json").read_text())))
        return done

    def save_arrays(self, i: int, arrays: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        write_bytes_atomic(self._file(i, "npz"), buffer.getvalue())
        fault_point("layer")

    def arrays(self, parse) -> dict:
        """{layer index: parse(npz)} of every saved `.npz`."""
        return {int(p.stem): parse(np.load(p)) for p in sorted(self.directory.glob("[0-9]*.npz"))}

    def count(self) -> int:
        return len(list(self.directory.glob("[0-9]*.*"))) if self.directory.exists() else 0

