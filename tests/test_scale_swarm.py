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
    # each daemon counts at the stage it serves at the end (balancing may have moved one)
    assert sum(s["size"] for s in run["stages"]) == DAEMONS
    for s in run["stages"]:
        assert s["size"] == DAEMONS // 2 + len(s["moved_in"]) - sum(
            len(o["moved_in"]) for o in run["stages"] if o is not s)
        assert s["rounds_led"] >= 1 and s["rounds_failed"] == 0
        assert s["mean_group"] > 1  # averaged with mates, not alone
        # outside the kill (until the restarted daemon is at its stage's step again), every
        # round's leader had every live mate in its group (sync.rounds_short)
        assert s["rounds_short_outside_kills"] == 0, {
            k: s[k] for k in ("stage", "left_out", "answers_late", "rounds_short", "rounds_led",
                              "steps")}


@pytest.mark.timeout(600)
def test_every_part_steps_once_per_target_batch(run: dict[str, Any]) -> None:
    """The trainers split each step's microbatches (``swarmd.trainer.shares``) and average
    their parts' gradients; a stage steps once per target batch (``averaging.
    target_batch_size``), so its steps are the target batches the trainers sent together,
    through the kill too (a round that failed is flushed by the trainers), and steps are
    exact (before: 8 stage steps for 12 target batches here, none exact)."""
    expected = run["expected_stage_steps"]
    seen = {"trainers": run["trainers"], "stages": [
        {k: s[k] for k in ("steps", "samples_per_step", "target_samples")}
        for s in run["stages"]]}
    assert STEPS <= expected <= TRAINERS * STEPS, seen
    # no target batch is merged into another's stage step (before: 8 stage steps for 12
    # target batches, none exact); a step that was not exact (a trainer starting or stopping
    # in the middle of another's step, a round the kill broke, a round late under load) is
    # flushed: at most one stage step more for each
    not_exact = sum(STEPS - t["steps_exact"] for t in run["trainers"])
    for s in run["stages"]:
        assert expected - 2 <= max(s["steps"]) <= expected + not_exact, seen
    for t in run["trainers"]:
        assert t["trainer_rounds"] >= 1, seen
