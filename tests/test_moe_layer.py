"""MoEFFN against a per-token numpy loop (forward) and a dense per-expert jnp recomputation
(gradients), for every router and every grouped-matmul backend."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.moe import MoEFFN, RouterBias
from cmoe_jax.moe.gmm import cpu as gmm_cpu, pallas_gpu as gmm_pallas_gpu, tpu as gmm_tpu

D, M, E, S = 16, 8, 6, 12

BACKENDS = {
    "cpu": "cpu",
    "cpu_small_blocks": gmm_cpu.make_gmm(windows=(8, 4)),
    "dense": "dense",
    "ragged_dot": "ragged_dot",
    "pallas_gpu_interpret": gmm_pallas_gpu.make_gmm((16, 16, 16), interpret=True),
    "megablox_tpu_interpret": gmm_tpu.make_gmm((16, 16, 16), interpret=True),
}
ROUTERS = [("cmoe", 2, False), ("linear", 2, False), ("linear", 3, True), ("sum", E, False)]


def silu(z):
    return z / (1.0 + np.exp(-z))


def softmax(z):
    z = np.exp(z - z.max())
    return z / z.sum()


def make(router, top_k, norm=False, shared=S, backend="cpu", seed=0, dtype=jnp.float32):
    layer = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=top_k, shared_width=shared, router=router, norm_topk_prob=norm,
                   backend=backend, dtype=dtype, activation="silu", rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 10)
    # larger weights than the init so experts and routing differ clearly
    for name in ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up",
                 "shared_down", "router_kernel", "router_gate", "router_up"):
        if hasattr(layer, name):
            var = getattr(layer, name)
            var[...] = jnp.asarray(rng.normal(size=var.shape) * 0.5, var[...].dtype)
    if router == "cmoe":
        layer.u[...] = jnp.asarray(rng.normal(size=(E,)), jnp.float32)
        layer.router_bias[...] = jnp.asarray(rng.normal(size=(E,)) * 0.05, jnp.float32)
    return layer


def pure(layer):
    return {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(layer)).items()}


def numpy_forward(p, x, router, top_k, norm, scoring="softmax", scaling=1.0):
    """Per token, per selected expert, in float64."""
    out = np.zeros_like(x, dtype=np.float64)
    counts = np.zeros(E, np.int64)
    for t, xt in enumerate(x.astype(np.float64)):
        if router == "linear":
            z = xt @ p["router_kernel"]
            probs = 1 / (1 + np.exp(-z)) if scoring == "sigmoid" else softmax(z)
            sel = np.argsort(-(probs + p.get("router_bias", 0.0)), kind="stable")[:top_k]  # bias: the choice only
            gates = scaling * probs[sel] / (probs[sel].sum() if norm else 1.0)
        elif router == "cmoe":
            s = np.abs(silu(xt @ p["router_gate"]) * (xt @ p["router_up"]))
            probs = softmax(s)
            sel = np.argsort(-(probs + p["router_bias"]), kind="stable")[:top_k]
            gates = 1.0 + probs[sel] * p["u"][sel]
        else:
            sel, gates = np.arange(E), np.ones(E)
        y = np.zeros(D)
        if "shared_gate" in p:
            y += (silu(xt @ p["shared_gate"]) * (xt @ p["shared_up"])) @ p["shared_down"]
        for e, g in zip(sel, gates):
            y += g * ((silu(xt @ p["expert_gate"][e]) * (xt @ p["expert_up"][e])) @ p["expert_down"][e])
            counts[e] += 1
        out[t] = y
    return out, counts


def jnp_dense_forward(p, x, router, top_k, norm):
    """Every expert on every token, weighted by a dense [T, E] gate matrix (0 if unselected)."""
    x = x.astype(jnp.float32)
    if router == "linear":
        probs = jax.nn.softmax(x @ p["router_kernel"], axis=-1)
        _, sel = jax.lax.top_k(jax.lax.stop_gradient(probs), top_k)
        onehot = jax.nn.one_hot(sel, E).sum(1)
        gates = probs * onehot
        if norm:
            gates = gates / gates.sum(-1, keepdims=True)
    elif router == "cmoe":
        probs = jax.nn.softmax(jnp.abs(jax.nn.silu(x @ p["router_gate"]) * (x @ p["router_up"])), -1)
        _, sel = jax.lax.top_k(jax.lax.stop_gradient(probs) + p["router_bias"], top_k)
        onehot = jax.nn.one_hot(sel, E).sum(1)
        gates = (1.0 + probs * p["u"]) * onehot
    else:
        gates = jnp.ones((x.shape[0], E))
    h = jax.nn.silu(jnp.einsum("td,edm->tem", x, p["expert_gate"])) * jnp.einsum(
        "td,edm->tem", x, p["expert_up"])
    y = jnp.einsum("tem,emd,te->td", h, p["expert_down"], gates)
    if "shared_gate" in p:
        y = y + (jax.nn.silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_down"]
    return y


def tokens(n=24, seed=1, scale=1.0):
    return (np.random.default_rng(seed).normal(size=(n, D)) * scale).astype(np.float32)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("router,top_k,norm", ROUTERS)
def test_forward_matches_per_token_loop(backend, router, top_k, norm):
    layer = make(router, top_k, norm, backend=BACKENDS[backend])
    x = tokens()
    y, counts = layer(jnp.asarray(x).reshape(2, 12, D), return_load=True)
    assert y.shape == (2, 12, D) and counts.dtype == jnp.int32
    want, want_counts = numpy_forward(pure(layer), x, router, top_k, norm)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(counts), want_counts)


@pytest.mark.parametrize("backend", ["cpu", "cpu_small_blocks", "dense", "ragged_dot",
                                     "pallas_gpu_interpret", "megablox_tpu_interpret"])
@pytest.mark.parametrize("router,top_k,norm", ROUTERS)
def test_gradients_match_dense_recomputation(backend, router, top_k, norm):
    layer = make(router, top_k, norm, backend=BACKENDS[backend])
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    x = jnp.asarray(tokens())
    cot = jnp.asarray(np.random.default_rng(5).normal(size=(24, D)).astype(np.float32))

    def layer_loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x) * cot)

    g_params, g_x = jax.grad(layer_loss, argnums=(0, 1))(params, x)
    p = {k: jnp.asarray(v, jnp.float32) for k, v in pure(layer).items()}
    trainable = {k: p[k] for k in nnx.to_pure_dict(params)}
    fixed = {k: v for k, v in p.items() if k not in trainable}

    def ref_loss(tp, x):
        return jnp.sum(jnp_dense_forward({**tp, **fixed}, x, router, top_k, norm) * cot)

    r_params, r_x = jax.grad(ref_loss, argnums=(0, 1))(trainable, x)
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(r_x), rtol=1e-4, atol=1e-4)
    got = nnx.to_pure_dict(g_params)
    assert set(got) == set(r_params)
    for k in got:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(r_params[k]), rtol=1e-4,
                                   atol=1e-4, err_msg=k)
    if router == "cmoe":
        assert np.abs(np.asarray(got["u"])).max() > 0
        assert "router_bias" not in got  # the bias is state, not a trainable parameter


@pytest.mark.parametrize("backend", ["cpu", "ragged_dot", "pallas_gpu_interpret"])
def test_empty_experts_give_zero_output_and_gradient(backend):
    layer = make("cmoe", 2, backend=BACKENDS[backend])
    layer.router_bias[...] = jnp.array([0.0, 0.0, -10.0, 0.0, -10.0, 0.0])  # never chosen
    x = jnp.asarray(tokens())
    y, counts = layer(x, return_load=True)
    assert counts[2] == 0 and counts[4] == 0 and int(counts.sum()) == 24 * 2
    want, _ = numpy_forward(pure(layer), np.asarray(x), "cmoe", 2, False)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
    for name in ("expert_gate", "expert_up", "expert_down"):
        g = np.asarray(getattr(grads, name)[...])
        assert np.all(g[[2, 4]] == 0), name
        assert np.abs(g[[0, 1, 3, 5]]).max() > 0, name
    assert np.asarray(grads.u[...])[[2, 4]].tolist() == [0.0, 0.0]


def test_cmoe_at_u_zero_sums_selected_experts_unweighted():
    layer = make("cmoe", 2)
    layer.u[...] = jnp.zeros((E,))
    x = tokens()
    p = pure(layer)
    y = np.asarray(layer(jnp.asarray(x)))
    s = np.abs(silu(x @ p["router_gate"]) * (x @ p["router_up"]))
    probs = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    sel = np.argsort(-(probs + p["router_bias"]), axis=-1, kind="stable")[:, :2]
    for t in range(len(x)):
        want = (silu(x[t] @ p["shared_gate"]) * (x[t] @ p["shared_up"])) @ p["shared_down"]
        for e in sel[t]:
            want = want + (silu(x[t] @ p["expert_gate"][e]) * (x[t] @ p["expert_up"][e])) @ p["expert_down"][e]
        np.testing.assert_allclose(y[t], want, rtol=1e-4, atol=1e-4)


def test_sum_router_equals_dense_ffn():
    """Splitting a dense SwiGLU's neurons into experts and summing them all is exact."""
    layer = make("sum", E, shared=0)
    p = pure(layer)
    wg = np.concatenate(list(p["expert_gate"]), axis=1)
    wu = np.concatenate(list(p["expert_up"]), axis=1)
    wd = np.concatenate(list(p["expert_down"]), axis=0)
    x = tokens()
    want = (silu(x @ wg) * (x @ wu)) @ wd
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), want, rtol=1e-4, atol=1e-4)


def test_bias_changes_selection_not_gates():
    layer = make("cmoe", 1)
    layer.u[...] = jnp.zeros((E,))
    x = jnp.asarray(tokens())
    layer.router_bias[...] = jnp.zeros((E,)).at[3].set(5.0)
    _, counts = layer(x, return_load=True)
    assert int(counts[3]) == 24
    want, _ = numpy_forward(pure(layer), np.asarray(x), "cmoe", 1, False)
    np.testing.assert_allclose(np.asarray(layer(x)), want, rtol=1e-4, atol=1e-4)


def test_parameter_kinds_and_shapes():
    layer = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, shared_width=S, router="cmoe", param_dtype=jnp.bfloat16,
                   activation="silu", rngs=nnx.Rngs(0))
    assert isinstance(layer.router_bias, RouterBias) and not isinstance(layer.router_bias, nnx.Param)
    shapes = {k: v.shape for k, v in nnx.to_pure_dict(nnx.state(layer, nnx.Param)).items()}
    assert shapes == {"shared_gate": (D, S), "shared_up": (D, S), "shared_down": (S, D),
                      "expert_gate": (E, D, M), "expert_up": (E, D, M), "expert_down": (E, M, D),
                      "router_gate": (D, E), "router_up": (D, E), "u": (E,)}
    assert layer.expert_gate[...].dtype == jnp.bfloat16
    assert float(jnp.abs(layer.u[...]).max()) == 0 and float(jnp.abs(layer.router_bias[...]).max()) == 0
    lin = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, router="linear", activation="silu", rngs=nnx.Rngs(0))
    assert lin.router_kernel.shape == (D, E) and not hasattr(lin, "shared_gate")
    assert not hasattr(MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=E, router="sum", activation="silu", rngs=nnx.Rngs(0)), "router_kernel")


@pytest.mark.parametrize("kwargs,match", [
    (dict(router="sum", top_k=2), "top_k must be"),
    (dict(router="topk"), "router must be"),
    (dict(top_k=0), "top_k"),
    (dict(backend="nope"), "unknown gmm backend"),
])
def test_invalid_configurations(kwargs, match):
    args = dict(router="linear", top_k=2) | kwargs
    with pytest.raises(ValueError, match=match):
        MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=args.pop("top_k"), activation="silu", rngs=nnx.Rngs(0),
               **args)


def test_activation_is_required():
    """No silent default: a layer built for a Gemma model must not quietly run SiLU."""
    with pytest.raises(TypeError, match="activation"):
        MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, rngs=nnx.Rngs(0))


def test_bf16_close_to_fp32():
    x = jnp.asarray(tokens(scale=0.5))
    y32 = make("linear", 2)(x)
    y16 = make("linear", 2, dtype=jnp.bfloat16)(x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y32), rtol=0.05, atol=0.05)


def test_jit_and_nnx_training_step():
    """One optax step through nnx.jit: the gates' scales u move, the bias does not."""
    import optax

    layer = make("cmoe", 2)
    layer.u[...] = jnp.zeros((E,))
    opt = nnx.Optimizer(layer, optax.sgd(0.1), wrt=nnx.Param)
    x = jnp.asarray(tokens())
    bias0 = np.asarray(layer.router_bias[...])

    @nnx.jit
    def step(layer, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(layer)
        opt.update(layer, grads)
        return loss

    l0 = step(layer, opt, x)
    assert np.abs(np.asarray(layer.u[...])).max() > 0
    np.testing.assert_array_equal(np.asarray(layer.router_bias[...]), bias0)
    assert float(step(layer, opt, x)) < float(l0)


def test_a_top_k_changed_after_construction_is_refused_where_it_is_used():
    layer = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, activation="silu", rngs=nnx.Rngs(0))
    layer.top_k = E + 1
    with pytest.raises(ValueError, match=f"top_k={E + 1} must be in"):
        layer(jnp.ones((3, D)))


@pytest.mark.parametrize("norm", [False, True])
def test_the_linear_router_with_a_balancing_bias_matches_a_recomputation(norm):
    """`router_balance`: the top-k of probs + b choose, the probabilities weigh; b moves with
    `update_bias`, gets no gradient, and LoRA adapters on the experts apply as merged weights."""
    from cmoe_jax.lora_variables import attach

    plain = make("linear", 2, norm)
    layer = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, shared_width=S, norm_topk_prob=norm,
                   router_balance=True, activation="silu", rngs=nnx.Rngs(0))
    nnx.update(layer, nnx.state(plain, nnx.Param))
    layer.router_bias[...] = jnp.asarray(np.random.default_rng(3).normal(size=E) * 0.2, jnp.float32)
    x = tokens()
    y, counts = layer(jnp.asarray(x), return_load=True)
    want, want_counts = numpy_forward(pure(layer), x, "linear", 2, norm)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(counts), want_counts)
    assert (np.asarray(counts) != np.asarray(plain(jnp.asarray(x), return_load=True)[1])).any()

    before = np.asarray(layer.router_bias[...])
    layer.update_bias(counts, gamma=0.01)
    step = np.sign(np.asarray(counts).mean() - np.asarray(counts))
    np.testing.assert_allclose(np.asarray(layer.router_bias[...]), before + 0.01 * step, rtol=1e-6)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.asarray(x)) ** 2))(layer)
    assert "router_bias" not in nnx.to_pure_dict(grads)  # state, not a parameter

    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(E, D, 2)) * 0.3, rng.normal(size=(E, 2, M)) * 0.3
    attach(layer, "expert_up", a, b, scale=0.5)
    merged = pure(layer)
    merged["expert_up"] = merged["expert_up"] + 0.5 * np.einsum("edr,erm->edm", a, b)
    want, _ = numpy_forward(merged, x, "linear", 2, norm)
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("field,value", [("router_balance", True), ("router_scoring", "sigmoid"),
                                         ("routed_scaling", 2.0), ("router_jitter", 0.1),
                                         ("threshold_routing", True)])
def test_a_router_option_its_kind_does_not_implement_is_refused(field, value):
    router = "linear" if field == "threshold_routing" else "cmoe"
    with pytest.raises(ValueError, match=f"{field} is not an option of the {router!r} router"):
        MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, router=router, activation="silu",
               rngs=nnx.Rngs(0), **{field: value})


@pytest.mark.parametrize("norm,balance", [(False, False), (True, True)])
def test_sigmoid_scores_and_a_routed_scale_match_a_recomputation(norm, balance):
    layer = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, shared_width=S, norm_topk_prob=norm,
                   router_balance=balance, router_scoring="sigmoid", routed_scaling=2.5, activation="silu",
                   rngs=nnx.Rngs(0))
    nnx.update(layer, nnx.state(make("linear", 2, norm), nnx.Param))
    if balance:
        layer.router_bias[...] = jnp.asarray(np.random.default_rng(3).normal(size=E) * 0.2, jnp.float32)
    x = tokens()
    y, counts = layer(jnp.asarray(x), return_load=True)
    want, want_counts = numpy_forward(pure(layer), x, "linear", 2, norm, scoring="sigmoid", scaling=2.5)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(counts), want_counts)


def test_router_jitter_acts_only_in_training_on_the_router_input():
    """With a key the router sees x * U(1 - j, 1 + j) (the experts see x); without, nothing."""
    from cmoe_jax.moe.routers.base import jittered

    layer = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, router_jitter=0.5, activation="silu",
                   rngs=nnx.Rngs(0))
    nnx.update(layer, nnx.state(make("linear", 2, shared=0), nnx.Param))
    x, key = jnp.asarray(tokens()), jax.random.PRNGKey(7)
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(make("linear", 2, shared=0)(x)))
    noisy = np.asarray(jittered(x, layer.router_settings, key))
    ratio = noisy / np.asarray(x)
    assert 0.5 <= ratio.min() and ratio.max() <= 1.5 and ratio.std() > 0.1
    ids, gates = layer.route(x, key)
    want_ids, want_gates = layer.router_unit.route(jnp.asarray(noisy), layer.router_arrays(), layer.router_settings)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(gates), np.asarray(want_gates), rtol=1e-6)
    assert (np.asarray(ids) != np.asarray(layer.route(x)[0])).any()


@pytest.mark.parametrize("field,value", [("router_scoring", "tanh"), ("routed_scaling", 0.0), ("router_jitter", 1.0)])
def test_bad_routing_options_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, activation="silu", rngs=nnx.Rngs(0), **{field: value})


@pytest.mark.parametrize("dispatch", ["sort", "gather", "dense", "padded"])
def test_a_compiled_layer_names_its_router_dispatch_experts_and_combine(dispatch):
    """The op names a profile shows carry the layer's parts (docs/guides/moe-layer.md)."""
    layer = MoEFFN(d_model=16, expert_width=8, num_experts=4, top_k=2, shared_width=8, router="cmoe",
                   activation="silu", rngs=nnx.Rngs(0), dispatch=dispatch)
    graphdef, state = nnx.split(layer)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    hlo = forward.lower(state, jnp.ones((6, 16))).compile().as_text()
    names = set(re.findall(r'op_name="[^"]*?/(router|dispatch|experts|shared_mlp|combine)/', hlo))
    assert names == {"router", "dispatch", "experts", "shared_mlp", "combine"}, names


def test_every_variable_carries_its_logical_axes():
    """Axes are metadata of the variables themselves, one per dimension."""
    from cmoe_jax.moe import HierMoEFFN

    for layer in (MoEFFN(d_model=16, expert_width=8, num_experts=4, top_k=2, shared_width=8, router="cmoe",
                         shared_gated=True, num_prototypes=3, activation="silu", rngs=nnx.Rngs(0)),
                  HierMoEFFN(d_model=16, expert_width=4, num_experts=4, top_k=2, router="linear", sub_experts=4,
                             sub_shared=1, sub_top_k=2, activation="silu", rngs=nnx.Rngs(0))):
        for path, var in nnx.to_flat_state(nnx.state(layer)):
            axes = var.get_metadata().get("out_sharding")
            assert axes is not None and len(axes) == var.get_value().ndim, (path, axes)
    assert dict(nnx.to_flat_state(nnx.state(layer)))[("expert_gate",)].get_metadata()["out_sharding"] == (
        "expert", "embed", "mlp")
