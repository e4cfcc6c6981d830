"""Jobs killed with SIGKILL at seeded random points never leave a broken output, and resume
to the uninterrupted result; two jobs on one `--out` give one output and one error line.

The runs are children of one fork server (`benchmarks/fault_campaign.py`), killed by the
job layer's `CMOE_FAULT_AT` hook; a larger campaign is `python benchmarks/faults.py`.
"""
from __future__ import annotations

import random

import pytest

from benchmarks.fault_campaign import ForkServer, adversarial, campaign, jobs, make_inputs, race, reference

KILLS = 6
JOBS = ["convert", "convert-stream", "compress", "export", "train", "train-distill", "hierarchical",
        "expertweaver", "downcycle"]
FEWER = {"hierarchical": 3, "expertweaver": 3, "downcycle": 3, "train-distill": 3}  # slower jobs: fewer kills in the suite
MID_WRITE_KILLS = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("faults")
    inputs = make_inputs(work / "inputs")
    with ForkServer(work / "jax-cache") as server:
        specs = jobs(inputs, work / "ref-convert")
        refs = {"convert": reference(server, specs["convert"], work / "ref-convert")}
        yield server, specs, refs, work


def _reference(setup, name):
    server, specs, refs, work = setup
    if name not in refs:
        refs[name] = reference(server, specs[name], work / f"ref-{name}")
    return refs[name]


@pytest.mark.parametrize("name", JOBS)
def test_killed_job_leaves_nothing_broken_and_resumes_identically(setup, name):
    server, specs, _, work = setup
    ref = _reference(setup, name)
    kills = FEWER.get(name, KILLS)
    tally = campaign(server, specs[name], ref, work, kills, seed=JOBS.index(name))
    assert tally.kills == kills and tally.broken == 0, tally.notes
    assert tally.identical == tally.finished >= 1, tally


@pytest.mark.parametrize("name", JOBS)
def test_killed_inside_a_write_a_rename_or_the_cleanup(setup, name):
    """Kills inside a shard or JSON file being written, between the renames of an overwrite,
    and inside the cleanup after publish: nothing broken, nothing left beside the output."""
    server, specs, _, work = setup
    ref = _reference(setup, name)
    tally = campaign(server, specs[name], ref, work, MID_WRITE_KILLS, seed=100 + JOBS.index(name),
                     mid_write=True)
    assert tally.kills == MID_WRITE_KILLS and tally.broken == 0, tally.notes
    assert tally.identical == tally.finished >= 1, tally
    assert not [p.name for p in work.iterdir() if p.name.startswith(f".{name}-out.")]


def test_two_jobs_on_one_output_give_one_output_and_one_error(setup):
    server, specs, refs, work = setup
    rng = random.Random(7)
    offsets = [0.0] + [rng.uniform(0.0, 3.0) for _ in range(5)]
    assert race(server, specs["convert"], refs["convert"], work, offsets) == []


def test_adversarial_round_refuses_and_damages_nothing(setup):
    """The convert job against foreign things at OUT.lock (a plain file, a hard link to a
    user's file, a FIFO), --out inside its source and at its data's directory, its source
    replaced while it runs, and (as root) a full tmpfs: each refused with exit 2 and one line,
    never an exit 0, never a changed foreign path (a job that took over a user's file at
    OUT.lock would fail both)."""
    server, specs, refs, work = setup
    tally = adversarial(server, specs["convert"], work, ref=refs["convert"])
    assert tally.adversarial_cases + len(tally.skipped) == 7, tally
    assert tally.adversarial_cases >= 6, tally.skipped
    assert tally.wrong_data_exits == 0 and tally.damaged_foreign == 0, tally.notes
    assert tally.adversarial_failed == 0, tally.notes
