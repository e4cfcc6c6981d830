"""Which weights of a `Decoder` get LoRA adapters, their initialisation and shardings, and the
adapted model's next-token loss: the training side of LoRA.

The adapters are the nested dict `cmoe_jax.models.adapters` describes (one `{"a": A, "b": B}` per
adapted weight, by parameter path); B starts at zero, so a fresh adapter changes nothing.
The adapted forward and merging are `cmoe_jax.models.adapters`'s (`with_adapters`,
`merge_adapters`, `adapted_run`), re-exported by `cmoe_jax.train`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmoe_jax.errors import TrainError
from cmoe_jax.models.decoder import chunked_nll
from cmoe_jax.models.adapters import AdapterSet, adapted_run
from cmoe_jax.models.layer_parts import layer_path
from cmoe_jax.models.stack import each_layer
from cmoe_jax.sharding import logical_axes, spec_for


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

    def parsed(self) -> "LoRAConfig":
        """These settings with the targets parsed (a comma-separated string accepted; unknown
        names fail here) and alpha and dropout as floats."""
        return dataclasses.replace(self, alpha=float(self.alpha), dropout=float(self.dropout),
                                   targets=parse_targets(self.targets))

    def validate(self) -> None:
        if self.rank < 1:
            raise TrainError(f"--lora-rank must be at least 1, got {self.rank}")
        if not 0 < self.alpha <= MAX_SCALE * self.rank:  # also refuses nan
            raise TrainError(f"--lora-alpha {self.alpha:g} with --lora-rank {self.rank} scales the adapters' "
                             f"update by {self.alpha / self.rank:g}: give a value above 0 and at most "
                             f"{MAX_SCALE * self.rank:g} ({MAX_SCALE:g} x the rank; the usual alpha is 1 to 2 x "
                             "the rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise TrainError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise TrainError("--targets is empty: name at least one weight to adapt")

    def applied(self, lora: dict, u: dict | None = None, bias: dict | None = None) -> AdapterSet:
        """The adapters `lora` (with router scales u / biases b by layer) at this scale and dropout."""
        return AdapterSet(lora, u or {}, bias or {}, self.scale, self.dropout)


# the largest update scale alpha/rank: beyond it one optimiser step of an adapter (B moves by
# about the learning rate) changes each weight by more than the weight itself, and the
# "trained" model is noise (at 1e22 its predictions are uniform) though every loss is finite
MAX_SCALE = 1000.0


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
        weight_axes = axes.get(path) or axes[(*layer_path(model, path[1]), *path[2:])][1:]
        s = tuple(spec_for(weight_axes, shape, mesh))
        s = s + (None,) * (len(shape) - len(s))
        _put(specs, path, {"a": P(*s[:-1], None), "b": P(*s[:-2], None, s[-1])})
    return specs


def named(specs, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def lora_hidden(model, adapters: AdapterSet, tokens: jax.Array, *, key: jax.Array | None = None,
                remat: bool = False):
    """Residual stream after the last layer of the adapted model, and the expert loads of
    its CMoE layers (`adapted_run` without the captured inputs)."""
    h, _, loads = adapted_run(model, adapters, tokens, key=key, remat=remat)
    return h, loads


def lora_logits(model, adapters: AdapterSet, tokens, *, key=None) -> jax.Array:
    """Logits `[B, T, vocab]` of the adapted model (for tests and small inputs)."""
    h, _ = lora_hidden(model, adapters, tokens, key=key)
    return model.unembed(h)


def lora_loss(model, adapters: AdapterSet, tokens, *, key=None, remat=False):
    """(mean next-token NLL, expert loads by layer) of the adapted model on `tokens [B, T]`;
    the LM head runs in rematerialised chunks, so `[B, T, vocab]` logits are never stored."""
    h, loads = lora_hidden(model, adapters, tokens, key=key, remat=remat)
    h = model.norm(h)[:, :-1]
    nll = chunked_nll(h, tokens[:, 1:], model.lm_head_matrix(), 128, remat=True)
    return jnp.mean(nll), loads
