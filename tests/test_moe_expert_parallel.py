"""Expert parallelism on 8 simulated CPU devices, mesh ("data", "expert") = (2, 4).

`MoEFFN` under `jax.set_mesh` with an "expert" axis runs `routed_experts_sharded`
(shard_map + all-to-all); it must equal the same layer on one device (outputs, load
counts, bias update, gradients of parameters and input), and its compiled HLO must
exchange tokens with all-to-all and never all-gather the token activations. Runs in a
fresh interpreter: XLA's device count is fixed when jax is first imported.
"""
import os
import subprocess
import sys
import textwrap

from conftest import xla_flags

SCRIPT = textwrap.dedent('''
    import re
    import numpy as np, jax, jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cmoe_jax.moe import MoEFFN

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))
    tokens, d = 8 * 16, 32

    def check(router, backend, balance=False):
        top_k = 8 if router == "sum" else 2
        layer = MoEFFN(d_model=d, expert_width=16, num_experts=8, top_k=top_k, shared_width=16, router=router, backend=backend,
                       router_balance=balance, activation="silu", rngs=nnx.Rngs(0),
                       **(dict(router_scoring="sigmoid", routed_scaling=2.0) if balance else {}))
        if router == "cmoe":
            layer.u[...] = jnp.linspace(-1.0, 1.0, 8)
        if balance:  # a bias that moves the choice, with sigmoid scores and a gate scale
            layer.router_bias[...] = jnp.linspace(-0.2, 0.2, 8)
        x = jax.random.normal(jax.random.PRNGKey(1), (8, 16, d))
        graphdef, state = nnx.split(layer)

        def run(state, x):
            m = nnx.merge(graphdef, state)
            y, counts = m(x, return_load=True)
            rest = nnx.state(m, nnx.Not(nnx.Param))
            loss = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p, rest)(x)))
            return y, counts, jax.grad(loss, argnums=(0, 1))(nnx.state(m, nnx.Param), x)

        want = jax.jit(run)(state, x)  # no mesh set: the one-device dispatch
        experts = lambda path, v: P("expert") if path[0].key.startswith("expert_") else P()
        specs = jax.tree_util.tree_map_with_path(experts, state)
        sharded = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
        with jax.set_mesh(mesh):
            got = jax.jit(run)(sharded, xs)
            hlo = jax.jit(run).lower(sharded, xs).compile().as_text()
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        assert int(got[1].sum()) == tokens * top_k
        # equal global counts (asserted above) give the same balancing bias update
        assert "all-to-all" in hlo, "tokens must be exchanged with all-to-all"
        # no all-gather of anything per token (activations, router scores): dims of the
        # global token count never appear in a gathered array (each device holds 16 tokens)
        for shape in re.findall(r"= \\w+\\[([\\d,]*)\\]\\S* all-gather", hlo):
            dims = {int(s) for s in shape.split(",") if s}
            assert not dims & {tokens, tokens * top_k}, f"all-gather of {shape}"
        print("OK", router + ("-balance" if balance else ""), backend)

    def check_lora_adapters():
        """Per-expert adapters (the LoRA training path) are split and applied like the weights."""
        from cmoe_jax.moe.dispatch import GLUExperts
        from cmoe_jax.moe.expert_parallel import routed_swiglu_experts
        from cmoe_jax.moe.gmm import get_gmm
        keys = iter(jax.random.split(jax.random.PRNGKey(2), 12))
        rnd = lambda *shape: jax.random.normal(next(keys), shape) * 0.3
        e, m, r = 8, 16, 4
        ids = jax.random.randint(next(keys), (tokens, 2), 0, e)
        gates, x = jax.nn.softmax(rnd(tokens, 2)), rnd(tokens, d)
        weights = (rnd(e, d, m), rnd(e, d, m), rnd(e, m, d))
        adapters = {"expert_gate": {"a": rnd(e, d, r), "b": rnd(e, r, m)},
                    "expert_down": {"a": rnd(e, m, r), "b": rnd(e, r, d)}}
        gmm = get_gmm("cpu")

        def make_lora(ad):
            def lora(name, rows, sizes):
                a = ad.get("expert_" + name)
                return None if a is None else gmm(gmm(rows, a["a"], sizes), a["b"], sizes)
            return lora

        def loss(weights, adapters, x):
            out, counts = routed_swiglu_experts(x, ids, gates, GLUExperts(*weights, gmm, "silu"),
                                                adapters=adapters, make_lora=make_lora)
            return jnp.sum(jnp.sin(out)), counts

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        want = fn(weights, adapters, x)
        put = lambda t, spec: jax.device_put(t, NamedSharding(mesh, spec))
        with jax.set_mesh(mesh):
            got = fn(put(weights, P("expert")), put(adapters, P("expert")),
                     put(x, P(("data", "expert"))))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        print("OK", "lora", "adapters")

    check("cmoe", "cpu")
    check("linear", "ragged_dot")
    check("linear", "cpu", balance=True)
    check("sum", "dense")
    check_lora_adapters()
''')


def on_8_devices(script: str) -> str:
    """`script`'s standard output, run in a fresh interpreter with 8 CPU devices."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(8),
               JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def test_expert_parallel_matches_one_device_and_uses_all_to_all():
    assert on_8_devices(SCRIPT).split() == ["OK", "cmoe", "cpu", "OK", "linear", "ragged_dot", "OK", "linear-balance",
                                   "cpu", "OK", "sum", "dense", "OK", "lora", "adapters"]


def test_uneven_splits_fail_with_a_clear_message():
    import jax
    import jax.numpy as jnp
    import pytest

    from cmoe_jax.moe.expert_parallel import routed_experts_sharded
    from cmoe_jax.moe.mesh_axes import expert_axis_size

    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "expert"))
    assert expert_axis_size("expert", mesh) == 4 and expert_axis_size("model", mesh) == 1
    weights = (jnp.zeros((8, 4, 2)),)
    ids, gates = jnp.zeros((12, 1), jnp.int32), jnp.ones((12, 1))
    with pytest.raises(ValueError, match="12 tokens do not split over 8 devices"):
        routed_experts_sharded(jnp.zeros((12, 4)), ids, gates, weights, None, mesh=mesh)
    with pytest.raises(ValueError, match="6 experts do not split over 4 devices"):
        routed_experts_sharded(jnp.zeros((16, 4)), ids[:1].repeat(16, 0), gates[:1].repeat(16, 0),
                               (jnp.zeros((6, 4, 2)),), None, mesh=mesh)


PADDED_SCRIPT = textwrap.dedent('''
    import numpy as np, jax, jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cmoe_jax.moe import MoEFFN

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))
    d = 32

    def make(factor):
        layer = MoEFFN(d_model=d, expert_width=16, num_experts=8, top_k=2, shared_width=16,
                       router_balance=True, capacity_factor=factor, backend="ragged_dot",
                       activation="silu", rngs=nnx.Rngs(0))
        layer.router_bias[...] = jnp.linspace(-0.2, 0.2, 8)
        return nnx.split(layer)

    def run(graphdef, state, x, mask):
        y, load, r = nnx.merge(graphdef, state)(x, mask=mask, return_load=True, return_router=True)
        return y, load, r.aux_loss, r.z_loss, r.dropped

    def sharded(state):
        spec = lambda path, v: P("expert") if path[0].key.startswith("expert_") else P()
        specs = jax.tree_util.tree_map_with_path(spec, state)
        return jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def close(got, want):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    graphdef, state = make(0.0)
    fn = jax.jit(lambda s, x, m: run(graphdef, s, x, m))
    for tokens, masked in [(62, False), (2, False), (64, True), (13, True)]:
        x = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, d))
        mask = (jnp.arange(tokens) % 5 != 2) if masked else None
        want = fn(state, x, mask)
        with jax.set_mesh(mesh):
            got = fn(sharded(state), x, mask)
        close(got, want)
        print("OK", tokens, "masked" if masked else "all")

    # a hierarchical layer pads the same way
    from cmoe_jax.moe import HierMoEFFN
    hier = HierMoEFFN(d_model=d, expert_width=8, num_experts=4, top_k=2, sub_experts=4, sub_shared=1,
                      sub_top_k=2, shared_width=16, router="cmoe", activation="silu", rngs=nnx.Rngs(0))
    hg, hs = nnx.split(hier)
    hfn = jax.jit(lambda s, x, m: nnx.merge(hg, s)(x, mask=m, return_load=True))
    x, mask = jax.random.normal(jax.random.PRNGKey(9), (30, d)), jnp.arange(30) % 4 != 1
    want = hfn(hs, x, mask)
    with jax.set_mesh(mesh):
        close(hfn(sharded(hs), x, mask), want)
    print("OK hierarchical")

    # capacity: each device limits its own 8 tokens, as one device does on each block of 8
    graphdef, state = make(0.75)
    fn = jax.jit(lambda s, x, m: run(graphdef, s, x, m))
    x = jax.random.normal(jax.random.PRNGKey(5), (64, d))
    mask = jnp.arange(64) % 7 != 3
    blocks = [fn(state, x[i:i + 8], mask[i:i + 8]) for i in range(0, 64, 8)]
    with jax.set_mesh(mesh):
        y, load, _, _, dropped = fn(sharded(state), x, mask)
    close((y, load), (jnp.concatenate([b[0] for b in blocks]), sum(b[1] for b in blocks)))
    live = [int(mask[i:i + 8].sum()) for i in range(0, 64, 8)]
    np.testing.assert_allclose(float(dropped), sum(float(b[4]) * n for b, n in zip(blocks, live)) / sum(live), rtol=1e-6)
    assert float(dropped) > 0
    print("OK capacity", round(float(dropped), 3))

    # the exchange: ragged_all_to_all where the platform has one, the padded all-to-all on CPU
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
    with jax.set_mesh(mesh):
        args = (jax.tree.map(spec, sharded(state)),
                jax.ShapeDtypeStruct((64, d), jnp.float32, sharding=NamedSharding(mesh, P(("data", "expert")))),
                jax.ShapeDtypeStruct((64,), jnp.bool_, sharding=NamedSharding(mesh, P(("data", "expert")))))
        checks = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
        for platform in ("cuda", "tpu"):
            text = jax.export.export(fn, platforms=[platform], disabled_checks=checks)(*args).mlir_module()
            print(platform, "ragged" if "ragged_all_to_all" in text else "padded")
        hlo = fn.lower(*args).compile().as_text()  # what runs here
        print("cpu", "ragged" if "ragged-all-to-all" in hlo else "padded" if "all-to-all" in hlo else "none")
''')


def test_expert_parallel_takes_any_token_count_a_mask_and_a_capacity():
    """Padding inside the layer (masked), the mask and a per-device capacity are what one
    device computes; GPU and TPU lower the exchange to `ragged_all_to_all`."""
    lines = on_8_devices(PADDED_SCRIPT).splitlines()
    assert lines[:4] == ["OK 62 all", "OK 2 all", "OK 64 masked", "OK 13 masked"], lines
    assert lines[4] == "OK hierarchical" and lines[5].startswith("OK capacity"), lines
    assert lines[6:] == ["cuda ragged", "tpu ragged", "cpu padded"], lines
