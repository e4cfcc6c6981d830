"""MoEFFN under jax.jit on 8 simulated CPU devices: tokens over "data", experts over "model".

XLA's device count is fixed when jax is first imported, so the check runs in a fresh
interpreter with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import xla_flags

SCRIPT = textwrap.dedent('''
    import os, sys
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import numpy as np, jax, jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cmoe_jax.moe import MoEFFN

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    backend, router = sys.argv[1], sys.argv[2]
    top_k = 8 if router == "sum" else 2
    layer = MoEFFN(d_model=32, expert_width=16, num_experts=8, top_k=top_k, shared_width=16, router=router, backend=backend,
                   activation="silu", rngs=nnx.Rngs(0))
    if router == "cmoe":
        layer.u[...] = jnp.linspace(-1.0, 1.0, 8)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 32))
    graphdef, state = nnx.split(layer)

    def run(state, x):
        m = nnx.merge(graphdef, state)
        y, counts = m(x, return_load=True)
        params = nnx.state(m, nnx.Param)
        g = jax.grad(lambda p, x: jnp.sum(nnx.merge(graphdef, p, nnx.state(m, nnx.Not(nnx.Param)))(x) ** 2),
                     argnums=(0, 1))(params, x)
        return y, counts, g

    want = jax.jit(run)(state, x)

    def spec(path, v):
        name = path[0].key  # (DictKey(name), GetAttrKey("value"))
        return P("model", None, None) if name.startswith("expert_") else P()

    specs = jax.tree_util.tree_map_with_path(spec, state)
    sharded_state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    assert len(sharded_state["expert_gate"][...].sharding.device_set) == 8
    assert sharded_state["expert_gate"][...].addressable_shards[0].data.shape == (2, 32, 16)
    got = jax.jit(run)(sharded_state, xs)
    assert got[0].sharding.spec[0] == "data" or not got[0].sharding.is_fully_replicated
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    print("OK", int(got[1].sum()))
''')


@pytest.mark.parametrize("backend,router", [("cpu", "cmoe"), ("cpu", "linear"), ("cpu", "sum"),
                                            ("ragged_dot", "linear"), ("dense", "cmoe")])
def test_sharded_matches_unsharded(backend, router):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8),
               JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, backend, router], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    top_k = 8 if router == "sum" else 2
    assert proc.stdout.strip().endswith(f"OK {64 * top_k}")
