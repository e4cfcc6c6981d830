"""The "adding a ..." guides followed literally in a scratch copy of the package: the files
a guide says to write are written from its code blocks, and the package's structure rules
(tests/test_structure.py) and its registry accept the result, so a guide cannot drift from
the code it describes."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_structure

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"


def blocks(guide: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (GUIDES / guide).read_text(), flags=re.S | re.M)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A copy of the package the structure rules read instead of the real one."""
    copy = tmp_path / "cmoe_jax"
    shutil.copytree(ROOT / "cmoe_jax", copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(test_structure, "PACKAGE", copy)
    monkeypatch.setattr(test_structure, "METHODS", copy / "methods")
    return copy


def test_a_method_added_as_the_guide_says_passes_the_structure_rules(scratch):
    method, registration = blocks("adding-a-method.md")[:2]
    folder = scratch / "methods" / "gatenorm"
    folder.mkdir()
    (folder / "__init__.py").write_text(method)
    registry = scratch / "methods" / "registry.py"
    text = registry.read_text()
    start = text.index("from cmoe_jax.methods import")
    end = text.index("]\n", text.index("METHODS: list[Method] = [")) + 2
    registry.write_text(text[:start] + registration + text[end:])
    for check in (test_structure.test_every_part_has_a_layer, test_structure.test_imports_flow_downwards,
                  test_structure.test_no_import_circle, test_structure.test_modules_stay_small,
                  test_structure.test_a_method_is_entered_through_its_package,
                  test_structure.test_the_layer_pass_is_written_once, test_structure.test_functions_stay_small):
        check()
    env = dict(os.environ, PYTHONPATH=str(scratch.parent), JAX_PLATFORMS="cpu")
    script = ("from cmoe_jax.methods import registry\n"
              "assert registry.choices('convert')[-1] == 'gatenorm', registry.choices('convert')\n"
              "assert registry.primary('convert', 'gatenorm').title == 'gate norms'\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=scratch.parent)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_router_added_as_the_guide_says_is_two_files(scratch):
    """The router guide's unit as a module of `cmoe_jax/moe/routers/` and its one registry
    line: the rules still hold and the kind is found by name."""
    unit = blocks("adding-a-router.md")[0]
    unit = unit.replace("from cmoe_jax.moe.routers import Router, RouterParam, register_router",
                        "from cmoe_jax.moe.routers.base import Router, RouterParam")
    assert "from cmoe_jax.moe.routers.base import" in unit and "register_router(CosineRouter())" in unit
    (scratch / "moe" / "routers" / "cosine.py").write_text(unit.replace("register_router(CosineRouter())", ""))
    registry = scratch / "moe" / "routers" / "__init__.py"
    text = registry.read_text()
    line = "ROUTERS: dict[str, Router] = {r.name: r for r in ("
    anchor = "from cmoe_jax.moe.routers.topsum import"
    assert line in text and anchor in text
    registry.write_text(text.replace(anchor, "from cmoe_jax.moe.routers.cosine import CosineRouter\n" + anchor, 1)
                        .replace(line, line + "CosineRouter(), ", 1))
    for check in (test_structure.test_imports_flow_downwards, test_structure.test_no_import_circle,
                  test_structure.test_the_busiest_packages_are_shallow):
        check()
    env = dict(os.environ, PYTHONPATH=str(scratch.parent), JAX_PLATFORMS="cpu")
    script = ("from cmoe_jax.moe.routers import get_router, ROUTER_KINDS\n"
              "assert get_router('cosine').name == 'cosine' and 'cosine' in ROUTER_KINDS\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=scratch.parent)
    assert out.returncode == 0, out.stderr[-2000:]
