"""Interleaved timing shared by the benchmarks: both sides alternate (A, B, A, B, ...) after a
warm-up, so load drift hits them alike; medians and minima per side, the ratio of medians,
and the load average at start and end. A ratio measured on an overloaded machine misleads,
so when the load at start (before the benchmark's own threads add to it) is above one
runnable process per core, the ratio is withheld and a warning printed instead. The end
figure includes the benchmark's own threads (about one per core while it runs).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # beside the checkout
WIKITEXT = DATA / "wikitext-2"


def cpu_model() -> str:
    """The CPU's model name, with its family and model numbers where the name alone does not
    tell kinds apart (a virtual machine's "AMD EPYC" may be any generation): figures differ
    between machine kinds, so every benchmark says which one made them."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "model name" in fields:
            numbers = [f"{k} {fields[k]}" for k in ("cpu family", "model") if k in fields]
            return fields["model name"] + (f" ({', '.join(numbers)})" if numbers else "")
    except (OSError, ValueError):
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """`CPU: <model>, <n> cores; jax <version> on <device kind> x<count>` (imports jax)."""
    import jax

    return (f"CPU: {cpu_model()}, {os.cpu_count()} cores; jax {jax.__version__} on "
            f"{jax.devices()[0].device_kind} x{len(jax.devices())}")


# how the C allocator runs: glibc's malloc moves its mmap threshold with the sizes freed, and
# with `MALLOC_MMAP_THRESHOLD_` alone trims the heap top at every large free, so a call's
# buffers may page-fault afresh; a figure is only comparable under the same settings
ALLOCATOR_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "LD_PRELOAD")


def allocator_env() -> dict[str, str]:
    """The allocator settings of this process's environment (`ALLOCATOR_VARS` that are set)."""
    return {k: os.environ[k] for k in ALLOCATOR_VARS if k in os.environ}


def load_average() -> float:
    return os.getloadavg()[0]


def machine_busy(load_at_start: float) -> bool:
    """More runnable processes than cores before the benchmark started."""
    return load_at_start > (os.cpu_count() or 1)


def settled_load(max_wait: float = 90.0, poll: float = 5.0) -> float:
    """The load average once it is at most the core count, waiting up to `max_wait` seconds.

    A measurement that starts as the one before it (in the same process) ends reads that
    one's threads in the one-minute average, which falls within a minute once they stop; waiting
    for it keeps such a start from being marked busy, and a machine that stays busy still is.
    """
    deadline = time.monotonic() + max_wait
    load = load_average()
    while machine_busy(load) and time.monotonic() < deadline:
        time.sleep(poll)
        load = load_average()
    return load


def module_call(module, method: Callable = lambda m, x: m(x)):
    """`(f, leaves)`: `method(module, x)` jitted as `f(leaves, x)` over the module's arrays,
    split and flattened once. A module's nnx `State` passed to every call is flattened again
    each time (about 25 us a call on XLA:CPU, up to a twentieth of a one-token MoE cell), a
    cost the dense baseline's plain arrays do not pay and no model pays per layer."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    return jax.jit(lambda ls, x: method(nnx.merge(graphdef, jax.tree.unflatten(treedef, ls)), x)), leaves


def interleaved_times(sides: Sequence[Callable[[], object]], repeats: int, warmup: int = 1,
                      before: Callable[[Callable[[], object]], object] | None = None
                      ) -> list[list[float]]:
    """Wall times of each zero-argument `side` (which must block until its result is ready);
    `before(side)`, untimed, runs ahead of each timed call (`cache_state`)."""
    for _ in range(warmup):
        for side in sides:
            side()
    times: list[list[float]] = [[] for _ in sides]
    for _ in range(repeats):
        for side, ts in zip(sides, times):
            if before is not None:
                before(side)
            t0 = time.perf_counter()
            side()
            ts.append(time.perf_counter() - t0)
    return times


CACHE_STATES = ("mixed", "warm", "cold")


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache's size (Linux sysfs), or `default` where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=default)


def cache_state(state: str) -> Callable[[Callable[[], object]], object] | None:
    """What runs, untimed, before each timed call so that every call starts from the same
    cache state, whatever the other sides read: "warm" calls the side once more (its weights
    in cache, as a layer called again and again), "cold" streams through four times the
    last-level cache (its weights come from memory, as each layer of a model's step does),
    "mixed" nothing (each call finds what the side before it left: at small shapes a side's
    time then depends on how many other sides a cell times)."""
    if state not in CACHE_STATES:
        raise ValueError(f"cache state must be one of {CACHE_STATES}, got {state!r}")
    if state == "warm":
        return lambda side: side()
    if state == "cold":
        import numpy as np

        buffer = np.zeros(4 * last_level_cache_bytes() // 8)
        return lambda side: np.add(buffer, 1.0, out=buffer)
    return None


def print_load(load_start: float, repeats: int, ratio: bool = True) -> bool:
    """Print the load average at start and end; True (with a warning) when the machine was
    busy. `ratio`: whether the caller would print a ratio (the warning says it does not)."""
    load_end, cores = load_average(), os.cpu_count() or 1
    print(f"load average {load_start:.2f} at start, {load_end:.2f} at end ({cores} cores), "
          f"{repeats} repeats")
    if not machine_busy(load_start):
        return False
    what = "no ratio printed" if ratio else "these times are inflated"
    print(f"warning: load average {load_start:.2f} at start is above {cores} cores: the machine "
          f"is busy, {what}; re-run on a quiet machine")
    return True


def report(names: Sequence[str], times: Sequence[Sequence[float]], load_start: float,
           work: float | None = None, unit: str = "tokens/s") -> float | None:
    """Print median/min per side and `ratio: first/second` of medians (None when overloaded).

    With a single side (nothing to compare against) only its median/min and the load
    averages are printed, and None is returned."""
    for name, ts in zip(names, times):
        rate = f"  {work / statistics.median(ts):10.1f} {unit}" if work else ""
        print(f"{name:28s} median {statistics.median(ts):8.4f} s  min {min(ts):8.4f} s{rate}")
    if print_load(load_start, len(times[0]), ratio=len(times) > 1) or len(times) < 2:
        return None
    ratio = statistics.median(times[0]) / statistics.median(times[1])
    print(f"ratio ({names[0]} time / {names[1]} time, medians): {ratio:.2f}x")
    return ratio
