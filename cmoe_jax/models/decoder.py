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
from cmoe_jax.models import decoder_layout, decoder_runs
from cmoe_jax.models.stack import LayerRuns, LayerStack, layered_state
from cmoe_jax.moe.prototypes import tie_prototype_tables
from cmoe_jax.models.decoder_layer import DecoderLayer, LayerOutput  # noqa: F401  (their home before)


class Decoder(nnx.Module):
    """Causal LM: tokens [B, T] -> logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 stack: bool = True):
        """`stack=False` keeps one module per layer even where the layers could be stacked
        (`cmoe_jax.models.stack`): the form checkpoints are read into."""
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.dtype = dtype
        # the embedding table stays whole (a gather); the LM head is split over its vocabulary
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, (None, "embed"))
        layers = [DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)]
        if any(s is not None and s.prototype_owner >= 0 for s in cfg.moe_layers):
            tie_prototype_tables(layers, cfg.moe_layers)
        self.layers = self._store(layers) if stack else nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype, ("embed", "vocab"))

    def _store(self, layers):
        return decoder_layout.store_layers(self, layers)

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
        """A new model of config `cfg`: this model's embeddings, attention and norms with
        `ffns[i]` as layer i's FFN, sharing this model's arrays where the layouts allow
        (`decoder_layout.with_ffns`; consumes `ffns`)."""
        return decoder_layout.with_ffns(self, cfg, ffns)

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
        behind evaluation, conversion and training (`decoder_runs.run_layers`)."""
        return decoder_runs.run_layers(self, tokens, key=key, remat=remat, capture=capture,
                                       positions=positions, segments=segments)

    def run_cached(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, slot):
        """(residual stream [B, T, d], the cache with the step written): T new tokens at cache
        slots `slot...` and RoPE `positions [B, T]` (`decoder_runs.run_cached`)."""
        return decoder_runs.run_cached(self, tokens, positions, cache, slot)

    def empty_cache(self, batch: int, length: int, dtype=None) -> KVCache:
        """An empty KV cache of `length` slots for `batch` rows, in this model's layout."""
        return decoder_runs.empty_cache(self, batch, length, dtype)

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
