"""Train a small MoE language model that uses `MoEFFN` inside your own Flax NNX module.

A toy next-token task (each token determines the next: t -> (5 t + 3) mod V), learnt by an
embedding, one MoE FFN block and a tied read-out. The router is the default "linear" one
(softmax gates: it trains from scratch) and the Switch load-balancing loss and router z-loss
come from the layer's opt-in router outputs. The script asserts that the loss falls.

    python examples/train_moe_lm.py            # a few seconds on a laptop CPU
"""
import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from cmoe_jax.moe import MoEFFN


class TinyMoELM(nnx.Module):
    """Embedding -> RMSNorm -> MoE FFN (residual) -> RMSNorm -> tied read-out."""

    def __init__(self, vocab: int, d: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.norm1, self.norm2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        # 8 experts of width 32, 2 active per token, one always-on shared MLP of width 32
        self.moe = MoEFFN(d_model=d, expert_width=32, num_experts=8, top_k=2, shared_width=32, activation="silu", rngs=rngs,
                          kernel_init=nnx.initializers.lecun_normal())

    def __call__(self, tokens):
        h = self.embed(tokens)                                  # [B, T, d]
        y, router = self.moe(self.norm1(h), return_router=True)
        h = h + y
        return self.embed.attend(self.norm2(h)), router         # logits [B, T, V]


def batch(key, vocab: int, size: int, length: int):
    start = jax.random.randint(key, (size, 1), 0, vocab)
    steps = [start]
    for _ in range(length):
        steps.append((5 * steps[-1] + 3) % vocab)
    seq = jnp.concatenate(steps, axis=1)
    return seq[:, :-1], seq[:, 1:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--vocab", type=int, default=64)
    args = parser.parse_args(argv)
    model = TinyMoELM(args.vocab, 64, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            logits, router = model(x)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return ce + 1e-2 * router.aux_loss + 1e-3 * router.z_loss, (ce, router.load)

        (_, (ce, load)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return ce, load

    key = jax.random.PRNGKey(1)
    losses = []
    for step in range(args.steps):
        key, sub = jax.random.split(key)
        ce, load = train_step(model, optimizer, *batch(sub, args.vocab, 16, 32))
        losses.append(float(ce))
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  cross-entropy {losses[-1]:.3f}  expert load {load.tolist()}")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"cross-entropy {first:.3f} -> {last:.3f}")
    assert last < 0.5 * first, f"the loss did not fall: {first:.3f} -> {last:.3f}"


if __name__ == "__main__":
    main()
