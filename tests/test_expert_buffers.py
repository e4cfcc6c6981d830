"""benchmarks/expert_buffers.py: its ways of running one token's routed experts give
the layer's gather path's result (independent of the clock)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import expert_buffers  # noqa: E402
from cmoe_jax.moe.dispatch import gathered_experts  # noqa: E402


def test_switched_experts_match_the_gather_path():
    rng = np.random.default_rng(1)
    E, d, m = 4, 16, 8
    w = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((E, d, m), (E, d, m), (E, m, d))]
    x = jnp.asarray(rng.standard_normal((3, d)), jnp.float32)
    ids = jnp.asarray([[0, 3], [2, 2], [1, 0]], jnp.int32)
    gates = jnp.asarray(rng.uniform(size=(3, 2)), jnp.float32)
    own = [tuple(a[e] for a in w) for e in range(E)]
    want = gathered_experts(x, ids, gates, *w, "silu")[0]
    got = expert_buffers.switched_experts(x, ids, gates, own)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_every_way_is_checked_before_timing():
    named = expert_buffers.sides(32, 128, 4, 2)  # asserts the ways agree
    assert set(named) == {"gather", "slabs", "switch", "contiguous", "dense FFN"}
    for run in named.values():
        run()
