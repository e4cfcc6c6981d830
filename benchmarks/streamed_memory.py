"""Peak host memory of a streamed CMoE conversion against the model's size, on a synthetic
checkpoint of a real model's layer shapes (`--shape`: Llama-2-7B's d = 4096, d_ff = 11008, 32
heads, vocabulary 32000, or Qwen2.5-1.5B's), random bf16 weights, one safetensors shard per
layer, and equality with the in-memory path.

For each depth in --layers, two conversions run in fresh processes (their peak RSS is their
own): `--stream` (one layer read, converted, written at a time) and the in-memory path
(`load_model(stack=False)` + `convert_model` + save, as the convert job does). The streamed
peak should stay flat as the depth grows while the in-memory one grows with the model; the
two outputs must be bit-identical. `--baseline-tree` runs each conversion with an older tree
too, in turn with this one's, for a before/after of the peaks.

    python benchmarks/streamed_memory.py [--layers 2 4] [--config S1A1E8] [--work DIR]
    python benchmarks/streamed_memory.py --shape qwen2.5-1.5b --layers 2 --config S3A3E8 \
        --samples 8 --seqlen 2048 --modes stream --baseline-tree BASE
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # --shape: the layer shapes of a real model
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
}
GIB = 2**30


def write_checkpoint(directory: Path, layers: int, shape: dict, seed: int = 0) -> int:
    """A Llama checkpoint of `shape` (`SHAPES`) with `layers` decoder layers; returns its bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    directory.mkdir(parents=True)
    d, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = d // shape["num_attention_heads"] * shape["num_key_value_heads"]
    config = dict(shape, model_type="llama", architectures=["LlamaForCausalLM"],
                  num_hidden_layers=layers, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def rand(*shape, scale):
        return (rng.standard_normal(shape, np.float32) * scale).astype(ml_dtypes.bfloat16)

    weight_map = {}

    def shard(name, tensors):
        save_file(tensors, str(directory / name))
        weight_map.update({k: name for k in tensors})

    shard("outer.safetensors", {"model.embed_tokens.weight": rand(v, d, scale=0.02),
                                "model.norm.weight": np.ones(d, ml_dtypes.bfloat16),
                                "lm_head.weight": rand(v, d, scale=0.02)})
    for i in tqdm(range(layers), desc="writing synthetic layers", leave=False):
        p = f"model.layers.{i}."
        shard(f"layer{i:03d}.safetensors", {
            p + "input_layernorm.weight": np.ones(d, ml_dtypes.bfloat16),
            p + "post_attention_layernorm.weight": np.ones(d, ml_dtypes.bfloat16),
            **{p + f"self_attn.{n}.weight": rand(d, d, scale=d ** -0.5) for n in ("q_proj", "o_proj")},
            **{p + f"self_attn.{n}.weight": rand(kv, d, scale=d ** -0.5) for n in ("k_proj", "v_proj")},
            p + "mlp.gate_proj.weight": rand(f, d, scale=d ** -0.5),
            p + "mlp.up_proj.weight": rand(f, d, scale=d ** -0.5),
            p + "mlp.down_proj.weight": rand(d, f, scale=f ** -0.5)})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes. Not `getrusage`'s ru_maxrss: Linux
    carries that across exec from the parent's address space, so a child started by a parent
    that once held a large model would report the parent's peak as its own."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (this benchmark needs Linux)")


def convert_child(source: str, out: str, stream: bool, config: str, samples: int, seqlen: int) -> dict:
    """One conversion in this (fresh) process; its peak RSS and seconds."""
    import jax.numpy as jnp
    import numpy as np

    from cmoe_jax.methods.cmoe import MoEPlan
    from cmoe_jax.checkpoint import PER_LAYER, save_converted, write_manifest
    from cmoe_jax.convert import ConvertConfig, convert_model
    from cmoe_jax.methods.cmoe.job import Streamed, convert_streamed
    from cmoe_jax.loading import load_config, load_model, open_source

    base = peak_rss()
    cfg, _ = load_config(source)
    calib = np.random.default_rng(0).integers(0, cfg.vocab_size, (samples, seqlen)).astype(np.int32)
    cc = ConvertConfig(plan=MoEPlan.parse(config))
    t0 = time.perf_counter()
    if stream:
        cfg_moe, _ = convert_streamed(Streamed(open_source(Path(source)), cfg, Path(out)), calib, cc)
        write_manifest(Path(out), cfg_moe, {"state_layout": PER_LAYER})
    else:
        model = load_model(source, dtype=jnp.float32, stack=False).model  # as the convert job loads
        moe, _ = convert_model(model, calib, cc)
        del model
        save_converted(moe, {}, Path(out))
    return {"seconds": time.perf_counter() - t0, "peak_rss": peak_rss(),
            "rss_after_imports": base}


def why_failed(returncode: int, stderr: str) -> str:
    """A child's end in words: the signal that killed it (SIGKILL with no error of its own is
    almost always the kernel's out-of-memory killer), or its exit status and last error."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (most likely the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}" + (f"; stderr ends:\n{stderr[-2000:]}" if stderr.strip() else "")
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    return f"exit status {returncode}: {lines[-1] if lines else 'no error message'}\n{stderr[-4000:]}"


def state_digest(directory: str) -> list[tuple[str, str]]:
    """(parameter path, sha256 of its float32 bytes) for every parameter of a converted model,
    so two models are compared with only one of them in memory at a time."""
    import hashlib

    import numpy as np
    from flax import nnx

    from cmoe_jax.checkpoint import restore_model

    flat = nnx.to_flat_state(nnx.state(restore_model(Path(directory))))
    return [("/".join(map(str, path)), hashlib.sha256(
        np.ascontiguousarray(np.asarray(v.get_value())).tobytes()).hexdigest()) for path, v in flat]


def same_state(a: str, b: str) -> bool:
    """Every parameter of the two converted models bit-identical."""
    return state_digest(a) == state_digest(b)


def run_child(tree: Path, *args) -> dict:
    proc = subprocess.run([sys.executable, str(tree / "benchmarks/streamed_memory.py"), "--child",
                           *map(str, args)], cwd=tree, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"child failed: {why_failed(proc.returncode, proc.stderr)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        source, out, stream, config, samples, seqlen = sys.argv[2:]
        print(json.dumps(convert_child(source, out, stream == "True", config, int(samples), int(seqlen))))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    p.add_argument("--config", default="S1A1E8")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--modes", nargs="+", choices=["stream", "memory"], default=["stream", "memory"])
    p.add_argument("--baseline-tree", type=Path,
                   help="also convert with this tree (a git worktree of an older commit), each "
                        "side in turn, and print its peaks beside this tree's")
    p.add_argument("--work", help="scratch directory (default: a temporary one, removed after)")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="streamed_memory_"))
    from benchmarks.harness import load_average

    print(f"load average {load_average():.2f} at start ({os.cpu_count()} cores)")
    shape = SHAPES[a.shape]
    d, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = d // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer_f32 = (2 * d * d + 2 * kv * d + 3 * d * f + 2 * d) * 4
    outer_f32 = (2 * v * d + d) * 4
    trees = [("this tree", ROOT)] + ([("baseline", a.baseline_tree.resolve())] if a.baseline_tree else [])
    equal = []
    try:
        for n in a.layers:
            src = work / f"{a.shape}_{n}layers"
            disk = write_checkpoint(src, n, shape)
            print(f"{n} layers: checkpoint {disk / GIB:.2f} GiB bf16, model "
                  f"{(n * layer_f32 + outer_f32) / GIB:.2f} GiB float32 (one layer "
                  f"{layer_f32 / GIB:.2f} GiB)", flush=True)
            for mode in a.modes:
                peaks = {}
                for name, tree in trees:
                    out = work / f"out_{n}_{mode}_{name.replace(' ', '_')}"
                    r = run_child(tree, src, out, mode == "stream", a.config, a.samples, a.seqlen)
                    peaks[name] = r["peak_rss"]
                    print(f"  {mode:6} {name:9}: peak RSS {r['peak_rss'] / GIB:.2f} GiB, "
                          f"{r['seconds']:.0f} s, load average {load_average():.2f}", flush=True)
                if "baseline" in peaks:
                    print(f"  {mode:6} peak, this tree / baseline: "
                          f"{peaks['this tree'] / peaks['baseline']:.2f}x", flush=True)
            if set(a.modes) == {"stream", "memory"}:
                equal.append(same_state(str(work / f"out_{n}_stream_this_tree"),
                                        str(work / f"out_{n}_memory_this_tree")))
                print(f"  streamed and in-memory outputs bit-identical: {equal[-1]}", flush=True)
            shutil.rmtree(src)
            for out in work.glob(f"out_{n}_*"):
                shutil.rmtree(out)
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average {load_average():.2f} at end")
    if not all(equal):
        sys.exit("streamed and in-memory outputs differ")


if __name__ == "__main__":
    main()
