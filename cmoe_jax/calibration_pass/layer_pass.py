"""The calibration pass: calibration windows through the model one decoder layer at a time.

Every method (CMoE, hierarchical CMoE, ExpertWeaver, ConMoE's statistics) is a callback of
`layer_pass`: it sees each layer's FFN input, returns the FFN that carries the stream on
(a converted one, or the layer's own), and the pass runs it. So each layer is profiled on
the activations the already-converted layers before it produce (as in the papers), and
only one layer's activations live at a time.

The batch [N, T, d] is sharded over the "data" axis of a mesh; parameters are replicated
(or split over an "expert" axis). Each step is a pure function of (graphdef, state,
activations), compiled once per distinct layer structure.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmoe_jax import distributed
from cmoe_jax.errors import CmoeError
from cmoe_jax.models.nll import chunked_nll
from cmoe_jax.moe import MoELayer
from cmoe_jax.sharding import ShardingError, batch_axes, make_mesh, place_state, shardings_of


class NonFiniteActivations(CmoeError):
    """NaN or inf reached a layer's FFN input during a calibration pass."""


def calibration_mesh(num_windows: int, devices=None, expert: int = 1) -> Mesh:
    """A ("data"[, "expert"]) mesh over the most local devices whose data x expert count
    divides the batch; `expert > 1` splits the converted layers' routed experts over that
    many devices (expert parallelism, `cmoe_jax.moe.expert_parallel`)."""
    devices = list(jax.local_devices() if devices is None else devices)
    if expert < 1 or len(devices) % expert:
        raise ShardingError(f"--expert-parallel {expert} must divide the {len(devices)} local devices")
    if num_windows % expert:
        raise ShardingError(f"--calib-samples {num_windows} must be a multiple of "
                            f"--expert-parallel {expert} (the batch is split over the expert axis too)")
    n = max(d for d in range(1, len(devices) // expert + 1) if num_windows % (d * expert) == 0)
    return make_mesh(n, expert=expert, devices=devices)


def shard_batch(x, mesh: Mesh):
    return jax.device_put(x, NamedSharding(mesh, P(batch_axes(mesh))))


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, P()))


def window_chunks(x):
    """x [N, T, ...] (sharded over the batch) in slices of one window per device holding it,
    in order: what a method computes wide intermediates on (an FFN's [tokens, d_h]), so they
    live for a few windows at a time rather than for the whole calibration batch."""
    n = x.shape[0]
    step = len(x.sharding.device_set) if isinstance(x, jax.Array) else n
    step = step if n % step == 0 else n
    for start in range(0, n, step):
        yield x[start:start + step]


@functools.partial(jax.jit, static_argnums=0)
def embed_step(graphdef, state, tokens):
    return nnx.merge(graphdef, state).embed_tokens(tokens)


@functools.partial(jax.jit, static_argnums=0)
def attention_step(graphdef, state, h, rope):
    """Residual stream after attention, the FFN input (post-attention RMSNorm) and whether
    that input is all finite (checked in the same pass rather than a second sweep over it)."""
    layer = nnx.merge(graphdef, state)
    h_mid = layer.attention_block(h, rope)
    x = layer.ffn_input(h_mid)
    return h_mid, x, jnp.isfinite(x).all()


@functools.partial(jax.jit, static_argnums=(0, 4))
def ffn_residual_step(graphdef, state, h_mid, x, norm_graphdef=None, norm_state=None):
    """h_mid + FFN(x) for a (converted) FFN module, plus its per-expert load if it has one.

    With a norm (`DecoderLayer.ffn_out`: Gemma's post-feed-forward RMSNorm) the FFN's output
    is normed before the add, as the layer's own forward does; without it every later
    layer of a sandwich-norm model would be profiled on a stream the model never produces."""
    ffn = nnx.merge(graphdef, state)
    if isinstance(ffn, MoELayer):
        y, load = ffn(x, return_load=True)
    else:
        y, load = ffn(x), jnp.zeros((0,), jnp.int32)
    return _add_output(h_mid, y, norm_graphdef, norm_state), load


@functools.partial(jax.jit, static_argnums=2)
def output_residual_step(h_mid, y, norm_graphdef=None, norm_state=None):
    """h_mid + y for an FFN output y already made (`ffn_residual_step` without the FFN)."""
    return _add_output(h_mid, y.astype(h_mid.dtype), norm_graphdef, norm_state)


def _add_output(h_mid, y, norm_graphdef, norm_state):
    """The residual add of an FFN's output y, normed first where the layer norms it."""
    if norm_graphdef is not None:
        y = nnx.merge(norm_graphdef, norm_state)(y)
    return h_mid + y



@functools.partial(jax.jit, static_argnums=0)
def _nll_sums(graphdef, state, h, tokens):
    model = nnx.merge(graphdef, state)
    nll = chunked_nll(model.norm(h[:, :-1]), tokens[:, 1:], model.lm_head_matrix())
    return nll.astype(jnp.float32).sum(), nll.size


def stream_nll(model, h, tokens, mesh: Mesh) -> float:
    """Mean next-token NLL of `tokens [N, T]` from the stream `h` after the last layer
    (what `layer_pass` returns), through `model`'s final norm and LM head; all processes."""
    graphdef, state = nnx.split(model)
    total, count = _nll_sums(graphdef, replicate(state, mesh), h, shard_batch(tokens, mesh))
    total, count = distributed.sum_across_processes((np.float64(total), np.int64(count)))
    return float(total / count)


def start_pass(model, tokens, mesh: Mesh):
    """(residual stream after the embedding [N, T, d], RoPE tables) on `mesh`: the start of a
    layer-by-layer pass over the calibration windows `tokens [N, T]`."""
    graphdef, state = nnx.split(model)
    h = embed_step(graphdef, replicate(state, mesh), shard_batch(tokens, mesh))
    return h, replicate(model.rope(tokens.shape[1]), mesh)


@dataclasses.dataclass
class LayerInput:
    """What the pass hands a method at decoder layer `index`: the layer and its FFN input.

    The pass holds the layer only through this object, so a method that sets `layer` to
    None frees it (a streamed conversion drops the dense FFN before saving its output)."""

    index: int
    layer: nnx.Module | None
    ffn_input: jax.Array | None  # [N, T, d] sharded over the batch; None once the FFN ran
    seconds: float  # the attention half of the layer
    ffn: nnx.Module | None = None  # what `on_layer` returned
    residual: jax.Array | None = None  # the stream after attention, h_mid [N, T, d]
    out_norm: nnx.Module | None = None  # the norm on the FFN's output (`DecoderLayer.ffn_out`)
    output: tuple | None = None  # (ffn, stream after the layer, load) of `run`

    def stream_after(self, ffn: nnx.Module, mesh: Mesh) -> jax.Array:
        """The residual stream after this layer were `ffn` its FFN (a method trying shapes)."""
        return run_ffn(ffn, self.residual, self.ffn_input, mesh, self.out_norm)[0]

    def stream_with_output(self, output, mesh: Mesh) -> jax.Array:
        """`stream_after` for an FFN whose output on the FFN input, `output` [N, T, d], a
        method has already (the dense FFN's, made by a fit as its target)."""
        norm = (None, None) if self.out_norm is None else _split_replicated(self.out_norm, mesh)
        with jax.set_mesh(mesh):
            return output_residual_step(self.residual, shard_batch(output, mesh), *norm)

    def run(self, ffn: nnx.Module, mesh: Mesh) -> jax.Array:
        """`stream_after(ffn)` for the FFN the method is about to return, kept: the pass
        carries this stream on instead of running `ffn` a second time (a converted layer's
        forward over the calibration batch costs about as much as the dense one's), so
        `ffn` must not change after."""
        self.output = (ffn, *run_ffn(ffn, self.residual, self.ffn_input, mesh, self.out_norm))
        return self.output[1]


def _ffn_input(layer, index: int, h, rope, mesh: Mesh):
    """(residual after attention, FFN input, seconds) of decoder layer `index`; non-finite
    FFN inputs stop the pass (on every process) with one clear error."""
    t0 = time.perf_counter()
    lg, ls = nnx.split(layer)
    h_mid, x, finite = attention_step(lg, replicate(ls, mesh), h, rope)
    failed = None if finite else NonFiniteActivations(
        f"layer {index}: NaN or inf in the FFN input activations; check the weights and use "
        "float32 for conversion")
    distributed.all_ok(failed)  # a failure on any process stops them all
    return h_mid, x, time.perf_counter() - t0


# A dense FFN's activations over the whole calibration batch above this many bytes are made
# a few windows at a time (Qwen2.5-1.5B, 8 x 2048 tokens: 0.6 GB each; SmolLM2: 0.1 GB). Its
# rows come out the same either way at the windows' 2048 tokens; an MoE layer's dispatch
# groups the batch's tokens, so it always runs on all of them at once.
DENSE_CHUNK_BYTES = 256 * 2**20


def _wide_dense(ffn, x) -> bool:
    up = None if isinstance(ffn, MoELayer) else getattr(ffn, "up", None)
    return up is not None and x.shape[0] * x.shape[1] * up.shape[-1] * 4 > DENSE_CHUNK_BYTES


def run_ffn(ffn, h_mid, x, mesh: Mesh, out_norm: nnx.Module | None = None):
    """(h_mid + ffn(x), per-expert load), ffn's output normed by `out_norm` first if given
    (`DecoderLayer.ffn_out`); the FFN's variables placed by the sharding rules (an "expert"
    axis in `mesh` makes an MoE FFN run expert-parallel). A dense FFN whose [tokens, d_h]
    intermediates over the batch would pass `DENSE_CHUNK_BYTES` runs a few windows at a time
    (`window_chunks`)."""
    fg, fs = nnx.split(ffn)
    if "expert" in mesh.axis_names and isinstance(ffn, MoELayer):  # routed experts split over it
        fs = place_state(fs, shardings_of(ffn, mesh))
    else:  # a dense FFN, or a mesh that splits only the batch: every device holds it whole
        fs = replicate(fs, mesh)
    norm = (None, None) if out_norm is None else _split_replicated(out_norm, mesh)
    chunks = zip(window_chunks(h_mid), window_chunks(x)) if _wide_dense(ffn, x) else [(h_mid, x)]
    outs, load = [], None
    with jax.set_mesh(mesh):
        for h_part, x_part in chunks:
            out, part = ffn_residual_step(fg, fs, h_part, x_part, *norm)
            outs.append(out)
            load = part if load is None else load + part
        return (outs[0] if len(outs) == 1 else jnp.concatenate(outs)), load


def _split_replicated(module: nnx.Module, mesh: Mesh) -> tuple:
    """(graphdef, state on every device of `mesh`) of a small module (a norm)."""
    graphdef, state = nnx.split(module)
    return graphdef, replicate(state, mesh)


def layer_pass(layers: Collection[nnx.Module], h, rope, mesh: Mesh,
               on_layer: Callable[[LayerInput], nnx.Module], *,
               after_layer: Callable[[LayerInput, np.ndarray], None] | None = None,
               desc: str = "calibration pass", progress: bool = True):
    """Run the stream `h` (from `start_pass`) through `layers` in order -> h after the last.

    At each layer `on_layer(inputs)` returns the FFN that carries the stream on (a
    converted module, or `inputs.layer.mlp` to leave it as it is); the pass runs it and
    calls `after_layer(inputs, load)` with its per-expert token counts (summed over
    processes; empty for a dense FFN). `layers` may read each layer only when the stream
    reaches it (a sized iterable, as in a streamed conversion): no layer is referenced here
    once its step is over, nor while the next one is read."""
    total = len(layers)
    source = iter(layers)
    with tqdm(total=total, desc=desc, disable=not progress) as bar:
        for index in range(total):
            layer = next(source)
            h_mid, x, seconds = _ffn_input(layer, index, h, rope, mesh)
            out_norm = layer.ffn_out()  # kept: `on_layer` may free the layer
            inputs = LayerInput(index, layer, x, seconds, residual=h_mid, out_norm=out_norm)
            del layer, x
            inputs.ffn = on_layer(inputs)
            if inputs.output is not None and inputs.output[0] is inputs.ffn:  # `LayerInput.run`
                h, load = inputs.output[1:]
            else:
                h, load = run_ffn(inputs.ffn, h_mid, inputs.ffn_input, mesh, out_norm)
            inputs.ffn_input = inputs.residual = inputs.output = h_mid = None
            if after_layer is not None:
                load = np.asarray(load)
                after_layer(inputs, distributed.sum_across_processes(load).astype(load.dtype))
            del inputs
            bar.update()
    return h


class LayerStep:
    """Base of a conversion method's step: `__call__(inputs)` (the subclass) returns the
    new FFN and appends the layer's record to `records`; `finish` adds the layer's expert
    load and hands newly computed layers (not resumed ones) to `on_layer` for saving."""

    def __init__(self, done=(), on_layer: Callable[[int, object], None] | None = None):
        self.done, self.on_layer = list(done), on_layer
        self.records: list = []
        self._t_forward = 0.0

    def set_load(self, record, load: np.ndarray, seconds: float) -> None:
        record.load = load
        record.seconds["route_and_forward"] = seconds

    def finish(self, inputs: LayerInput, load: np.ndarray) -> None:
        record = self.records[inputs.index]
        self.set_load(record, load, time.perf_counter() - self._t_forward)
        if inputs.index >= len(self.done) and self.on_layer is not None:
            self.on_layer(inputs.index, record)


def converted_ffns(layers, h, rope, mesh: Mesh, step: LayerStep, *, desc: str,
                   progress: bool = True) -> list:
    """The layer pass with a method's `step`: every FFN it returned, in layer order."""
    ffns = []

    def finish(inputs, load):
        ffns.append(inputs.ffn)
        step.finish(inputs, load)

    layer_pass(layers, h, rope, mesh, step, after_layer=finish, desc=desc, progress=progress)
    return ffns
