"""What checking the saved checksums costs a load: `restore_model` of a converted directory
with its `state_digests` against the same state without them (the form older directories
have, which loads without a check), interleaved, after a warm-up (files in the page cache).

The unchecked side is a copy of the directory made of hard links (no bytes copied, the same
files read) whose manifest lacks `state_digests`. Target: ratio (checked / unchecked) <= 1.05.
A third side times the check alone (hashing a restored model's arrays), a figure a busy
machine blurs less than the difference of two loads.

    python -m cmoe_jax.convert --model smollm2 --config S1A1E8 --calib-samples 2 --seqlen 256 \\
        --data-path /work/shared/data/wikitext-2/valid.txt --out /tmp/smol
    python benchmarks/load_checksum.py --model /tmp/smol [--repeats 7]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, machine_line, report  # noqa: E402


def unchecked_copy(directory: Path, where: Path) -> Path:
    """`directory` as hard links under `where`, its manifest without the checksums."""
    from cmoe_jax.atomic_files import write_json_atomic
    from cmoe_jax.checkpoint import MANIFEST, read_manifest
    from cmoe_jax.state_digests import DIGESTS

    manifest = read_manifest(directory)
    if DIGESTS not in manifest:
        sys.exit(f"error: {directory} records no checksums ({DIGESTS}): convert it again")
    copy = where / "unchecked"
    shutil.copytree(directory, copy, copy_function=os.link)
    del manifest[DIGESTS]
    write_json_atomic(copy / MANIFEST, manifest)  # a new file: the original's link is untouched
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a converted model directory")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    load_start = load_average()
    import jax
    from flax import nnx

    from cmoe_jax.checkpoint import restore_model
    from cmoe_jax.state_digests import array_digests

    def load(directory: Path):
        return lambda: jax.block_until_ready(nnx.state(restore_model(directory)))

    print(machine_line())
    state = nnx.state(restore_model(args.model))
    with tempfile.TemporaryDirectory(dir=args.model.parent) as tmp:
        plain = unchecked_copy(args.model, Path(tmp))
        times = interleaved_times([load(args.model), load(plain), lambda: array_digests(state)],
                                  args.repeats)
    report(["load, checksums checked", "load, no checksums"], times[:2], load_start)
    print(f"the check alone (hashing every array): median {statistics.median(times[2]):.4f} s, "
          f"{statistics.median(times[2]) / statistics.median(times[1]):.3f} of the unchecked load's median")


if __name__ == "__main__":
    main()
