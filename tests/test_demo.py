"""The demo's per-row option syntax (the README table's rows are written in it)."""
import pytest

from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.demo import DEFAULT_CONFIGS, parse_config


def test_parse_config_options():
    assert parse_config("S1A1E8") == ("S1A1E8", {})
    assert parse_config("S3A3E8:energy") == ("S3A3E8", {"shared_by": "energy"})
    assert parse_config("S1A1E8:paper") == (
        "S1A1E8", {"router_neurons": 1, "router_reps": "centroid", "router_scale": False})
    assert parse_config("S3A3E8:rate:reps=energy:r=8:fit=16384") == (
        "S3A3E8", {"shared_by": "rate", "router_reps": "energy", "router_neurons": 8,
                   "router_fit_tokens": 16384})


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
