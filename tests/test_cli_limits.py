"""Every numeric flag of every command at and beyond the limits of its type: the parser alone
gives exit 0 or 2 (one `error:` line), never a traceback, and a value it accepts fits what
the flag ends up in (checked here by numpy's own conversions, not by the parser's bounds).
Then the bounds only the model can say (vocabulary, rank, diverging steps), end to end."""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import pytest

from cmoe_jax import cli_args
from cmoe_jax.cli_args import parse_or_code
from cmoe_jax.compress import cli as compress_cli
from cmoe_jax.convert import cli as convert_cli
from cmoe_jax.eval import cli as eval_cli
from cmoe_jax.export import cli as export_cli
from cmoe_jax.generate import cli as generate_cli
from cmoe_jax.train import cli as train_cli
from cmoe_jax.downcycle import cli as downcycle_cli

# the values a probe throws at a numeric flag: type limits, just past them, and non-numbers
LIMITS = ["0", "-1", "1.5", "", "abc", "0x10", "1e23", "1e308", "1e309", "-1e309", "nan", "inf", "-inf",
          "-0.0", "1e-320"] + [str(n + d) for n in (2**31, 2**32, 2**63, 2**64) for d in (-1, 0)] + [
          "100000000000000000000000", "1" + "0" * 400]
# what an accepted value must convert to without overflow: its sink, by the type's meaning
SINKS = {cli_args.step_count: np.int32, cli_args.nonneg_steps: np.int32, cli_args.seed_int: np.uint32}
COMMANDS = {  # name: (module, flags every run needs, one extra flag set per method with its own flags)
    "convert": (convert_cli, ["--out", "o"], "--method"),
    "compress": (compress_cli, ["--model", "m", "--out", "o", "--ratio", "0.5"], "--method"),
    "train": (train_cli, ["--model", "m", "--out", "o"], None),
    "downcycle": (downcycle_cli, ["--data-path", "d", "--out", "o"], None),
    "export": (export_cli, ["--model", "m", "--out", "o"], None),
    "eval": (eval_cli, [], None),
    "generate": (generate_cli, [], None),
}
TABLE_ENV = "CMOE_BAD_INPUT_TABLE"  # scripts/bad_input_table.py counts the refused cases


def _numeric_flags(module):
    return [a for a in module.build_parser().__dict__["_actions"]
            if a.option_strings and callable(a.type) and a.type not in (str, cli_args.out_path)]


def _variants(module, method_flag):
    if method_flag is None:
        return [[]]
    action = next(a for a in module.build_parser().__dict__["_actions"] if method_flag in a.option_strings)
    return [[method_flag, m] for m in action.choices]


def _fits_its_sink(action, value) -> bool:
    """A value the parser let through converts, without overflow, to what the flag feeds."""
    if isinstance(value, tuple):  # a flag read into several fields (`--active`): each field fits
        return all(_fits_its_sink(action, v) for v in value if v is not None)
    if isinstance(value, float):
        big = value * 2**20 if action.type is cli_args.mib_size else value
        return math.isfinite(big) and (action.type is not cli_args.mib_size or big <= np.iinfo(np.int64).max)
    try:
        SINKS.get(action.type, np.int64)(value)
    except OverflowError:
        return False
    return True


@pytest.mark.parametrize("command", COMMANDS)
def test_every_numeric_flag_at_the_type_limits_is_exit_0_or_2(command, capsys):
    module, needed, method_flag = COMMANDS[command]
    refused, tried = [], 0
    for variant in _variants(module, method_flag):
        for action in _numeric_flags(module):
            for text in LIMITS:
                flag = action.option_strings[0]
                args, code = parse_or_code(module.parse_args, [*needed, *variant, flag, text], command)
                err = capsys.readouterr().err.strip().splitlines()
                tried += 1
                if args is None:
                    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (flag, text, err)
                    refused.append((variant, flag, text, err[0]))
                else:
                    assert _fits_its_sink(action, getattr(args, action.dest)), (command, flag, text)
    assert tried and refused
    _record(command, refused)


def _record(command, refused) -> None:
    """The (flag, value) pairs refused with every --method (so bad values, not flags of another
    method), once each, for the docs' count of bad inputs."""
    if os.environ.get(TABLE_ENV):
        by_variant = {}
        for variant, flag, text, _ in refused:
            by_variant.setdefault(tuple(variant), set()).add((flag, text))
        distinct = sorted(set.intersection(*by_variant.values()))
        with open(os.environ[TABLE_ENV], "a") as f:
            f.write(json.dumps({"parser": command, "cases": [list(c) for c in distinct]}) + "\n")


@pytest.mark.parametrize("text, bound", [(str(cli_args.STEP_MAX), True), (str(cli_args.STEP_MAX + 1), False)])
def test_a_step_count_fits_jax_32_bit_step_counter(text, bound):
    """Accepted exactly when numpy's int32 (JAX's step counter) holds it."""
    try:
        value = cli_args.step_count(text)
    except argparse.ArgumentTypeError:
        value = None
    assert (value is not None) == bound
    assert (value is not None) == (int(text) <= np.iinfo(np.int32).max)


def test_a_seed_past_32_bits_is_refused_because_jax_would_repeat_a_smaller_one():
    import jax

    largest = cli_args.seed_int(str(cli_args.SEED_MAX))
    assert not np.array_equal(jax.random.key_data(jax.random.key(largest)),
                              jax.random.key_data(jax.random.key(0)))
    # one past the bound: the same key as seed 0, so accepting it would silently repeat a run
    assert np.array_equal(jax.random.key_data(jax.random.key(cli_args.SEED_MAX + 1)),
                          jax.random.key_data(jax.random.key(0)))
    with pytest.raises(argparse.ArgumentTypeError, match="32 bits"):
        cli_args.seed_int(str(cli_args.SEED_MAX + 1))
