"""Is a refactor of the MoE layer or the conversion methods free of behaviour? Digests of
every converted array of tiny random models (every family the suite builds, every router
kind and method) and of their logits, plus the lowered StableHLO text of the MoE layer's
forward in each dispatch mode, saved once and checked after the change.

    python benchmarks/structure_identity.py --save /tmp/base.json   # before the change
    python benchmarks/structure_identity.py --check /tmp/base.json  # after: exit 1 on a difference

The lowered text is printed without source locations, so `jax.named_scope` names (which
live in the locations) do not count as a difference; the compiled HLO is recorded too, its
debug metadata (op names, source frames) removed, which independent ops traced in another
order leave unchanged. Each layer's parameters are set from their names before it runs, so
its outputs do not depend on the order a constructor draws them in. `--hlo-dir DIR` writes
each lowered text out for a diff; `--only layers` (or `models`) records one half. CPU only,
a few minutes, under 2 GiB.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cmoe_jax.convert import ConvertConfig, convert_model  # noqa: E402
from cmoe_jax.loading import load_model  # noqa: E402
from cmoe_jax.methods.cmoe import MoEPlan  # noqa: E402
from cmoe_jax.methods.conmoe import apply_plans, collect_stats, conmoe_plans  # noqa: E402
from cmoe_jax.methods.expertweaver import WeaveConfig, weave_model  # noqa: E402
from cmoe_jax.methods.hierarchical import convert_moe_model  # noqa: E402
from cmoe_jax.moe import HierMoEFFN, MoEFFN  # noqa: E402
from tests.conftest import tiny_hf_model  # noqa: E402

DENSE = ("llama", "llama3", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text")
SPARSE = ("qwen3_moe", "qwen3_moe_norm", "mixtral", "olmoe", "qwen2_moe")
CALIB = np.random.default_rng(0).integers(0, 96, (4, 32)).astype(np.int32)
TOKENS = np.random.default_rng(5).integers(0, 96, (2, 24)).astype(np.int32)
DISPATCHES = ("auto", "sort", "gather", "dense", "padded")
# Settings a later tree added with a new default, pinned to what the earlier tree did, so a
# base saved before the setting existed checks the same conversions (the down fit: off).
PINNED = {"down_fit": 0.0} if "down_fit" in {f.name for f in dataclasses.fields(ConvertConfig)} else {}


def digest(a) -> str:
    a = np.asarray(a)
    return hashlib.sha256(f"{a.dtype}{a.shape}".encode() + np.ascontiguousarray(a).tobytes()).hexdigest()[:20]


def model_digests(model) -> dict:
    """path -> digest of every array of `model`, and of its logits on `TOKENS`."""
    out = {"/".join(map(str, p)): digest(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    out["<logits>"] = digest(model(jnp.asarray(TOKENS)))
    return out


def load_family(family: str, tmp: pathlib.Path, **kw):
    path = tmp / family
    tiny_hf_model(family, **kw).save_pretrained(path)
    return load_model(str(path), progress=False).model


def conversions(tmp: pathlib.Path) -> dict:
    """name -> digests of each converted tiny model."""
    out = {}
    for family in DENSE:
        dense = load_family(family, tmp, intermediate_size=64)
        moe, _ = convert_model(dense, CALIB, ConvertConfig(plan=MoEPlan.parse("S2A2E8"), k_act=4, **PINNED), progress=False)
        out[f"cmoe/{family}"] = model_digests(moe)
        if family == "llama":
            paper = ConvertConfig(plan=MoEPlan.parse("S1A3E8"), k_act=4, **ConvertConfig.PAPER_ROUTER)
            out["cmoe-paper/llama"] = model_digests(convert_model(dense, CALIB, paper, progress=False)[0])
            hier, _ = convert_moe_model(moe, CALIB, ConvertConfig(plan=MoEPlan(1, 1, 4), k_act=2, router_neurons=2, **PINNED),
                                        progress=False)
            out["hierarchical-of-cmoe/llama"] = model_digests(hier)
        if family in ("llama", "gemma3_text"):
            for sparsity in (0.0, 0.5):
                woven, _ = weave_model(dense, CALIB, np.repeat(np.arange(2), 2),
                                       WeaveConfig(experts=8, sparsity=sparsity), progress=False)
                out[f"expertweaver{sparsity}/{family}"] = model_digests(woven)
    for family in SPARSE:
        model = load_family(family, tmp)
        out[f"source/{family}"] = model_digests(model)
        hier, _ = convert_moe_model(model, CALIB, ConvertConfig(plan=MoEPlan(1, 1, 4), k_act=4, router_neurons=2, **PINNED),
                                    progress=False)
        out[f"hierarchical/{family}"] = model_digests(hier)
        if family in ("olmoe", "qwen2_moe"):
            stats = collect_stats(model, CALIB[:2], progress=False)
            plans, _ = conmoe_plans(model, stats, 0.5, 1, "adaptive")
            out[f"conmoe/{family}"] = model_digests(apply_plans(model, plans))
    return out


LAYERS = {  # name -> (class, keyword arguments)
    **{f"{router}": (MoEFFN, dict(router=router)) for router in ("linear", "cmoe", "topsum")},
    "sum": (MoEFFN, dict(router="sum", top_k=8)),
    "linear-options": (MoEFFN, dict(router="linear", norm_topk_prob=True, router_balance=True,
                                    router_scoring="sigmoid", routed_scaling=2.0, router_jitter=0.1)),
    "cmoe-shared-gated": (MoEFFN, dict(router="cmoe", router_neurons=2, shared_gated=True)),
    "capacity": (MoEFFN, dict(router="linear", capacity_factor=1.0)),
    "prototypes": (MoEFFN, dict(router="cmoe", num_prototypes=5, duplicate_gates="renorm")),
    "hier-linear": (HierMoEFFN, dict(router="linear", sub_experts=4, sub_shared=1, sub_top_k=2)),
    "hier-cmoe": (HierMoEFFN, dict(router="cmoe", router_neurons=2, sub_experts=4, sub_shared=1, sub_top_k=2,
                                   sub_router_neurons=2)),
    "hier-prototypes": (HierMoEFFN, dict(router="cmoe", sub_experts=4, sub_shared=1, sub_top_k=2,
                                         num_prototypes=5)),
}


def set_by_name(layer) -> None:
    """Every parameter of `layer` drawn from a key of its path (not its construction order)."""
    for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        seed = int(hashlib.sha256("/".join(map(str, path)).encode()).hexdigest()[:8], 16)
        value = var.get_value()
        var.set_value(0.1 * jax.random.normal(jax.random.key(seed), value.shape, value.dtype))


def compiled_text(lowered) -> str:
    """The compiled HLO without its debug metadata (op names, source frames)."""
    text = re.sub(r", metadata=\{[^}]*\}", "", lowered.compile().as_text())
    text = re.sub(r", stack_frame_id=[0-9]+", "", text)
    text = re.sub(r"^HloModule \S+", "HloModule", text, flags=re.M)
    return "\n".join(line for line in text.splitlines()
                     if not re.match(r"^([0-9]+ |FileNames$|FunctionNames$|FileLocations$|StackFrames$)", line))


def layer_texts(tokens: int) -> dict:
    """name -> lowered StableHLO text (no locations) of each layer's forward on `tokens` tokens."""
    out = {}
    x = jax.random.normal(jax.random.key(1), (tokens, 32), jnp.float32)
    mask = jnp.arange(tokens) % 5 != 3
    for name, (cls, kw) in LAYERS.items():
        for dispatch in DISPATCHES:
            kw = dict(dict(top_k=2), **kw)
            layer = cls(d_model=32, expert_width=16, num_experts=8, shared_width=16, activation="silu",
                        rngs=nnx.Rngs(0), dispatch=dispatch, **kw)
            set_by_name(layer)
            graphdef, state = nnx.split(layer)

            def forward(state, x, mask, key):
                return nnx.merge(graphdef, state)(x, mask=mask, return_load=True, return_router=True, key=key)

            lowered = jax.jit(forward).lower(state, x, mask, jax.random.key(2))
            out[f"{name}/{dispatch}/{tokens}"] = lowered.as_text()
            out[f"{name}/{dispatch}/{tokens}/compiled"] = compiled_text(lowered)
            y = jax.jit(forward)(state, x, mask, jax.random.key(2))
            out[f"{name}/{dispatch}/{tokens}/values"] = [digest(a) for a in jax.tree.leaves(y)]
    return out


def collect(only: str | None = None) -> dict:
    texts, models = {}, {}
    if only != "models":
        for tokens in (1, 24, 300):
            texts.update(layer_texts(tokens))
    if only != "layers":
        with tempfile.TemporaryDirectory() as tmp:
            models = conversions(pathlib.Path(tmp))
    return {"models": models, "layers": texts}


def summary(record: dict) -> dict:
    """The saved form: texts as digests (the texts themselves go to --hlo-dir)."""
    layers = {k: v if isinstance(v, list) else hashlib.sha256(v.encode()).hexdigest()[:20]
              for k, v in record["layers"].items()}
    return {"models": record["models"], "layers": layers}


def differences(base: dict, now: dict) -> list[str]:
    out = []
    for part in ("models", "layers"):
        if not now[part]:  # not recorded this time (--only)
            continue
        for key in sorted(set(base[part]) | set(now[part])):
            if base[part].get(key) != now[part].get(key):
                b, n = base[part].get(key), now[part].get(key)
                if isinstance(b, dict) and isinstance(n, dict):
                    changed = sorted(k for k in set(b) | set(n) if b.get(k) != n.get(k))
                    out.append(f"{part}/{key}: {len(changed)} arrays differ, e.g. {changed[:4]}")
                else:
                    out.append(f"{part}/{key} differs")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", help="write the digests to this JSON file")
    g.add_argument("--check", help="compare with the digests in this JSON file; exit 1 on a difference")
    p.add_argument("--hlo-dir", help="write each lowered text here (for a diff)")
    p.add_argument("--only", choices=["layers", "models"], help="record one half only")
    args = p.parse_args(argv)
    record = collect(args.only)
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        for k, v in record["layers"].items():
            if isinstance(v, str) and not k.endswith("/compiled"):
                pathlib.Path(args.hlo_dir, k.replace("/", "_") + ".mlir").write_text(v)
    now = summary(record)
    arrays = sum(len(v) for v in now["models"].values())
    if args.save:
        pathlib.Path(args.save).write_text(json.dumps(now, indent=1, sort_keys=True))
        print(f"saved {len(now['models'])} models ({arrays} arrays) and {len(now['layers'])} layer records")
        return 0
    diff = differences(json.loads(pathlib.Path(args.check).read_text()), now)
    for line in diff:
        print(line)
    print(f"{len(now['models'])} models ({arrays} arrays), {len(now['layers'])} layer records: "
          f"{'identical' if not diff else f'{len(diff)} differ'}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
