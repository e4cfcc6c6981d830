"""The demo's per-row option syntax (the README table's rows are written in it), and that a row
converts exactly as `cmoe-jax convert` with the same flags does."""
import pytest

from cmoe_jax.convert import cli as convert_cli
from cmoe_jax.demo import DEFAULT_CONFIGS, parse_args, parse_config, row_job
from cmoe_jax.methods.cmoe import MoEPlan


def test_parse_config_options():
    assert parse_config("S1A1E8") == ("S1A1E8", ["--config", "S1A1E8"])
    assert parse_config("S3A3E8:energy") == ("S3A3E8", ["--config", "S3A3E8", "--shared-by", "energy"])
    assert parse_config("S1A1E8:paper") == ("S1A1E8", ["--config", "S1A1E8", "--paper-router"])
    assert parse_config("S3A3E8:rate:reps=energy:r=8:fit=16384") == (
        "S3A3E8", ["--config", "S3A3E8", "--shared-by", "rate", "--router-reps", "energy",
                   "--router-neurons", "8", "--router-fit-tokens", "16384"])


@pytest.mark.parametrize("spec, message", [("S1A1E8:fast", "unknown option 'fast'"),
                                           ("S1A1E8:r=eight", "not a valid int"),
                                           ("S1A1E8:depth=2", "unknown option")])
def test_parse_config_rejects_unknown_options(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_config(spec)


def test_default_rows_parse():
    for spec in DEFAULT_CONFIGS.split(","):
        name, _ = parse_config(spec)
        MoEPlan.parse(name)


def test_bad_row_fails_before_any_work(capsys):
    """A bad plan in the last row stops the demo before the dense model is even loaded."""
    from cmoe_jax.demo import main

    assert main(["--configs", "S1A1E8,S1A1E8:reps=energy,SxA1E8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "SxA1E8" in err[0]


def test_bad_row_value_is_one_line(capsys):
    """A value the convert command refuses (0 router neurons) is refused by the demo up front."""
    from cmoe_jax.demo import main

    assert main(["--configs", "S1A1E8:reps=centroid:r=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--router-neurons" in err[0]


@pytest.mark.parametrize("row, cli_flags", [
    ("S3A3E8:energy", ["--config", "S3A3E8", "--shared-by", "energy"]),
    ("S2A2E16", ["--config", "S2A2E16"]),
    ("S1A1E8", ["--config", "S1A1E8"]),
    ("S1A1E8:paper", ["--config", "S1A1E8", "--paper-router"]),
])
def test_demo_row_is_the_readme_convert_command(row, cli_flags):
    """The README's table is made by the demo, its quick start by `cmoe-jax convert` with the
    command's defaults: both must describe the same conversion (settings and calibration)."""
    demo_args = parse_args(["--configs", row, "--seed", "0"])
    (_, _, flags), = demo_args.rows
    valid = "data/wiki.valid.raw"
    cli = convert_cli.settings_from_args(convert_cli.parse_args(
        ["--model", "smollm2", *cli_flags, "--data-path", valid, "--out", "out/x"]))
    assert row_job(flags, demo_args, valid) == cli


def test_demo_and_cli_convert_the_same_arrays(tiny_checkpoint, tmp_path):
    """End to end on a tiny model: the demo's job and the CLI's give bit-equal converted arrays."""
    import jax
    import numpy as np
    from flax import nnx

    from cmoe_jax.convert import convert
    from cmoe_jax.loading import load_model

    _, path, text = tiny_checkpoint
    argv = ["--model", str(path), "--configs", "S1A1E4", "--calib-samples", "4", "--seqlen", "32"]
    demo_args = parse_args(argv)
    (_, _, flags), = demo_args.rows
    convert(str(path), row_job(flags, demo_args, str(text)), out=tmp_path / "demo", progress=False)
    assert convert_cli.main(["--model", str(path), "--config", "S1A1E4", "--data-path", str(text),
                             "--calib-samples", "4", "--seqlen", "32", "--out",
                             str(tmp_path / "cli"), "--no-progress"]) == 0
    leaves_a, leaves_b = (jax.tree.leaves(nnx.state(load_model(str(tmp_path / d), progress=False).model))
                          for d in ("demo", "cli"))
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
