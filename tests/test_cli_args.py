"""The command lines' shared behaviour, at parse level (nothing runs): one-line errors with
exit 2, values that make no sense refused, method-specific flags refused under another
method, aliases equal to the flag they stand for, defaults and an example in every help."""
from __future__ import annotations

import contextlib
import importlib
import io

import pytest

from cmoe_jax.commands import COMMANDS, main as cmoe_jax

PARSERS = {name: module for name, (module, _) in COMMANDS.items()
           if name not in ("generate", "lmeval")}
REQUIRED = {"convert": ["--out", "o"], "eval": [], "demo": [],
            "train": ["--model", "m", "--out", "o"], "export": ["--model", "m", "--out", "o"],
            "compress": ["--model", "m", "--method", "conmoe", "--ratio", "0.5", "--out", "o"],
            "downcycle": ["--data-path", "t.txt", "--out", "o"]}


def parse(name, *argv):
    return importlib.import_module(PARSERS[name]).parse_args([*REQUIRED[name], *argv])


def one_line_error(capsys, name, *argv) -> str:
    """Parse and expect exit 2 with exactly one `error:` line naming the help command."""
    with pytest.raises(SystemExit) as e:
        parse(name, *argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("name, argv, message", [
    ("convert", ["--seqlen", "0"], "--seqlen must be"),
    ("convert", ["--router-neurons", "0"], "--router-neurons must be at least 1"),
    ("convert", ["--calib-samples", "-3"], "--calib-samples must be at least 1"),
    ("convert", ["--sparsity", "1.5", "--method", "expertweaver"], "--sparsity must be"),
    ("eval", ["--max-windows", "0"], "--max-windows must be at least 1"),
    ("eval", ["--seqlen", "1"], "--seqlen must be at least 2"),
    ("eval", ["--batch-size", "-1"], "--batch-size must be at least 1"),
    ("train", ["--lr", "0"], "--lr must be above 0"),
    ("train", ["--samples", "0"], "--samples must be at least 1"),
    ("train", ["--dropout", "1"], "--dropout must be below 1"),
    ("compress", ["--ratio", "1"], "--ratio must be"),
    ("export", ["--max-shard-mb", "0"], "--max-shard-mb must be above 0"),
    ("downcycle", ["--steps", "0"], "--steps must be at least 1"),
    ("demo", ["--windows", "0"], "--max-windows must be at least 1"),
    ("eval", ["--seqlen", "many"], "'many' is not an integer"),
    ("eval", ["--no-such-flag"], "unrecognized arguments"),
])
def test_meaningless_values_are_one_line_errors(capsys, name, argv, message):
    line = one_line_error(capsys, name, *argv)
    assert message in line and f"(see python -m cmoe_jax.{name} --help)" in line


def test_zero_is_kept_where_it_means_something():
    assert parse("export", "--calib-samples", "0").calib_samples == 0
    assert parse("compress", "--ratio", "0").ratio == 0.0
    assert parse("convert", "--method", "expertweaver", "--sparsity", "0").sparsity == 0.0
    assert parse("convert", "--shared", "0").shared == 0


@pytest.mark.parametrize("name, argv, message", [
    ("convert", ["--method", "expertweaver", "--k-act", "10"], "--k-act does not apply to --method expertweaver"),
    ("convert", ["--method", "expertweaver", "--config", "S1A1E8"], "--config does not apply"),
    ("convert", ["--method", "expertweaver", "--calib", "wikitext2"], "--dataset does not apply"),
    ("convert", ["--sparsity", "0.25"], "--sparsity does not apply to --method cmoe"),
    ("convert", ["--tau", "0.6", "--arc-path", "a.jsonl"], "--tau, --arc-path do not apply"),
    ("compress", ["--method", "reap", "--scope", "1"], "--scope does not apply to --method reap"),
    ("eval", ["--task", "arc_easy", "--max-windows", "4"], "--max-windows does not apply to --task"),
    ("eval", ["--limit", "4"], "--limit does not apply without --task"),
])
def test_a_flag_of_another_method_is_refused_even_at_its_default(capsys, name, argv, message):
    assert message in one_line_error(capsys, name, *argv)


def test_method_flags_are_accepted_under_their_method():
    args = parse("convert", "--method", "expertweaver", "--sparsity", "0.5", "--tau", "0.7")
    assert (args.sparsity, args.tau, args.experts, args.seqlen) == (0.5, 0.7, None, None)
    args = parse("convert", "--config", "S1A1E8", "--router-neurons", "1", "--seqlen", "512")
    assert (args.router_neurons, args.seqlen, args.sparsity) == (1, 512, 0.25)


@pytest.mark.parametrize("name, old, new, value", [
    ("convert", "--calib", "--dataset", "c4"),
    ("convert", "--calib-split", "--split", "train"),
    ("compress", "--calib", "--dataset", "c4"),
    ("export", "--calib-split", "--split", "test"),
    ("eval", "--json", "--out", "r.json"),
    ("eval", "--output-path", "--out", "r.json"),
    ("eval", "--tasks", "--task", "arc_easy"),
    ("eval", "--windows", "--max-windows", "7"),
    ("demo", "--windows", "--max-windows", "7"),
    ("demo", "--json", "--out", "t.json"),
])
def test_aliases_equal_the_shared_flag(name, old, new, value):
    a, b = vars(parse(name, old, value)), vars(parse(name, new, value))
    a.pop("given"), b.pop("given")
    assert a == b


def _help(name) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as e:
        importlib.import_module(PARSERS[name]).build_parser(f"cmoe-jax {name}").parse_args(["--help"])
    assert e.value.code == 0
    return buf.getvalue()


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_shows_defaults_an_example_and_help_for_every_flag(name):
    text = _help(name)
    assert "example:\n  cmoe-jax " + name in text
    parser = importlib.import_module(PARSERS[name]).build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        assert action.help, f"{name}: {action.option_strings} has no help"
        if action.default not in (None, False, "==SUPPRESS==") and not action.required:
            shown = formatter._get_help_string(action) % {"default": action.default}
            assert f"(default: {action.default})" in shown, f"{name}: {action.option_strings[0]}: {shown}"


def test_shared_flags_read_the_same_in_every_command():
    """--data-path, --seed and --no-progress: one definition, one help text."""
    helps = {}
    for name in PARSERS:
        for action in importlib.import_module(PARSERS[name]).build_parser()._actions:
            if action.option_strings[:1] in (["--data-path"], ["--seed"], ["--no-progress"]):
                helps.setdefault(action.option_strings[0], set()).add(action.help)
    assert set(helps) == {"--data-path", "--seed", "--no-progress"}
    assert all(len(texts) == 1 for texts in helps.values()), helps


def test_console_command_lists_and_dispatches(capsys):
    assert cmoe_jax(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("convert", "eval", "train", "compress", "export", "downcycle", "demo"):
        assert f"\n  {name} " in out
    assert cmoe_jax(["convert", "--seqlen", "0", "--out", "o"]) == 2
    assert capsys.readouterr().err.strip().endswith("(see cmoe-jax convert --help)")
    assert cmoe_jax(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_unwritable_outputs_fail_before_work(tmp_path, capsys):
    from cmoe_jax.eval.cli import main as eval_main

    assert eval_main(["--out", str(tmp_path / "missing" / "r.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert eval_main(["--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    from cmoe_jax.convert.cli import main as convert_main

    (tmp_path / "file").write_text("x")
    assert convert_main(["--config", "S1A1E8", "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_demo_with_a_missing_model_is_one_line(capsys):
    from cmoe_jax.demo import main as demo_main

    assert demo_main(["--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "/nonexistent" in err[0]


def test_lmeval_takes_a_model_path_or_a_backend_name():
    """`--model PATH` as in every command; lm-eval's backend names and spellings still work."""
    pytest.importorskip("lm_eval")
    from cmoe_jax.eval.lmeval import parse_args

    ours = parse_args(["--model", "out/s3a3e8", "--task", "arc_easy", "--output-path", "r.json"])
    theirs = parse_args(["--model", "cmoe_jax", "--model_args", "pretrained=out/s3a3e8",
                         "--tasks", "arc_easy", "--output_path", "r.json"])
    for args in (ours, theirs):
        assert (args.model, args.model_args, args.tasks, args.output_path) == (
            "cmoe_jax", {"pretrained": "out/s3a3e8"}, ["arc_easy"], "r.json")
    hf = parse_args(["--backend", "hf", "--model_args", "pretrained=gpt2", "--tasks", "arc_easy"])
    assert (hf.model, hf.model_args) == ("hf", {"pretrained": "gpt2"})
    assert parse_args(["--model", "hf", "--tasks", "arc_easy"]).model == "hf"


def test_an_error_inside_a_progress_bar_starts_its_own_line(capsys):
    """A job that fails with a bar on screen (a full disk during training) still prints one
    clean `error:` line: the bar is ended first."""
    from tqdm.auto import tqdm

    from cmoe_jax.errors import CmoeError, run_job

    bars = []  # the bar outlives the error, as a training loop's does

    def job(_):
        bars.append(tqdm(total=4, desc="training"))
        bars[-1].update(1)
        raise CmoeError("the disk is full")

    assert run_job(job, None) == (None, 2)
    err = capsys.readouterr().err
    assert "error: the disk is full" in err.splitlines(), err
