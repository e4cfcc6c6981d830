"""`export`: a cmoe_jax model (converted, fine-tuned, or any checkpoint it loads) written as a
Hugging Face directory: sharded safetensors, `config.json`, the tokenizer, and for carved MoE
layers the remote code `modeling_cmoe.py`.

Written into `OUT.partial/` one shard at a time (finished shards are recorded, so `--resume`
skips them) and renamed to `OUT` at the end. With torch installed, the exported directory is
then loaded with transformers and its logits on the verification windows compared to ours.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from cmoe_jax.checkpoint import publish, staging_dir, write_json_atomic
from cmoe_jax.errors import CmoeError
from cmoe_jax.export.hf_config import REMOTE_CODE, ExportError, hf_config, keeps_original_architecture

EXPORT_MANIFEST = "cmoe_export.json"
FORMATS = ("hf",)


def _shard_plan(cfg, state, max_shard_bytes: int) -> list[list[tuple]]:
    """Parameter paths grouped into shards of at most `max_shard_bytes` (one big tensor alone)."""
    from flax import nnx

    shards, current, size = [], [], 0
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        nbytes = int(np.prod(value.shape)) * np.dtype(value.dtype).itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(tuple(path))
        size += nbytes
    return shards + [current] if current else shards


def _write_shard(cfg, values: dict, paths, file: Path) -> dict:
    """Write one safetensors shard; returns {tensor name: file name}."""
    from safetensors.numpy import save_file

    from cmoe_jax.export.hf_weights import hf_tensors

    tensors = {}
    for path in paths:
        for name, array in hf_tensors(cfg, path, np.asarray(values[path], np.float32)):
            tensors[name] = np.ascontiguousarray(array)
    tmp = file.with_name(file.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(file)
    return {name: file.name for name in tensors}


def export(model: str, *, out, fmt: str = "hf", calib: str = "wikitext2",
           calib_split: str = "validation", data_path: str | None = None, calib_samples: int = 2,
           seqlen: int = 512, seed: int = 0, max_shard_mb: float = 2048, overwrite: bool = False,
           resume: bool = False, progress: bool = True, stop_after_shards: int | None = None) -> dict:
    """Export `model` to `out` in `fmt`; returns the export record (also `out/cmoe_export.json`).

    `calib*`, `seqlen`, `seed`: the windows the exported model is checked on against ours
    (`calib_samples=0`: no check). `stop_after_shards` exists for testing interruption.
    """
    from flax import nnx
    from tqdm.auto import tqdm

    from cmoe_jax.loading import load_config, load_model
    from cmoe_jax.models.stack import layered_state

    t0 = time.perf_counter()
    out = Path(out)
    if fmt not in FORMATS:
        raise CmoeError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if out.exists() and not overwrite:
        raise CmoeError(f"output directory {out} exists: pass --overwrite to replace it")
    if max_shard_mb <= 0 or calib_samples < 0 or seqlen < 2:
        raise CmoeError("--max-shard-mb must be positive, --calib-samples >= 0 and --seqlen >= 2")
    cfg, _ = load_config(model)
    config_json = hf_config(cfg)  # a model the format cannot hold fails here, before any work
    windows = None
    if calib_samples:
        from cmoe_jax.export.verify import verification_windows

        windows = verification_windows(model, calib, calib_split, data_path, calib_samples, seqlen, seed)
    settings = {"model": str(model), "format": fmt, "max_shard_mb": max_shard_mb}
    staging = staging_dir(out)
    done = _resume_state(staging, settings, resume)
    write_json_atomic(staging / "progress.json", {"settings": settings, "shards": done})

    lm = load_model(model, progress=progress)
    state = layered_state(lm.model)  # tensors per layer, as Hugging Face names them
    values = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state)}
    plan = _shard_plan(cfg, state, int(max_shard_mb * 2**20))
    weight_map: dict[str, str] = {}
    for k, paths in enumerate(tqdm(plan, desc="writing shards", disable=not progress)):
        file = staging / f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
        if file.name in done and file.exists():
            from safetensors import safe_open

            with safe_open(str(file), "np") as f:
                weight_map.update({name: file.name for name in f.keys()})
            continue
        weight_map.update(_write_shard(cfg, values, paths, file))
        done[file.name] = True
        write_json_atomic(staging / "progress.json", {"settings": settings, "shards": done})
        if stop_after_shards is not None and len(done) >= stop_after_shards:
            return {"out": None, "interrupted_after": len(done)}
    if len(plan) == 1:
        (staging / next(iter(done))).replace(staging / "model.safetensors")
    else:
        total = sum(int(np.prod(v.shape)) * 4 for v in values.values())
        write_json_atomic(staging / "model.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json_atomic(staging / "config.json", config_json)
    if not keeps_original_architecture(cfg):
        shutil.copy(Path(__file__).parent / "hf_remote" / REMOTE_CODE, staging / REMOTE_CODE)
    if lm.tokenizer is not None:
        lm.tokenizer.hf.save_pretrained(str(staging))
    (staging / "progress.json").unlink()
    record = {"source_model": str(model), "format": fmt, "architecture": config_json["architectures"][0],
              "remote_code": not keeps_original_architecture(cfg), "shards": len(plan),
              "tensors": len(weight_map)}
    if windows is not None:
        from cmoe_jax.export.verify import compare_with_transformers

        record["verification"] = compare_with_transformers(lm.model, staging, windows)
    record["seconds"] = time.perf_counter() - t0
    write_json_atomic(staging / EXPORT_MANIFEST, record)
    publish(staging, out, overwrite)
    return dict(record, out=str(out))


def _resume_state(staging: Path, settings: dict, resume: bool) -> dict:
    """Shards finished by an interrupted export with the same settings (only with resume)."""
    progress = staging / "progress.json"
    if resume and progress.exists():
        saved = json.loads(progress.read_text())
        if saved["settings"] != settings:
            raise CmoeError(f"--resume: {staging} was started with other settings; rerun "
                            "without --resume to start over")
        return dict(saved["shards"])
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return {}


__all__ = ["export", "ExportError", "EXPORT_MANIFEST"]
