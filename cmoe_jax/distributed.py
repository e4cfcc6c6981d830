"""Multi-process (multi-host) runs: start-up from the environment and host-side exchanges.

Conversion and evaluation: each process works on its own devices (their meshes are
process-local) and on its contiguous share of the windows or items; processes meet only to
exchange host numpy results. Training instead runs one jitted step on a mesh over all
processes' devices (`cmoe_jax.train.api`); `to_host` brings its results back. Gathers keep
process order, which is the global window order, and every reduction is done after the
gather, in float64 and in that order, so each process ends up with the same bits the
single-process run computes from the same per-window values.

Start-up reads JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and
JAX_PROCESS_ID; `CMOE_DISTRIBUTED=auto` lets JAX detect them itself (TPU pods, SLURM). With
none of them set the run is a single process and nothing here does any work.
"""
from __future__ import annotations

import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cmoe_jax.errors import CmoeError

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_HOW = ("set all three of JAX_COORDINATOR_ADDRESS=host:port (process 0's address), "
        "JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=0..N-1 on every process, or none of them "
        "for a single process (CMOE_DISTRIBUTED=auto: let JAX detect them on a TPU pod)")


class DistributedError(CmoeError):
    """The multi-process environment is incomplete or inconsistent."""


def _env_settings(environ) -> tuple[str, int, int] | None:
    """(address, processes, id) from the environment, None for a single process."""
    given = {k: environ[k] for k in ENV if environ.get(k, "").strip()}
    if not given:
        return None
    missing = [k for k in ENV if k not in given]
    if missing:
        raise DistributedError(f"multi-process environment incomplete: {', '.join(missing)} "
                               f"not set; {_HOW}")
    address = given["JAX_COORDINATOR_ADDRESS"].strip()
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"JAX_COORDINATOR_ADDRESS={address!r} is not host:port; {_HOW}")
    values = {}
    for k in ENV[1:]:
        try:
            values[k] = int(given[k])
        except ValueError:
            raise DistributedError(f"{k}={given[k]!r} is not an integer; {_HOW}") from None
    n, i = values["JAX_NUM_PROCESSES"], values["JAX_PROCESS_ID"]
    if n < 1:
        raise DistributedError(f"JAX_NUM_PROCESSES={n} must be at least 1; {_HOW}")
    if not 0 <= i < n:
        raise DistributedError(f"JAX_PROCESS_ID={i} must lie in 0..{n - 1} "
                               f"(JAX_NUM_PROCESSES={n}); {_HOW}")
    return address, n, i


def check_environment(environ=None) -> None:
    """Raise DistributedError on a bad multi-process environment (before any work)."""
    environ = os.environ if environ is None else environ
    mode = environ.get("CMOE_DISTRIBUTED", "").strip()
    if mode not in ("", "auto"):
        raise DistributedError(f"CMOE_DISTRIBUTED={mode!r}: the only value is 'auto'; {_HOW}")
    if mode != "auto":
        _env_settings(environ)


def initialize() -> None:
    """Join the multi-process job the environment describes (no-op for a single process or
    when already joined). Must run before anything touches a JAX device."""

    check_environment()
    auto = os.environ.get("CMOE_DISTRIBUTED", "").strip() == "auto"
    settings = None if auto else _env_settings(os.environ)
    if not auto and (settings is None or settings[1] == 1):
        return

    if jax.distributed.is_initialized():
        return
    # CPU processes exchange data with gloo (the CPU client's default has no collectives)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if auto:
        jax.distributed.initialize()
    else:
        address, n, i = settings
        jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=i)


def process_count() -> int:
    return jax.process_count()


def process_index() -> int:
    return jax.process_index()


def is_main() -> bool:
    """Process 0: the one that writes manifests, reports and JSON results."""
    return process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (no-op for one process)."""
    if process_count() > 1:
        multihost_utils.sync_global_devices(name)


def split_for_process(items, index: int | None = None, count: int | None = None):
    """This process's contiguous share of `items` (sizes differ by at most one, earlier
    processes take the larger shares), so concatenating the shares in process order gives
    `items` back. Fails when some process would get nothing."""
    index = process_index() if index is None else index
    count = process_count() if count is None else count
    n = len(items)
    if n < count:
        raise DistributedError(f"{n} windows/items cannot be split over {count} processes: "
                               "give at least one per process")
    base, extra = divmod(n, count)
    start = index * base + min(index, extra)
    return items[start:start + base + (index < extra)]


def _gather_stacked(x: np.ndarray) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def _as_bytes(x: np.ndarray) -> np.ndarray:
    return np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8)


def gather_rows(x) -> np.ndarray:
    """Every process's array concatenated along axis 0 in process order (shares may differ
    in length); the bits are kept whatever the dtype (sent as bytes)."""
    x = np.asarray(x)
    if process_count() == 1:
        return x
    lengths = _gather_stacked(np.asarray(x.shape[0], np.int32))
    raw = _as_bytes(x)
    row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.itemsize
    padded = np.zeros(int(lengths.max()) * row_bytes, np.uint8)
    padded[:raw.size] = raw
    stacked = _gather_stacked(padded)
    parts = [np.frombuffer(stacked[p, :n * row_bytes].tobytes(), x.dtype).reshape(n, *x.shape[1:])
             for p, n in enumerate(lengths)]
    return np.concatenate(parts, axis=0)


def gather_objects(obj) -> list:
    """Every process's picklable `obj`, in process order ([obj] for one process)."""
    if process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = _gather_stacked(np.asarray(data.size, np.int32))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:data.size] = data
    stacked = _gather_stacked(padded)
    return [pickle.loads(stacked[p, :n].tobytes()) for p, n in enumerate(lengths)]


def sum_across_processes(tree):
    """Leaf-wise sums over processes of equally shaped host arrays (float64 for floats,
    int64 for integers), summed in process order so every process gets the same bits."""

    def total(x):
        x = np.asarray(x)
        acc = np.float64 if np.issubdtype(x.dtype, np.floating) else np.int64
        return np.stack([np.asarray(p, acc) for p in gather_objects(x)]).sum(axis=0)

    return jax.tree.map(total, tree)


def broadcast_from_main(obj):
    """Process 0's picklable `obj` on every process (the others' argument is ignored), sent
    with `multihost_utils.broadcast_one_to_all` as bytes so every dtype keeps its bits."""
    if process_count() == 1:
        return obj

    data = np.frombuffer(pickle.dumps(obj), np.uint8) if is_main() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.asarray(data.size, np.int32)))
    padded = np.zeros(size, np.uint8)
    padded[:min(size, data.size)] = data[:size]
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(padded)).tobytes())


def all_ok(error: BaseException | None) -> None:
    """Re-raise on every process an error that any process hit (so none waits forever at
    the next exchange for one that has stopped); the lowest process's error wins."""
    errors = gather_objects(None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    for e in errors:
        if e is not None:
            raise DistributedError(f"another process failed: {e[0]}: {e[1]}")


def on_main(fn):
    """`fn()` run by process 0 alone, for file checks and writes that would race if every
    process made them (two trial-creates of one new file: one fails); its result is shared
    with every process and its CmoeError raised on all."""
    if process_count() == 1:
        return fn()
    error, result = None, None
    if is_main():
        try:
            result = fn()
        except CmoeError as e:
            error = e
    all_ok(error)
    return broadcast_from_main(result)


def refuse(**flags) -> None:
    """Fail before any work when a multi-process run asks for something that is not split
    across processes (flag name -> whether it was given)."""
    given = [name for name, on in flags.items() if on]
    if given and process_count() > 1:
        raise DistributedError(f"{', '.join(given)} not supported in a multi-process run "
                               f"({process_count()} processes): run it as a single process")


def replicated_global(tree):
    """Process-local arrays (equal on every process) as global arrays replicated over all
    processes' devices, the form Orbax saves from every process at once (each piece written
    once); unchanged for a single process."""
    if process_count() == 1:
        return tree

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("processes",)), P())

    def place(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x  # already global (a multi-process training run): Orbax saves it as it is
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(place, tree)


def to_host(tree):
    """Every leaf as a whole host numpy array on every process; the pieces of a global array
    sharded over other processes' devices are gathered (all processes must call this)."""

    def fetch(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(fetch, tree)


def require_single_process(job: str) -> None:
    """For the jobs that do not split their work: fail before any work when the environment
    describes a multi-process run (rather than run the whole job once per process)."""
    check_environment()
    auto = os.environ.get("CMOE_DISTRIBUTED", "").strip() == "auto"
    settings = _env_settings(os.environ)
    if auto or (settings is not None and settings[1] > 1):
        raise DistributedError(f"{job} does not run over several processes yet: start it as one "
                               "process (unset JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                               "JAX_PROCESS_ID and CMOE_DISTRIBUTED)")
