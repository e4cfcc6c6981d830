"""docs/guides/moe-layer.md runs: its Python blocks, in order in one namespace, on 8
simulated CPU devices (the expert-parallel block needs them; a fresh interpreter, since
XLA's device count is fixed when jax is first imported)."""
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "moe-layer.md"


def test_the_guide_runs():
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 6, len(blocks)
    script = "\n".join(blocks) + "\nprint('guide ok')\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(8))
    warnings_as_errors = ["-W", "error::UserWarning", "-W", "error::DeprecationWarning"]
    out = subprocess.run([sys.executable, *warnings_as_errors, "-c", script],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("guide ok")
