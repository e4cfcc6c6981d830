"""LoRA adapters for a `Decoder`: which weights get one, initialisation, shardings, the
adapted forward and merging.

The optimizer and the checkpoints hold the adapters as a nested dict that mirrors the
parameter paths: ``{"layers": {"3": {"attn": {"q_proj": {"a": A, "b": B}}, ...}}}``.
A weight ``W [in, out]`` gets ``A [in, r]`` and ``B [r, out]``; stacked experts
``W [E, in, out]`` get stacked ``A [E, in, r]`` and ``B [E, r, out]``. The adapted weight is
``W + (alpha / r) * A @ B``; B starts at zero, so a fresh adapter changes nothing.
`with_adapters` puts them into (a copy of) the model as `cmoe_jax.lora.LoRA` variables of
the modules they adapt, so the model's own forward (`Decoder.run_layers`) runs them;
`merge_adapters` folds them into a copy of the weights.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmoe_jax.errors import CmoeError
from cmoe_jax.lora import attach
from cmoe_jax.models.decoder import chunked_nll
from cmoe_jax.models.stack import STACKED, LayerStack, each_layer, layer_value, stack_trees
from cmoe_jax.moe.balance import RouterBias
from cmoe_jax.sharding import logical_axes, spec_for


class TrainError(CmoeError):
    """Bad fine-tuning input: unknown LoRA targets, a mismatched resume directory, short data."""


# every weight an adapter can be attached to, by module
ATTENTION_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_WEIGHTS = ("gate", "up", "down", "shared_gate", "shared_up", "shared_down",
               "expert_gate", "expert_up", "expert_down")
# target names as PEFT spells them, each covering the dense, shared and routed-expert weight
ALIASES = {
    "q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("o_proj",),
    "gate_proj": ("gate", "shared_gate", "expert_gate"),
    "up_proj": ("up", "shared_up", "expert_up"),
    "down_proj": ("down", "shared_down", "expert_down"),
}
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if self.rank < 1:
            raise TrainError(f"--lora-rank must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise TrainError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise TrainError("--targets is empty: name at least one weight to adapt")


def parse_targets(targets) -> tuple[str, ...]:
    """`"q_proj,v_proj"` or a sequence -> tuple of names (unknown names raise TrainError)."""
    if isinstance(targets, str):
        targets = [t for t in (s.strip() for s in targets.split(",")) if t]
    known = set(ATTENTION_WEIGHTS) | set(MLP_WEIGHTS) | set(ALIASES)
    for t in targets:
        if t not in known:
            raise TrainError(f"unknown LoRA target {t!r}: choose from {', '.join(sorted(known))}")
    return tuple(targets)


def _expand(targets) -> set[str]:
    names = set()
    for t in targets:
        names.update(ALIASES.get(t, (t,)))
    return names


def adapted_weights(model, targets) -> list[tuple[tuple, tuple]]:
    """`(path, shape)` of every weight the targets select, e.g. `(("layers", 0, "attn", "q_proj"), (d, n))`.

    Raises TrainError when a target selects no weight of this model (e.g. `shared_gate` on a
    dense model).
    """
    names = _expand(targets)
    found, hit = [], set()
    for i, (layer, stacked) in enumerate(each_layer(model)):
        for module, group, candidates in ((layer.attn, "attn", ATTENTION_WEIGHTS),
                                          (layer.mlp, "mlp", MLP_WEIGHTS)):
            for name in candidates:
                w = getattr(module, name, None)
                if name in names and isinstance(w, nnx.Param):
                    shape = tuple(w.get_value().shape)[1 if stacked else 0:]
                    found.append((("layers", i, group, name), shape))
                    hit.add(name)
    for t in targets:
        if not hit & set(ALIASES.get(t, (t,))):
            present = sorted({p[-1] for p, _ in adapted_weights(model, DEFAULT_TARGETS)})
            raise TrainError(f"LoRA target {t!r} matches no weight of this model "
                             f"(its adaptable weights: {', '.join(present)})")
    return found


def _put(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(str(key), {})
    tree[str(path[-1])] = value


def get_adapter(adapters: dict, path: tuple):
    node = adapters
    for key in path:
        node = node.get(str(key)) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def adapter_shapes(shape: tuple, rank: int) -> tuple[tuple, tuple]:
    *lead, n_in, n_out = shape
    return (*lead, n_in, rank), (*lead, rank, n_out)


def init_adapters(model, cfg: LoRAConfig, key: jax.Array) -> dict:
    """Fresh adapters: A uniform in +-1/sqrt(in) (PEFT's Kaiming init), B = 0, float32."""
    adapters: dict = {}
    for n, (path, shape) in enumerate(adapted_weights(model, cfg.targets)):
        a_shape, b_shape = adapter_shapes(shape, cfg.rank)
        bound = 1.0 / (shape[-2] ** 0.5)
        a = jax.random.uniform(jax.random.fold_in(key, n), a_shape, jnp.float32, -bound, bound)
        _put(adapters, path, {"a": a, "b": jnp.zeros(b_shape, jnp.float32)})
    return adapters


def adapter_specs(model, cfg: LoRAConfig, mesh: Mesh) -> dict:
    """PartitionSpecs of the adapters, following their weight's sharding.

    A column-parallel weight `[d, n]` split over "model" on n keeps A `[d, r]` replicated and
    splits B `[r, n]` the same way; a row-parallel weight splits A on its input rows; stacked
    experts split A and B on the expert axis.
    """
    specs: dict = {}
    axes = logical_axes(model)
    for path, shape in adapted_weights(model, cfg.targets):
        weight_axes = axes.get(path) or axes[("layers", STACKED, *path[2:])][1:]
        s = tuple(spec_for(weight_axes, shape, mesh))
        s = s + (None,) * (len(shape) - len(s))
        _put(specs, path, {"a": P(*s[:-1], None), "b": P(*s[:-2], None, s[-1])})
    return specs


def named(specs, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def delta(adapter: dict, scale: float) -> jax.Array:
    """The weight update `scale * A @ B` (batched over a leading expert axis), float32."""
    return scale * jnp.matmul(adapter["a"].astype(jnp.float32), adapter["b"].astype(jnp.float32))


def _trains_router(mlp) -> bool:
    """A layer with CMoE gate scales u and balancing bias b: a CMoE layer, or a hierarchical
    one (its sub-routers' u, b; its top-level router stays as converted)."""
    return getattr(mlp, "router", None) == "cmoe" or getattr(mlp, "sub_experts", 0) > 0


def router_params(model) -> tuple[dict, dict]:
    """The CMoE router gate scales u and selection biases b by layer: `({"3": u}, {"3": b})`.

    Fresh float32 copies, so donating them to a train step leaves the model intact.
    """
    us, bs = {}, {}
    for i, (layer, _) in enumerate(each_layer(model)):
        if _trains_router(layer.mlp):
            us[str(i)] = jnp.array(layer_value(model, i, "mlp", "u"), jnp.float32, copy=True)
            bs[str(i)] = jnp.array(layer_value(model, i, "mlp", "router_bias"), jnp.float32,
                                   copy=True)
    return us, bs


def _copy(model):
    """New module objects over the same arrays (so attributes can change, not the model)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a, state))


def _per_layer(model, adapters: dict, u: dict | None, bias: dict | None):
    """`[(layer module, {"attn": .., "mlp": .., "u": .., "bias": ..})]`: what goes into each
    layer, or, for stacked layers, into the stacked layer, every layer's values stacked (u / b
    of layers missing from `u` / `bias` then come from the model)."""
    trees = {}
    for i, (layer, stacked) in enumerate(each_layer(model)):
        tree = {g: dict(get_adapter(adapters, ("layers", i, g)) or {}) for g in ("attn", "mlp")}
        for key, given, name in (("u", u, "u"), ("bias", bias, "router_bias")):
            if given and str(i) in given:
                tree[key] = jnp.asarray(given[str(i)])
            elif given and stacked:
                tree[key] = layer_value(model, i, "mlp", name)
        trees[i] = tree
    if isinstance(model.layers, LayerStack):
        return [(model.layers.stacked, stack_trees(list(trees.values())))] if trees else []
    return [(model.layers[i], tree) for i, tree in trees.items()]


def with_adapters(model, adapters: dict, scale: float, u: dict | None = None,
                  bias: dict | None = None, dropout: float = 0.0):
    """A copy of `model` carrying `adapters` as `LoRA` variables of the modules they adapt,
    and the router scales u / selection biases b given by layer (float32, as given; layers
    missing from them keep the model's). Traceable: the train step calls it inside `jit`;
    for stacked layers it stacks the adapters (small), never the weights."""
    out = _copy(model)
    for layer, tree in _per_layer(out, adapters, u, bias):
        for group in ("attn", "mlp"):
            for name, ab in tree[group].items():
                attach(getattr(layer, group), name, ab["a"], ab["b"], scale, dropout)
        if "u" in tree:
            layer.mlp.u = nnx.Param(tree["u"])
        if "bias" in tree:
            layer.mlp.router_bias = RouterBias(tree["bias"])
    return out


def adapted_run(model, adapters: dict, u: dict, bias: dict, tokens: jax.Array, *,
                scale: float, dropout: float = 0.0, key: jax.Array | None = None,
                remat: bool = False, capture: bool = False):
    """(residual stream after the last layer of the adapted model, every layer's FFN input
    when `capture` else [], the expert loads `{layer: int32 [E]}` of its CMoE layers).
    Layer i's dropout masks come from `fold_in(key, i)` (no dropout without a key)."""
    adapted = with_adapters(model, adapters, scale, u, bias, dropout)
    h, inputs, loads = adapted.run_layers(tokens, key=key, remat=remat, capture=capture)
    cmoe = {str(i) for i, (layer, _) in enumerate(each_layer(model)) if _trains_router(layer.mlp)}
    return h, inputs, {k: v for k, v in loads.items() if k in cmoe}


def lora_hidden(model, adapters: dict, u: dict, bias: dict, tokens: jax.Array, *,
                scale: float, dropout: float = 0.0, key: jax.Array | None = None,
                remat: bool = False):
    """Residual stream after the last layer of the adapted model, and the expert loads of
    its CMoE layers (`adapted_run` without the captured inputs)."""
    h, _, loads = adapted_run(model, adapters, u, bias, tokens, scale=scale, dropout=dropout,
                              key=key, remat=remat)
    return h, loads


def lora_logits(model, adapters: dict, u: dict | None = None, bias: dict | None = None,
                tokens=None, *, scale: float, dropout: float = 0.0, key=None) -> jax.Array:
    """Logits `[B, T, vocab]` of the adapted model (for tests and small inputs)."""
    h, _ = lora_hidden(model, adapters, u or {}, bias or {}, tokens, scale=scale,
                       dropout=dropout, key=key)
    return model.unembed(h)


def lora_loss(model, adapters, u, bias, tokens, *, scale, dropout=0.0, key=None, remat=False):
    """(mean next-token NLL, expert loads by layer) of the adapted model on `tokens [B, T]`;
    the LM head runs in rematerialised chunks, so `[B, T, vocab]` logits are never stored."""
    h, loads = lora_hidden(model, adapters, u, bias, tokens, scale=scale, dropout=dropout,
                           key=key, remat=remat)
    h = model.norm(h)[:, :-1]
    nll = chunked_nll(h, tokens[:, 1:], model.lm_head_matrix(), 128, remat=True)
    return jnp.mean(nll), loads


def merge_adapters(model, adapters: dict, scale: float, u: dict | None = None,
                   bias: dict | None = None):
    """A copy of `model` with `W + scale * A @ B` folded in and u / b set; `model` is unchanged."""
    merged = _copy(model)
    for layer, tree in _per_layer(merged, adapters, u, bias):
        for group in ("attn", "mlp"):
            module = getattr(layer, group)
            for name, adapter in tree[group].items():
                w = getattr(module, name)
                new = w[...].astype(jnp.float32) + delta(adapter, scale)
                setattr(module, name, nnx.Param(new.astype(w[...].dtype)))
        mlp = layer.mlp
        if "u" in tree:
            mlp.u = nnx.Param(tree["u"].astype(mlp.u[...].dtype))
        if "bias" in tree:
            mlp.router_bias[...] = tree["bias"].astype(mlp.router_bias[...].dtype)
    return merged
