"""Train a small MoE language model that uses `MoEFFN` inside your own Flax NNX module.

A toy next-token task (each token determines the next: t -> (5 t + 3) mod V), learnt by an
embedding, MoE FFN blocks and a tied read-out. The router is the default "linear" one
(softmax gates: it trains from scratch). Its load is balanced either by the Switch
load-balancing loss from the layer's opt-in router outputs (`--aux`, the default) or without
an auxiliary loss by a balancing bias (`--balance GAMMA`: `router_balance=True`, and after
each step `update_bias` moves each layer's bias towards equal loads). The script asserts that
the loss falls, and prints how far the experts' loads end from uniform.

    python examples/train_moe_lm.py                                  # a few seconds on a CPU
    python examples/train_moe_lm.py --layers 2 --aux 0 --balance 1e-3
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cmoe_jax.moe import MoEFFN


class TinyMoELM(nnx.Module):
    """Embedding -> n x (RMSNorm -> MoE FFN, residual) -> RMSNorm -> tied read-out."""

    def __init__(self, vocab: int, d: int, layers: int, balance: bool, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.norms = nnx.List([nnx.RMSNorm(d, rngs=rngs) for _ in range(layers + 1)])
        # 8 experts of width 32, 2 active per token, one always-on shared MLP of width 32
        self.moes = nnx.List([MoEFFN(d_model=d, expert_width=32, num_experts=8, top_k=2, shared_width=32,
                                     router_balance=balance, activation="silu", rngs=rngs,
                                     kernel_init=nnx.initializers.lecun_normal()) for _ in range(layers)])

    def __call__(self, tokens):
        h = self.embed(tokens)                                  # [B, T, d]
        routers = []
        for norm, moe in zip(self.norms, self.moes):
            y, router = moe(norm(h), return_router=True)
            h, routers = h + y, routers + [router]
        return self.embed.attend(self.norms[-1](h)), routers    # logits [B, T, V]


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
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--aux", type=float, default=1e-2, help="Switch load-balancing loss weight")
    parser.add_argument("--balance", type=float, default=0.0, help="balancing-bias step gamma (0: none)")
    args = parser.parse_args(argv)
    model = TinyMoELM(args.vocab, 64, args.layers, args.balance > 0, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            logits, routers = model(x)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            aux = sum(args.aux * r.aux_loss + 1e-3 * r.z_loss for r in routers)
            return ce + aux, (ce, jnp.stack([r.load for r in routers]))

        (_, (ce, loads)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return ce, loads

    key, losses, loads = jax.random.PRNGKey(1), [], []
    for step in range(args.steps):
        key, sub = jax.random.split(key)
        ce, load = train_step(model, optimizer, *batch(sub, args.vocab, 16, 32))
        if args.balance > 0:  # aux-loss-free balancing: each layer's bias, from its own load
            for moe, counts in zip(model.moes, load):
                moe.update_bias(counts, args.balance)
        losses.append(float(ce))
        loads.append(np.asarray(load, np.float64))
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  cross-entropy {losses[-1]:.3f}  expert load {load[-1].tolist()}")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    recent = np.mean(loads[-20:], axis=0)                       # [layers, E]
    spread = np.abs(recent / recent.mean(-1, keepdims=True) - 1).max(-1)
    print(f"cross-entropy {first:.3f} -> {last:.3f}")
    print("load spread, last 20 steps (max |load / mean - 1| per layer): "
          + ", ".join(f"{100 * s:.0f}%" for s in spread))
    assert last < 0.5 * first, f"the loss did not fall: {first:.3f} -> {last:.3f}"


if __name__ == "__main__":
    main()
