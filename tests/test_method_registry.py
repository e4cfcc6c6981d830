"""The methods registry: the convert and compress parsers take their method-specific flags
from the registered methods, refuse another method's flag with one `error:` line naming the
flag and the method, and a method registered here (the one docs/guides/adding-a-method.md
shows) appears in the parser and runs end to end through the job skeleton."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from cmoe_jax.cli_args import Parser
from cmoe_jax.compress import cli as compress_cli
from cmoe_jax.convert import cli as convert_cli
from cmoe_jax.methods import registry

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "adding-a-method.md"
CLIS = {"convert": convert_cli, "compress": compress_cli}
REQUIRED = {"convert": ["--out", "o"], "compress": ["--model", "m", "--ratio", "0.5", "--out", "o"]}


def own_flags(method, choice) -> list[str]:
    """The destinations `method.add_flags` adds, on a parser of its own."""
    if not method.flags_for(choice):
        return []
    p = Parser("probe", "", "")
    before = {a.dest for a in p._actions}
    method.add_flags(p.add_argument_group("probe"))
    return [a.dest for a in p._actions if a.dest not in before]


@pytest.mark.parametrize("command", ["convert", "compress"])
def test_method_flags_come_from_the_registered_methods(command):
    p = CLIS[command].build_parser()
    expected = {}
    for choice in registry.choices(command):
        flags = [d for m in registry.for_choice(command, choice) for d in own_flags(m, choice)]
        if flags:
            expected[choice] = flags
    assert {c: sorted(d) for c, d in p.method_flags.items()} == {c: sorted(d) for c, d in expected.items()}
    assert [a for a in p._actions if a.dest == "method"][0].choices == registry.choices(command)
    titles = [g.title for g in p._action_groups]
    assert all(registry.group_title(c) in titles for c in expected)


def _foreign_cases():
    cases = []
    for command in ("convert", "compress"):
        p = CLIS[command].build_parser()
        flags = {a.dest: a.option_strings[0] for a in p._actions if a.option_strings}
        for owner, dests in p.method_flags.items():
            for chosen in registry.choices(command):
                if chosen != owner:
                    cases += [(command, chosen, flags[d]) for d in dests]
    return cases


def _value(parser, flag):
    action = next(a for a in parser._actions if flag in a.option_strings)
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(action.choices[0])]
    return ["1"] if action.default is None else [str(action.default)]


@pytest.mark.parametrize("command, chosen, flag", _foreign_cases())
def test_another_methods_flag_is_one_error_line(capsys, command, chosen, flag):
    cli = CLIS[command]
    argv = [*REQUIRED[command], "--method", chosen, flag, *_value(cli.build_parser(), flag)]
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {flag} does not apply to --method {chosen} ("), err


def test_a_methods_own_flags_parse_under_it():
    args = convert_cli.parse_args(["--out", "o", "--method", "expertweaver", "--tau", "0.5"])
    assert args.tau == 0.5
    args = compress_cli.parse_args([*REQUIRED["compress"], "--method", "conmoe", "--scope", "2"])
    assert args.scope == 2


def guide_method():
    """The `Method` that docs/guides/adding-a-method.md defines, from its first code block."""
    block = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)[0]
    namespace: dict = {}
    exec(compile(block, str(GUIDE), "exec"), namespace)
    return namespace["METHOD"]


@pytest.fixture
def toy(monkeypatch):
    method = guide_method()
    monkeypatch.setattr(registry, "METHODS", [*registry.METHODS, method])
    return method


def test_a_registered_method_shows_up_in_the_parser(toy, capsys):
    p = convert_cli.build_parser()
    assert "gatenorm" in registry.choices("convert")
    assert p.method_flags["gatenorm"] == ["norm_order"]
    assert registry.group_title("gatenorm") in [g.title for g in p._action_groups]
    assert convert_cli.parse_args(["--out", "o", "--method", "gatenorm", "--norm-order", "3"]).norm_order == 3
    for argv, message in ((["--norm-order", "3"], "--norm-order does not apply to --method cmoe (gate norms flags)"),
                          (["--method", "gatenorm", "--k-act", "4"],
                           "--k-act does not apply to --method gatenorm (it converts nothing)"),
                          (["--method", "gatenorm", "--config", "S1A1E8"], "--config does not apply")):
        with pytest.raises(SystemExit):
            convert_cli.parse_args(["--out", "o", *argv])
        assert message in capsys.readouterr().err


def test_a_registered_method_runs_through_the_job_skeleton(toy, tiny_checkpoint, tmp_path):
    from cmoe_jax.convert import convert
    from cmoe_jax.loading import load_model

    hf, path, _ = tiny_checkpoint
    argv = ["--method", "gatenorm", "--model", str(path), "--norm-order", "1", "--no-progress"]
    assert convert_cli.main([*argv, "--out", str(tmp_path / "n")]) == 0
    manifest = json.loads((tmp_path / "n" / "cmoe_manifest.json").read_text())
    expected = [float(np.abs(layer.mlp.gate_proj.weight.detach().numpy().astype(np.float64)).sum())
                for layer in hf.model.layers]
    assert [r["gate_norm"] for r in manifest["layers"]] == pytest.approx(expected, rel=1e-6)
    assert manifest["method"] == "gatenorm" and set(manifest["seconds"]) == {"save"}
    assert manifest["inputs"]["source_bytes"] > 0  # recorded by the publish, as for every job
    # stopped after one layer, then resumed: the same records, the model unchanged
    settings = toy.settings(order=1)
    stopped = convert(str(path), settings, out=tmp_path / "r", progress=False, stop_after_layers=1)
    assert stopped == {"out": None, "interrupted_after": 1}
    assert len(list((tmp_path / "r.partial" / "layers").glob("*.json"))) == 1
    convert(str(path), settings, out=tmp_path / "r", progress=False, resume=True)
    assert json.loads((tmp_path / "r" / "cmoe_manifest.json").read_text())["layers"] == manifest["layers"]
    a, b = load_model(str(path), progress=False).model, load_model(str(tmp_path / "r"), progress=False).model
    np.testing.assert_array_equal(np.asarray(a.layers[0].mlp.gate[...]), np.asarray(b.layers[0].mlp.gate[...]))
