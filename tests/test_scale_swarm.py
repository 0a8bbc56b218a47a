"""A live swarm of 12 daemons (2 stages x 6) and 2 trainers, one daemon SIGKILLed and
restarted with its home mid-run: tools/bench_scale.py's run (issue 28), small enough for CI.

One run is shared by the tests (module scope): they only read its report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_scale  # noqa: E402

pytestmark = pytest.mark.integration

DAEMONS, TRAINERS, STEPS, KILLS = 12, 2, 6, 1


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return bench_scale.run_swarm(DAEMONS, TRAINERS, STEPS, KILLS, seed=0,
                                 root=tmp_path_factory.mktemp("scale"))


@pytest.mark.timeout(600)  # the shared run: 12 daemon starts and two trainers, on a loaded machine
def test_nothing_is_lost_and_every_trainer_takes_its_steps_through_a_kill(
        run: dict[str, Any]) -> None:
    assert len(run["killed"]) == KILLS  # the kill really happened, and its restart
    assert run["lost"] == 0
    assert [t["steps_taken"] for t in run["trainers"]] == [STEPS] * TRAINERS
    assert all(t["final_val_loss"] < t["initial_val_loss"] for t in run["trainers"])


@pytest.mark.timeout(600)
def test_membership_converges_before_training_and_after_the_restart(
        run: dict[str, Any]) -> None:
    m = run["membership"]
    # run_swarm waits (with a deadline) for every view to list all daemons before training;
    # at the end, with the restarted daemon back, they must agree again
    assert m["converge_s"] >= 0 and m["converged_at_end_s"] is not None
    assert len(m["rejoin_s"]) == KILLS


@pytest.mark.timeout(600)
def test_every_stage_averages_in_rounds_that_include_its_live_mates(
        run: dict[str, Any]) -> None:
    for s in run["stages"]:
        assert s["size"] == DAEMONS // 2
        assert s["rounds_led"] >= 1 and s["rounds_failed"] == 0
        assert s["mean_group"] > 1  # averaged with mates, not alone
        # outside the kill (until the restarted daemon is at its stage's step again), every
        # round's leader had every live mate in its group (sync.rounds_short)
        assert s["rounds_short_outside_kills"] == 0, s


@pytest.mark.timeout(600)
def test_no_stage_steps_more_often_than_its_samples_allow(run: dict[str, Any]) -> None:
    """A stage steps once its peers hold ``averaging.target_batch_size`` samples, one
    trainer step's: never more steps than the trainers took together."""
    expected = run["expected_stage_steps"]
    assert expected == TRAINERS * STEPS
    for s in run["stages"]:
        assert all(1 <= step <= expected for step in s["steps"]), s


@pytest.mark.timeout(600)
@pytest.mark.xfail(strict=True, reason=(
    "a stage steps once per averaging.target_batch_size samples (one trainer step's), so 2 "
    "trainers x 6 steps promise 12 steps of each stage; measured 2026-12-04: 8 and 8 here; "
    "24 daemons, 2 x 30 trainer steps: 35 and 36 (4 daemons: 40 and 38); 12 daemons, 2 x 20: "
    "24 and 19, with 53 and 67 samples per stage step against the target's 32. Samples that "
    "reach a stage while its round runs are carried into its next round, which then steps "
    "once on more than one trainer step's samples; docs/pipeline.md: with several trainers "
    "steps are not exact, and nothing makes a stage step once per trainer step"))
def test_each_stage_takes_one_step_per_trainer_step(run: dict[str, Any]) -> None:
    for s in run["stages"]:
        assert all(step == run["expected_stage_steps"] for step in s["steps"]), s
