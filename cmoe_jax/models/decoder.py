"""The decoder shared by every supported family (`cmoe_jax.models.families`).

Each layer exposes its two halves (`attention_block`, `ffn_input`, `ffn`) so the calibration
pass (`cmoe_jax.calibration_pass`) can run a model layer by layer and feed a converted
layer's output to the next one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.models.config import ModelConfig
from cmoe_jax.models.kv_cache import KVCache
from cmoe_jax.models.nll import chunked_nll
from cmoe_jax.models.layers import RMSNorm, _param, rope_tables
from cmoe_jax.models.stack import STACKED, LayerRuns, LayerStack, layered_state, runs_of, stackable
from cmoe_jax.moe.prototypes import tie_prototype_tables
from cmoe_jax.models.decoder_layer import DecoderLayer, LayerOutput  # noqa: F401  (their home before)
from cmoe_jax.models.layer_parts import _layout, _parts, _stack_consuming, _stack_pure


class Decoder(nnx.Module):
    """Causal LM: tokens [B, T] -> logits [B, T, vocab]."""

    # the embedding table stays whole (a gather); the LM head is split over its vocabulary
    LOGICAL_AXES = {"embed": (None, "embed"), "lm_head": ("embed", "vocab")}

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 stack: bool = True):
        """`stack=False` keeps one module per layer even where the layers could be stacked
        (`cmoe_jax.models.stack`): the form checkpoints are read into."""
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.dtype = dtype
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        layers = [DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)]
        if any(s is not None and s.prototype_owner >= 0 for s in cfg.moe_layers):
            tie_prototype_tables(layers, cfg.moe_layers)
        self.layers = self._store(layers) if stack else nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    def _store(self, layers):
        """A LayerStack of `layers` when they can be stacked; else LayerRuns when some
        consecutive ones can (`runs_of`); else an nnx.List."""
        h = jax.ShapeDtypeStruct((1, 2, self.config.hidden_size), self.dtype)
        if stackable(layers, h, self.rope(2)):
            return LayerStack.from_layers(layers)
        runs = runs_of(layers, h, self.rope(2))
        if all(len(run) == 1 for run in runs):
            return nnx.List(layers)
        return LayerRuns([LayerStack.from_layers([layers[i] for i in run]) if len(run) > 1
                          else layers[run[0]] for run in runs])

    @classmethod
    def from_pure(cls, cfg: ModelConfig, pure: dict, dtype) -> "Decoder":
        """The model of config `cfg` holding `pure` (a pure dict with layers per index,
        `nnx.to_pure_dict(layered_state(model))`), its layers stacked where they can be."""
        abstract = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0), stack=False))
        graphdef, state = nnx.split(abstract)
        nnx.replace_by_pure_dict(state, pure)
        return nnx.merge(graphdef, state).stacked()

    def unstacked(self) -> "Decoder":
        """This model with one module per layer (itself when it has that already): a copy
        holding slices of the stacked arrays, for code that changes single layers."""
        if not isinstance(self.layers, (LayerStack, LayerRuns)):
            return self
        abstract = nnx.eval_shape(lambda: Decoder(self.config, dtype=self.dtype,
                                                  rngs=nnx.Rngs(0), stack=False))
        return nnx.merge(nnx.split(abstract)[0], layered_state(self))

    def stacked(self) -> "Decoder":
        """This model with its layers stacked where they can be (itself when they are, or
        cannot be); the layer modules' arrays are copied into the stack."""
        if isinstance(self.layers, (LayerStack, LayerRuns)):
            return self
        layers = self._store(list(self.layers))
        if not isinstance(layers, (LayerStack, LayerRuns)):
            return self
        model = nnx.merge(*nnx.split(self))  # new module objects over the same arrays
        model.layers = layers
        return model

    def with_ffns(self, cfg: ModelConfig, ffns: list) -> "Decoder":
        """A new model of config `cfg` (a conversion's): this model's embeddings, attention
        and norms with `ffns[i]` as layer i's FFN. Consumes `ffns` (the list is emptied):
        each FFN tensor of a stacked part is stacked and its per-layer pieces are dropped one
        tensor at a time; when the new layers are held as this model's are (one stack, or
        runs of the same sizes) this model's arrays are shared, not copied; a stacked model
        whose conversion differs per layer gives runs, stacked run by run; a model with
        listed layers gives one with listed layers (nothing copied)."""
        abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=self.dtype, rngs=nnx.Rngs(0)))
        if _layout(self.layers) is not None and _layout(self.layers) == _layout(abstract.layers):
            pure = nnx.to_pure_dict(nnx.state(self))  # the source's arrays, shared
            for idx, part in _parts(pure["layers"], self.layers):
                mine = [ffns[i] for i in idx]
                for i in idx:
                    ffns[i] = None
                part["mlp"] = _stack_consuming(mine) if len(idx) > 1 else nnx.to_pure_dict(nnx.state(mine[0]))
            ffns.clear()
        else:
            listed = nnx.eval_shape(lambda: Decoder(cfg, dtype=self.dtype, rngs=nnx.Rngs(0),
                                                    stack=False))
            pure = nnx.to_pure_dict(layered_state(self, skip="mlp"))
            for i, ffn in enumerate(ffns):
                pure["layers"][i]["mlp"] = nnx.to_pure_dict(nnx.state(ffn))
            ffns.clear()
            if _layout(self.layers) is not None and isinstance(abstract.layers, LayerRuns):
                per_layer, runs = pure["layers"], {}  # stacked run by run, each slice dropped
                for r, (first, size) in enumerate(zip(abstract.layers.starts(), abstract.layers.sizes())):
                    taken = [per_layer.pop(first + j) for j in range(size)]
                    runs[r] = taken[0] if size == 1 else {STACKED: _stack_pure(taken)}
                pure["layers"] = {"runs": runs}
            else:  # stacking listed layers would copy every one of them: they stay listed
                abstract = listed
        graphdef, target = nnx.split(abstract)
        nnx.replace_by_pure_dict(target, pure)
        return nnx.merge(graphdef, target)

    def set_layer(self, i: int, layer: nnx.Module) -> None:
        """Replace decoder layer `i`, whether the layers are stacked or listed. A layer of the
        stack's structure is written into the stack; any other one turns the stack into a
        list of layers first (the model then runs unrolled)."""
        if isinstance(self.layers, (LayerStack, LayerRuns)):
            try:
                self.layers.set(i, layer)
                return
            except ValueError:
                self.layers = nnx.List(list(self.unstacked().layers))
        self.layers[i] = layer

    def rope(self, seq_len: int, positions: jax.Array | None = None):
        """The RoPE tables ((cos, sin),) for positions 0..seq_len-1, or for explicit
        `positions` [B, T]; with a second base for the sliding layers (Gemma 3) a second
        pair, ((cos, sin), (cos_local, sin_local))."""
        cfg = self.config
        pos = jnp.arange(seq_len) if positions is None else positions
        kinds = (False, True) if cfg.rope_local_theta else (False,)
        return tuple(rope_tables(cfg, pos, local) for local in kinds)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The token embeddings, times the family's scale (Gemma: sqrt(d), in the dtype)."""
        h = jnp.take(self.embed[...], tokens, axis=0)
        scale = self.config.embed_scale
        return h if scale == 1.0 else h * jnp.asarray(scale, jnp.float32).astype(h.dtype)

    def unembed(self, h: jax.Array) -> jax.Array:
        """Final norm and LM head; tied, it reads the embedding in place (`.T` copied it)."""
        if self.config.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", self.norm(h), self.embed[...])
        return self.norm(h) @ self.lm_head[...]

    def lm_head_matrix(self) -> jax.Array:
        """[d, vocab]: the LM head, or the transposed embedding when they are tied."""
        return self.embed[...].T if self.config.tie_word_embeddings else self.lm_head[...]

    def run_layers(self, tokens: jax.Array, *, key=None, remat: bool = False, capture: bool = False,
                   positions: jax.Array | None = None, segments: jax.Array | None = None):
        """(residual stream after the last layer, every layer's FFN input when `capture`
        else [], expert loads `{layer: int32 [E]}` of the MoE layers): the one forward
        behind evaluation, conversion and training. Stacked layers run as one `lax.scan`
        (`LayerStack.scan`: the whole stack, or each of `LayerRuns`' runs), layers of their own
        one after another; the results are the same.

        `key`: dropout key of the LoRA adapters (layer i uses `fold_in(key, i)`; None: no
        dropout). `remat`: recompute each layer in the backward pass instead of storing its
        activations (training memory). `positions`/`segments` [B, T]: explicit RoPE positions
        and prefix-shared packing (`causal_attention`); None: 0..T-1, one sequence a row.
        """
        rope = self.rope(tokens.shape[-1], positions)
        h = self.embed_tokens(tokens)
        inputs, loads = [], {}
        for first, run in self._runs():
            if isinstance(run, LayerStack):
                keys = None if key is None else jax.vmap(lambda i: jax.random.fold_in(key, i))(
                    first + jnp.arange(len(run)))
                h, captured, run_loads = run.scan(h, rope, keys=keys, segments=segments, remat=remat,
                                                  capture=capture)
                inputs += [captured[j] for j in range(len(run))] if capture else []
                if run_loads is not None:
                    loads.update({str(first + j): run_loads[j] for j in range(len(run))})
                continue
            k = None if key is None else jax.random.fold_in(key, first)
            if remat:
                graphdef, state = nnx.split(run)
                out = jax.checkpoint(
                    lambda st, h, k, g=graphdef: nnx.merge(g, st)(h, rope, k, segments))(state, h, k)
            else:
                out = run(h, rope, k, segments)
            h = out.h
            if capture:
                inputs.append(out.ffn_input)
            if out.load is not None:
                loads[str(first)] = out.load
        return h, inputs, loads

    def _runs(self) -> list[tuple[int, nnx.Module]]:
        """(index of its first layer, a LayerStack or one layer) for each part of the layers
        that runs as one: the whole stack, each of LayerRuns' runs, or each listed layer."""
        layers = self.layers
        if isinstance(layers, LayerStack):
            return [(0, layers)]
        if isinstance(layers, LayerRuns):
            return list(zip(layers.starts(), layers.runs))
        return list(enumerate(layers))

    def run_cached(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, slot):
        """(residual stream [B, T, d], the cache with the step written): the forward of
        `run_layers` for T new tokens at cache slots `slot...` and RoPE `positions [B, T]`,
        attending over the cache (`cache.valid` must already mark the new slots). The cache is
        this model's layout (`empty_cache`, the one its layers run fastest with) or one
        `[L, ...]` array."""
        rope = self.rope(tokens.shape[-1], positions)
        h = self.embed_tokens(tokens)
        slot = jnp.asarray(slot, jnp.int32)
        runs = self._runs()
        if cache.per_layer and len(cache.k) != len(runs):
            raise ValueError(f"a cache of {len(cache.k)} arrays for layers that run in {len(runs)} "
                             "parts: make it with this model's empty_cache")
        news = []  # per run: its step's keys and values, or its arrays with them written in
        for r, (first, run) in enumerate(runs):
            if isinstance(run, LayerStack):
                h, kv, _ = run.scan(h, rope, cache=cache.run(r, first, len(run)), slot=slot)
            else:
                out = run(h, rope, cache=cache.layer(r if cache.per_layer else first, slot))
                h, kv = out.h, out.kv if cache.per_layer else tuple(x[None] for x in out.kv)
            news.append(kv)
        k_new, v_new = ([kv[j] for kv in news] for j in (0, 1))
        if not cache.per_layer:  # one [L, ...] array: the runs' [n, ...] parts in order
            k_new, v_new = (x[0] if len(x) == 1 else jnp.concatenate(x) for x in (k_new, v_new))
        return h, cache.write(k_new, v_new, slot)

    def empty_cache(self, batch: int, length: int, dtype=None) -> KVCache:
        """An empty KV cache of `length` slots for `batch` rows: one `[L, ...]` array a
        scanned stack slices; with LayerRuns one `[n, ...]` array a run and one array a
        layer of its own; one array a layer for listed layers (`KVCache`)."""
        dtype = getattr(self, "dtype", jnp.float32) if dtype is None else dtype
        layers = self.layers
        runs = (None if isinstance(layers, LayerStack) else
                layers.sizes() if isinstance(layers, LayerRuns) else (1,) * len(layers))
        return KVCache.empty(self.config, batch, length, dtype, runs=runs)

    def hidden_states(self, tokens: jax.Array, positions=None, segments=None) -> jax.Array:
        """Residual stream after the last layer (before the final norm)."""
        return self.run_layers(tokens, positions=positions, segments=segments)[0]

    def token_nll(self, tokens: jax.Array, chunk: int = 128) -> jax.Array:
        """Per-token negative log-likelihood of tokens[:, 1:] given the prefix, [B, T-1], fp32.

        The LM head and log-softmax run over chunks of positions, so the [B, T, vocab]
        logits are never materialised (at T=2048 and a 49k vocabulary that is 400 MB a
        sequence, and the chunked form is ~25% faster on CPU).
        """
        h = self.norm(self.hidden_states(tokens))[:, :-1]
        return chunked_nll(h, tokens[:, 1:], self.lm_head_matrix(), chunk)

    def __call__(self, tokens: jax.Array, *, capture_ffn_inputs: bool = False):
        """Logits; with `capture_ffn_inputs=True` also the list of every layer's FFN input.

        The flag is a Python bool, so the plain forward traces without any capture.
        """
        h, captured, _ = self.run_layers(tokens, capture=capture_ffn_inputs)
        logits = self.unembed(h)
        return (logits, captured) if capture_ffn_inputs else logits
