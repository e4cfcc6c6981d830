"""Where a layer's routed experts run, decided and run in one place (`run_experts`).

Five ways to run the (token, expert) pairs of one call:

- "expert_parallel": the mesh set with `jax.set_mesh` has the layer's expert axis (size > 1):
  experts split over it, tokens exchanged by all-to-all (`cmoe_jax.moe.expert_parallel`);
- "gather": very few pairs (below `DenseWhen.gather_share` per expert, e.g. one decoding
  step) and no adapters: each pair reads only its own expert's weights;
- "dense": where sparsity cannot pay (`DenseWhen`): every expert on every token, the
  unchosen ones weighted zero, as one wide product (`cmoe_jax.moe.dispatch.dense_experts`);
- "padded": where the platform's rule allows it (`DenseWhen.padded_share`) and the padded
  groups are clearly fewer rows than every expert on every token: each expert's rows padded
  to one capacity and run as batched matmuls (`cmoe_jax.moe.padded`);
- "sort": otherwise, tokens sorted by expert and run through grouped matmuls
  (`cmoe_jax.moe.dispatch`).

The choice is static (token count, experts, top-k, platform), made at trace time; a layer's
`dispatch` argument forces one of the one-device paths instead (benchmarks, tests).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp

from cmoe_jax.moe.dispatch import GLUExperts, Slabs, dense_experts, gathered_experts
from cmoe_jax.moe.expert_parallel import routed_swiglu_experts
from cmoe_jax.moe.mesh_axes import expert_parallel_active
from cmoe_jax.moe.padded import capacity_ladder, padded_experts

Mode = Literal["expert_parallel", "gather", "dense", "padded", "sort"]


class DenseWhen(NamedTuple):
    """When the dense path beats the others on a platform (measured by
    benchmarks/moe_grid.py, docs/results/performance.md): at most `rows_per_expert`
    (token, slot) pairs per expert (the sort's fixed cost, a loop step per window, outweighs
    the skipped products), or a token using at least `share` of the experts with at most
    `share_tokens` tokens. The gather path runs below `gather_share` pairs per expert,
    reading each product's expert slices in slabs of at most `gather_slab_bytes` (0: whole)
    in at most `gather_slab_steps` loop steps (`cmoe_jax.moe.dispatch.pair_products`): where
    XLA:CPU copies a sliced operand before its product, a slab's copy stays in cache; slices
    of at most `gather_slab_min_bytes` stay whole. Above
    it, the padded path runs where its first capacity is at most `padded_share` of the
    tokens (its `E * C` rows against the dense path's `E * T`; 0: never) and the layer has
    at least `padded_experts` routed experts; over fewer it runs for calls of at most
    `padded_tokens` tokens, and over experts of more than `large_expert_size` elements
    (d x m) at any count."""

    rows_per_expert: float = 0
    share: float = 2.0
    share_tokens: int = 0
    gather_share: float = 1.0
    padded_share: float = 0.0
    padded_experts: int = 0
    padded_tokens: int = 0
    large_expert_size: int = 1 << 62
    gather_slab_bytes: int = 0
    gather_slab_steps: int = 1
    gather_slab_min_bytes: int = 0

    def slabs(self) -> Slabs | None:
        """How the gather cuts its expert slices (None: whole)."""
        if self.gather_slab_bytes <= 0:
            return None
        return Slabs(self.gather_slab_bytes, self.gather_slab_steps, self.gather_slab_min_bytes)


# keyed by platform, or "platform:dtype" where the expert weights' dtype changes the answer:
# in bf16 XLA:CPU's grouped matmul upcasts each window while the dense products accumulate in
# float32 at twice the fp32 rate, so the dense path wins up to more pairs per expert, and the
# padded path's batched matmuls (float32 accumulation too) win wherever they skip 30% of the
# dense path's rows (S3A3E8's 16 tokens, whose first capacity of 12 skips a quarter, ran
# 0.84x-0.88x of the dense path's speed padded in bf16, 0.97x-1.06x in fp32); on a GPU they run on cuBLAS, at twice the Pallas grouped matmul's
# rate. In fp32 on CPU they win over 8 or more routed experts, whose windows the sort
# loops over while the batched matmuls do not care (the layer alone mostly faster from 128
# tokens, by up to a quarter; a whole SmolLM2 of 16-expert layers 1-3%); over fewer they win
# in the layer at 128 tokens (at every width, by up to a third) and over Llama-2-7B's large
# experts at 16 to 4096 tokens, while at 4096 tokens over small experts the sort is level or
# faster and a whole converted SmolLM2 at 128 tokens was level, so fewer than 8 pad only up
# to 256 tokens and over large experts. That includes a decoding step of 16 rows (16 pairs
# over S1A1E8's 7 routed experts, capacities of 4 and 6 rows, then all 16 tokens in place of
# the sort, `pads_every_token`): padded, the layer alone is faster than the dense path, a
# whole step on WikiText-2 text level with it. One token
# gathers up to three quarters of the routed experts: S3A3E8's 3 of 5 in a whole decoding
# step 1.3x faster gathered than on the dense path, which reads all five (in the layer
# alone, its weights in cache, the two are level) (benchmarks/moe_grid.py,
# benchmarks/model_dispatch.py, benchmarks/decode_step.py --paths, performance.md). One
# token at 4096x11008 in fp32 gathered in slabs of 256 KiB an expert runs 1.08x-3.07x the
# dense FFN's speed (S3A3E8 to S1A1E8), where sorted it ran 0.53x-1.93x and on the dense
# path 0.66x-0.82x; expert slices of at most 1 MiB (576x1536's, 640x2048's) stay whole: the
# layer alone, its weights left in cache, ran slower in slabs (one token of S2A2E8 0.72x-0.82x
# of the dense FFN's speed, 0.88x-0.95x whole; S1A1E8 1.06x-1.23x, 1.32x-1.50x), and though
# slabs of 128 KiB won with its weights evicted first (`moe_grid.py --cache cold`), whole
# decoding steps of SmolLM2 conversions whose layers hold their own weights were level or
# up to 3% slower with them (performance.md, "The cache state a call starts from"); in bf16 they are
# slower (the one-row bf16 product is what costs), the gather of whole slices 2-3x the sort
# at every width, and one token of S3A3E8 (3 of 5 routed experts) gathered runs 0.9x-1.7x
# the dense FFN's speed in the layer alone, where its dense path runs 0.72x-1.08x
DENSE_WHEN = {"cpu": DenseWhen(rows_per_expert=16, share=0.5, share_tokens=1024, gather_share=0.75,
                               padded_share=0.7, padded_experts=8, padded_tokens=256,
                               large_expert_size=1 << 20, gather_slab_bytes=1 << 18, gather_slab_steps=16,
                               gather_slab_min_bytes=1 << 20),
              "cpu:bfloat16": DenseWhen(rows_per_expert=64, share=0.5, share_tokens=1 << 30,
                                        gather_share=0.75, padded_share=0.7),
              "gpu": DenseWhen(rows_per_expert=64, share=0.5, share_tokens=1 << 30, padded_share=0.7)}


def dense_when(dtype=None) -> DenseWhen:
    """The rule of the current platform for expert weights of `dtype`."""
    backend = jax.default_backend()
    key = f"{backend}:{jnp.dtype(dtype).name}" if dtype is not None else None
    return DENSE_WHEN.get(key) or DENSE_WHEN.get(backend, DenseWhen())


_SLICED_WEIGHTS = contextvars.ContextVar("cmoe_jax_sliced_weights", default=False)


@contextlib.contextmanager
def sliced_weights():
    """Trace-time context for layers whose weights are slices of stacked arrays (the body of
    a `lax.scan` over layers, `cmoe_jax.models.stack`): their gather reads whole expert
    slices, fused with the stack's slice, since a loop over slabs would take the layer's
    slice as its operand and XLA would copy all of it (a converted SmolLM2's decoding step
    1.5x slower)."""
    token = _SLICED_WEIGHTS.set(True)
    try:
        yield
    finally:
        _SLICED_WEIGHTS.reset(token)


def gather_slabs(dtype) -> Slabs | None:
    """How the gather path cuts its expert slices here: the platform rule's slabs
    (`DenseWhen.slabs`), none under `sliced_weights`."""
    return None if _SLICED_WEIGHTS.get() else dense_when(dtype).slabs()


class PairCall(NamedTuple):
    """One call's (token, slot) pairs, as the dispatch rule sees them: `num_pairs` pairs of `top_k`
    slots a token over `num_experts` experts of `dtype` and `expert_size` elements each (d x m)."""

    num_pairs: int
    num_experts: int
    top_k: int = 1
    dtype: object = None
    expert_size: int = 0


def dispatch_mode(call: PairCall, expert_axis: str | None = None, *, adapters: bool = False,
                  weight=None, dispatch: str = "auto") -> Mode:
    """How to run `call` (module doc); `dispatch` other than "auto" forces a one-device path
    (adapters always sort: they ride on the grouped matmuls)."""
    if expert_parallel_active(expert_axis, weight):
        return "expert_parallel"
    if adapters:
        return "sort"
    return one_device_mode(call) if dispatch == "auto" else dispatch


def one_device_mode(call: PairCall) -> Mode:
    """The platform's rule (`dense_when`) for `call` on one device."""
    when, e, k = dense_when(call.dtype), call.num_experts, call.top_k
    if call.num_pairs <= e * when.gather_share:
        return "gather"
    tokens = call.num_pairs // max(k, 1)
    if _pads(call, when, tokens) and capacity_ladder(call.num_pairs, e)[0] <= when.padded_share * tokens:
        return "padded"
    if call.num_pairs <= when.rows_per_expert * e or (k / e >= when.share and tokens <= when.share_tokens):
        return "dense"
    return "sort"


def pads_every_token(call: PairCall) -> bool:
    """Whether the padded path's last rung holds every token (`cmoe_jax.moe.padded`): where
    the dense path beats the sort (few pairs an expert), so an uneven call pads to the dense
    path's size rather than sorting."""
    return call.num_pairs <= dense_when(call.dtype).rows_per_expert * call.num_experts


def _pads(call: PairCall, when: DenseWhen, tokens: int) -> bool:
    """Whether `call`'s experts are many or large enough for the padded path (`DenseWhen`)."""
    few_tokens = tokens <= when.padded_tokens
    return call.num_experts >= when.padded_experts or few_tokens or call.expert_size > when.large_expert_size


class ExpertRun(NamedTuple):
    """A layer's settings for running its experts: compute `dtype`, the mesh `expert_axis`,
    its `dispatch` ("auto" or a forced path) and the stored expert `weight` (whose sharding
    tells a mesh not set with `jax.set_mesh`)."""

    dtype: object
    expert_axis: str | None
    dispatch: str = "auto"
    weight: object = None


def run_experts(x: jax.Array, ids: jax.Array, gates: jax.Array, experts: GLUExperts, run: ExpertRun,
                adapters: dict | None = None, make_lora: Callable | None = None) -> tuple[jax.Array, jax.Array]:
    """float32 `[T, d]` sum of each token's gated expert outputs and int32 `[E]` loads, on the
    path `dispatch_mode` picks for the pairs `ids`/`gates [T, k]` (`adapters`: LoRA factors
    that ride on the grouped matmuls, `make_lora` their hook)."""
    dtype, expert_axis = run.dtype, run.expert_axis
    call = PairCall(ids.size, experts.w_gate.shape[0], ids.shape[1], dtype,
                    experts.w_gate.shape[1] * experts.w_gate.shape[2])
    mode = dispatch_mode(call, expert_axis, adapters=bool(adapters), weight=run.weight, dispatch=run.dispatch)
    if mode == "gather":
        return gathered_experts(x, ids, gates, *experts.weights, experts.activation, slabs=gather_slabs(dtype))
    if mode == "dense":
        return dense_experts(x, ids, gates, *experts.weights, activation=experts.activation)
    if mode == "padded":
        return padded_experts(x, ids, gates, experts, cover_tokens=pads_every_token(call))
    return routed_swiglu_experts(x, ids, gates, experts, expert_axis=expert_axis, adapters=adapters or None,
                                 make_lora=make_lora, expert_parallel=mode == "expert_parallel")
