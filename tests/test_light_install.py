"""The core install without the optional extras' packages: `datasets` (downloads) and
`matplotlib` (PNG plots) are extras, so every path that needs one either names the extra in
one `error:` line (a download) or says in one `note:` line that it skips (a plot).

Each check runs in a subprocess where `sys.modules[name] = None`, which is what an
environment without the package looks like to Python (`import` raises ImportError and
`importlib.util.find_spec` is None).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, JAX_PLATFORMS="cpu")
NO_DOWNLOADS = "import sys; sys.modules['datasets'] = None; sys.modules['tensorflow_datasets'] = None\n"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


def _one_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr[-3000:]
    return lines[0]


def test_eval_without_data_path_or_datasets_names_the_extra(tiny_checkpoint):
    _, path, _ = tiny_checkpoint
    proc = _run(NO_DOWNLOADS + "from cmoe_jax.eval.cli import main; raise SystemExit(main(sys.argv[1:]))",
                "--model", str(path), "--dataset", "wikitext2", "--seqlen", "8", "--no-progress")
    assert proc.returncode == 2
    line = _one_line(proc, "error:")
    assert "pip install -e '.[datasets]'" in line and "--data-path" in line


def test_demo_without_local_data_or_datasets_stops_before_the_model():
    """No local WikiText-2 and no `datasets`: the demo's first line is the extra to install,
    before it looks at the model (a model that does not exist is never reached)."""
    script = (NO_DOWNLOADS + "import cmoe_jax.demo as demo\ndemo.local_wikitext = lambda: None\n"
              "raise SystemExit(demo.main(sys.argv[1:]))")
    proc = _run(script, "--model", str(ROOT / "no-such-model"), "--configs", "S1A1E8", "--windows", "1")
    assert proc.returncode == 2
    assert "pip install -e '.[datasets]'" in _one_line(proc, "error:")


def test_plots_without_matplotlib_are_skipped_with_one_note(tmp_path):
    """The loss plot and a conversion report without matplotlib: one `note:` line per kind of
    plot naming the extra, no PNG, and the JSON outputs still written."""
    script = "import sys; sys.modules['matplotlib'] = None\n" + r"""
from pathlib import Path
from types import SimpleNamespace
import numpy as np
from cmoe_jax.methods.cmoe.report import write_report
from cmoe_jax.train.report import plot_loss, write_log

out = Path(sys.argv[1])
steps = [{"step": i, "loss": 3.0 - 0.1 * i} for i in range(12)]
for _ in range(2):
    plot_loss(out / "loss.png", steps)
write_log(out / "train_log.json", {"steps": 12}, steps)
record = SimpleNamespace(mu=np.full(8, 0.5), load=np.ones(2), error=None, seconds=0.0,
                         carving=SimpleNamespace(shared_idx=np.arange(2), iterations=1))
write_report([record], "S1A1E2", {}, out / "report")
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and all(l.startswith("note:") and "'.[plots]'" in l for l in lines), proc.stderr
    assert not list(tmp_path.rglob("*.png"))
    assert json.loads((tmp_path / "train_log.json").read_text())["steps"][0]["loss"] == 3.0
    assert (tmp_path / "report" / "report.json").is_file()
