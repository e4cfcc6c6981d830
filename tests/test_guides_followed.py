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


def section(guide: str, title: str) -> str:
    """The part of `guide` under heading `title`, up to the next heading of its level."""
    text = (GUIDES / guide).read_text()
    start = text.index(title)
    following = text.find("\n## ", start + len(title))
    return text[start:] if following < 0 else text[start:following]


def _edits(text: str, fence: str) -> list[tuple[str, str]]:
    """(file the sentence before a block names, the block) for each `fence` block of `text`."""
    found = re.findall(r"^In `(cmoe_jax/[\w/]+\.py)`(?:[^\n]|\n(?!\n))*\n\n^```" + fence + r"\n(.*?)^```",
                       text, flags=re.S | re.M)
    return [(path, block) for path, block in found]


def _replace_node(path: Path, block: str, pick) -> None:
    """`path` with the lines of the first AST node `pick` accepts replaced by `block`."""
    import ast

    text = path.read_text()
    node = next(n for n in ast.walk(ast.parse(text)) if pick(n))
    lines = text.splitlines(keepends=True)
    path.write_text("".join(lines[:node.lineno - 1]) + block + "".join(lines[node.end_lineno:]))


def _changed(copy: Path) -> set[str]:
    return {p.relative_to(copy.parent).as_posix() for p in copy.rglob("*.py")
            if p.read_bytes() != (ROOT / p.relative_to(copy.parent)).read_bytes()} | \
        {p.relative_to(ROOT).as_posix() for p in (ROOT / "cmoe_jax").rglob("*.py")
         if "__pycache__" not in p.parts and not (copy.parent / p.relative_to(ROOT)).exists()}


def test_a_layer_option_added_as_the_guide_says_is_at_most_four_files(scratch):
    """docs/guides/moe-layer.md's "Adding a layer option": its table names at most four
    files, and its example (a second capacity policy, `capacity_order`) applied to a copy of
    the package changes only files of the table, not the hierarchical layer, which still
    takes the option: both layers drop other pairs in token order than in slot order."""
    import ast

    text = section("moe-layer.md", "## Adding a layer option")
    table = re.findall(r"^\| `(cmoe_jax/[\w/]+\.py)`", text, flags=re.M)
    assert 1 <= len(table) <= 4, table
    edits = dict(_edits(text, "py"))
    assert set(edits) == {"cmoe_jax/moe/spec.py", "cmoe_jax/moe/moe_layer.py", "cmoe_jax/moe/token_pairs.py"}, edits
    spec = scratch / "moe" / "spec.py"
    anchor = "    capacity_factor: float = jax_only(0.0)\n"
    assert anchor in spec.read_text() and "after `capacity_factor` in `FFNSpec`" in text
    spec.write_text(spec.read_text().replace(anchor, anchor + edits["cmoe_jax/moe/spec.py"], 1))
    _replace_node(scratch / "moe" / "moe_layer.py", edits["cmoe_jax/moe/moe_layer.py"],
                  lambda n: isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                  and getattr(n.value.func, "id", None) == "kept_pairs")
    _replace_node(scratch / "moe" / "token_pairs.py", edits["cmoe_jax/moe/token_pairs.py"],
                  lambda n: isinstance(n, ast.FunctionDef) and n.name == "kept_pairs")
    changed = _changed(scratch)
    assert changed == set(edits) and changed <= set(table), changed
    assert "cmoe_jax/moe/hierarchical.py" not in changed
    for check in (test_structure.test_imports_flow_downwards, test_structure.test_no_import_circle,
                  test_structure.test_the_busiest_packages_are_shallow, test_structure.test_modules_stay_small,
                  test_structure.test_functions_stay_small, test_structure.test_classes_stay_small):
        check()
    env = dict(os.environ, PYTHONPATH=str(scratch.parent), JAX_PLATFORMS="cpu")
    script = '''
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from cmoe_jax.moe import HierMoEFFN, MoEFFN
from cmoe_jax.moe.spec import FFNSpec, has_torch_form
from cmoe_jax.moe.token_pairs import kept_pairs
ids = jnp.array([[0, 1], [1, 0]])  # capacity 1 pair per expert at factor 0.5
assert kept_pairs(ids, 2, None, 0.5).tolist() == [[True, False], [True, False]]
assert kept_pairs(ids, 2, None, 0.5, order="token").tolist() == [[True, True], [False, False]]
assert not has_torch_form({f.name: f for f in dataclasses.fields(FFNSpec)}["capacity_order"])
x = jax.random.normal(jax.random.key(0), (2, 16, 16))
for cls, extra in ((MoEFFN, {}), (HierMoEFFN, dict(router="cmoe", sub_experts=4, sub_shared=1, sub_top_k=2))):
    def build(**kw):
        return cls(d_model=16, expert_width=4, num_experts=4, top_k=2, capacity_factor=0.5,
                   activation="silu", rngs=nnx.Rngs(0), **extra, **kw)
    default, slot, token = (np.asarray(build(**kw)(x)) for kw in ({}, {"capacity_order": "slot"},
                                                                    {"capacity_order": "token"}))
    np.testing.assert_array_equal(default, slot)
    assert np.isfinite(token).all() and not np.allclose(slot, token), cls.__name__
print("option ok")
'''
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=scratch.parent)
    assert out.returncode == 0 and "option ok" in out.stdout, out.stderr[-3000:]


def test_a_family_added_as_the_guide_says_reads_its_config(scratch):
    """docs/guides/adding-a-family.md's example: Phi-3 removed from a copy of the package
    (its unit, registry line and remote class), then added back with the guide's three blocks
    in the three files it names; the rules hold, and the copy reads a Phi-3 config as the
    package does and has its remote class."""
    import json

    import transformers

    from cmoe_jax.models.config import ModelConfig

    text = section("adding-a-family.md", "## Example: Phi-3")
    edits = dict(_edits(text, "python"))
    unit, registry, remote = (scratch / "models" / "families" / "phi3.py", scratch / "models" / "families" / "__init__.py",
                              scratch / "export" / "hf_remote" / "modeling_cmoe.py")
    assert set(edits) == {f"cmoe_jax/{p.relative_to(scratch).as_posix()}" for p in (unit, registry, remote)}, edits
    # Phi-3 out of the copy
    unit.unlink()
    import_line = "from cmoe_jax.models.families.phi3 import PHI3\n"
    assert edits[f"cmoe_jax/{registry.relative_to(scratch).as_posix()}"] == import_line
    registry.write_text(registry.read_text().replace(import_line, "").replace("PHI3, ", ""))
    entry = edits[f"cmoe_jax/{remote.relative_to(scratch).as_posix()}"]
    remote.write_text(remote.read_text().replace(entry, "").replace("Phi3Config, Phi3ForCausalLM, ", ""))
    assert "phi3" not in registry.read_text().lower() and "Phi3" not in remote.read_text()
    # and back in, as the guide says
    unit.write_text(edits[f"cmoe_jax/{unit.relative_to(scratch).as_posix()}"])
    text_r = registry.read_text()
    last = text_r.rindex("from cmoe_jax.models.families.")
    last = text_r.index("\n", last) + 1
    tuple_end = text_r.index(")}", text_r.index("FAMILIES: dict[str, Family]"))
    registry.write_text(text_r[:last] + import_line + text_r[last:tuple_end] + ", PHI3" + text_r[tuple_end:])
    text_t = remote.read_text()
    text_t = text_t.replace("from transformers import (", "from transformers import (Phi3Config, Phi3ForCausalLM, ", 1)
    families_end = text_t.index("))\n", text_t.index("_FAMILIES = (")) + 1  # after the last entry
    remote.write_text(text_t[:families_end] + ",\n" + entry.rstrip("\n").rstrip(",") + text_t[families_end:])
    assert _changed(scratch) <= set(edits), _changed(scratch)  # the unit may come back byte for byte
    for check in (test_structure.test_every_part_has_a_layer, test_structure.test_imports_flow_downwards,
                  test_structure.test_no_import_circle, test_structure.test_modules_stay_small,
                  test_structure.test_functions_stay_small):
        check()
    hf = transformers.Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, sliding_window=9,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2).to_dict()
    want = ModelConfig.from_hf(hf).to_dict()
    env = dict(os.environ, PYTHONPATH=str(scratch.parent), JAX_PLATFORMS="cpu")
    script = ("import json, sys\n"
              "from cmoe_jax.models.config import ModelConfig\n"
              "from cmoe_jax.export.hf_remote import modeling_cmoe\n"
              "assert modeling_cmoe.CmoePhi3Config.model_type == 'cmoe_phi3'\n"
              "print(json.dumps(ModelConfig.from_hf(json.loads(sys.stdin.read())).to_dict()))\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, input=json.dumps(hf), capture_output=True,
                         text=True, cwd=scratch.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == json.loads(json.dumps(want))
