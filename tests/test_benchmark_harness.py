"""The benchmarks' shared harness: interleaving order, and when a ratio may be printed.

The ratio logic is checked on given times (no clock involved); the load average is
replaced by a fixed value so the outcome does not depend on what else runs on the machine.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402


def test_sides_alternate_after_warmup():
    calls = []
    times = harness.interleaved_times([lambda: calls.append("A"), lambda: calls.append("B")],
                                      repeats=3, warmup=1)
    assert calls == ["A", "B"] * 4  # one warm-up round, then three timed rounds
    assert [len(ts) for ts in times] == [3, 3]
    assert all(t >= 0 for ts in times for t in ts)


def test_before_runs_untimed_ahead_of_every_timed_call():
    calls = []
    sides = [lambda: calls.append("A"), lambda: calls.append("B")]
    harness.interleaved_times(sides, repeats=2, warmup=0, before=lambda side: calls.append("-"))
    assert calls == ["-", "A", "-", "B"] * 2


def test_cache_states_warm_repeats_the_side_cold_touches_more_than_the_cache(monkeypatch):
    calls = []
    side = lambda: calls.append("A")  # noqa: E731
    harness.cache_state("warm")(side)
    assert calls == ["A"]  # a warm call follows one of its own
    assert harness.cache_state("mixed") is None
    monkeypatch.setattr(harness, "last_level_cache_bytes", lambda: 1 << 20)
    import numpy as np
    seen = []
    real_add = np.add
    monkeypatch.setattr(np, "add", lambda a, b, out: seen.append(out.nbytes) or real_add(a, b, out=out))
    harness.cache_state("cold")(side)
    assert calls == ["A"] and seen == [4 << 20]  # the side itself does not run; 4x the cache is
    with pytest.raises(ValueError, match="cache state"):
        harness.cache_state("hot")


def test_last_level_cache_is_the_largest_cache_level(tmp_path, monkeypatch):
    for index, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    real_path = harness.Path
    monkeypatch.setattr(harness, "Path", lambda p: tmp_path if "cpu0/cache" in str(p) else real_path(p))
    assert harness.last_level_cache_bytes() == 32 << 20


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(harness, "load_average", lambda: 1.0)


def test_ratio_of_medians_on_a_quiet_machine(two_cores, capsys):
    ratio = harness.report(["ref", "ours"], [[4.0, 9.0, 6.0], [2.0, 3.0, 1.0]], load_start=1.5)
    assert ratio == pytest.approx(6.0 / 2.0)  # medians, not means or minima
    out = capsys.readouterr().out
    assert "min   4.0000 s" in out and "min   1.0000 s" in out
    assert "ratio (ref time / ours time, medians): 3.00x" in out


def test_no_ratio_when_the_load_exceeds_the_cores(two_cores, capsys):
    assert harness.report(["ref", "ours"], [[4.0, 9.0, 6.0], [2.0, 3.0, 1.0]], load_start=2.5) is None
    out = capsys.readouterr().out
    assert "warning: load average 2.50" in out and "ratio" not in out.replace("no ratio printed", "")


def test_single_side_prints_no_ratio(two_cores, capsys):
    assert harness.report(["convert"], [[3.0, 1.0, 2.0]], load_start=0.5, work=4.0) is None
    out = capsys.readouterr().out
    assert "median   2.0000 s" in out and "2.0 tokens/s" in out and "ratio" not in out


def _fake_clock(monkeypatch, loads):
    """A load average that reads `loads` in turn, and a clock that moves only when slept."""
    now, seen = [0.0], iter(loads)
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(harness, "load_average", lambda: next(seen))
    monkeypatch.setattr(harness.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(harness.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    return now


def test_settled_load_waits_for_the_last_cells_threads_to_leave(monkeypatch):
    now = _fake_clock(monkeypatch, [2.6, 2.3, 1.9, 0.5])
    assert harness.settled_load(max_wait=90, poll=5) == 1.9  # the first reading at most 2 cores
    assert now[0] == 10


def test_settled_load_gives_up_on_a_busy_machine(monkeypatch):
    now = _fake_clock(monkeypatch, [3.0] * 100)
    load = harness.settled_load(max_wait=20, poll=5)
    assert load == 3.0 and harness.machine_busy(load) and now[0] == 20


def test_allocator_env_names_the_malloc_settings_a_run_was_made_under(monkeypatch):
    for var in harness.ALLOCATOR_VARS:
        monkeypatch.delenv(var, raising=False)
    assert harness.allocator_env() == {}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4294967296")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4294967296")
    monkeypatch.setenv("HOME", "/root")  # not an allocator setting
    assert harness.allocator_env() == {"MALLOC_MMAP_THRESHOLD_": "4294967296",
                                       "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def test_module_call_takes_plain_arrays_and_computes_what_the_module_does():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cmoe_jax.moe import MoEFFN

    layer = MoEFFN(d_model=16, expert_width=8, num_experts=4, top_k=2, shared_width=8, router="cmoe",
                   activation="silu", expert_axis=None, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (5, 16))
    f, leaves = harness.module_call(layer, lambda m, x: m(x, return_load=True))
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)  # no State to flatten per call
    y, load = f(leaves, x)
    y_ref, load_ref = layer(x, return_load=True)
    assert jnp.array_equal(load, load_ref)
    assert jnp.allclose(y, y_ref, atol=1e-6)
    route, _ = harness.module_call(layer, lambda m, x: m.route(x))
    assert jnp.array_equal(route(leaves, x)[0], layer.route(x)[0])
