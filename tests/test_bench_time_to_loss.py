"""``tools/bench_time_to_loss.py``'s arithmetic (issue 26): the training time to a loss, read
from a trainer's metrics records, evaluations' own time left out. Pure; no lab."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from bench_time_to_loss import reached, summarise, time_to_loss, tokens_per_s  # noqa: E402


def _run() -> list[dict]:
    """Initial evaluation at t=100 (2 s); steps of 1 s; an evaluation of 5 s after step 2
    and after step 4."""
    return [
        {"step": 0, "val_loss": 5.0, "time": 102.0},
        {"step": 1, "loss": 4.0, "time": 103.0},
        {"step": 2, "loss": 3.5, "time": 104.0},
        {"step": 2, "val_loss": 3.4, "time": 109.0},
        {"step": 3, "loss": 3.2, "time": 110.0},
        {"step": 4, "loss": 3.0, "time": 111.0},
        {"step": 4, "val_loss": 2.9, "time": 116.0},
    ]


def test_the_time_to_a_loss_counts_steps_and_leaves_evaluations_out() -> None:
    r = time_to_loss(_run(), 3.0)
    assert r["steps"] == 4 and r["val_loss_at"] == 2.9
    assert r["time_to_loss_s"] == 4.0  # four 1 s steps; the two evaluations (10 s) left out
    assert time_to_loss(_run(), 3.4)["time_to_loss_s"] == 2.0  # at or under: the first
    assert reached(_run(), 3.0) and not reached(_run(), 2.0)


def test_a_loss_never_reached_says_how_far_the_run_got() -> None:
    r = time_to_loss(_run(), 2.0)
    assert r["time_to_loss_s"] is None and r["steps"] is None
    assert r["train_s"] == 4.0 and r["last_step"] == 4 and r["last_val_loss"] == 2.9
    # the initial evaluation is never the loss reached, however low the target
    assert time_to_loss(_run()[:1], 9.0)["time_to_loss_s"] is None


def test_bad_records_are_skipped() -> None:
    lines = [{"step": 0, "val_loss": 5.0, "time": 100.0}, {"step": 1, "loss": 4.0},
             {"step": "x", "loss": 1.0, "time": 100.5}, {"step": 1, "loss": 4.0, "time": 101.0},
             {"step": 1, "val_loss": float("nan"), "time": 102.0},
             {"step": 2, "loss": 3.0, "time": 99.0},  # back in time
             {"step": 2, "loss": 3.0, "time": 103.0}, {"step": 2, "val_loss": 1.0, "time": 104.0}]
    r = time_to_loss(lines, 2.0)
    assert r["steps"] == 2 and r["time_to_loss_s"] == 2.0  # the NaN evaluation's second left out


def test_tokens_per_s_leaves_the_first_step_out() -> None:
    assert tokens_per_s(_run(), 100) == 3 * 100 / (111.0 - 103.0)
    assert tokens_per_s(_run()[:3], 100) is None


def _seed(int8: float | None, int2: float | None) -> dict:
    ratio = None if int8 is None or int2 is None else int2 / int8
    return {"runs": {"int8": {"time_to_loss_s": int8, "time_vs_int8": 1.0},
                     "int2": {"time_to_loss_s": int2, "time_vs_int8": ratio}}}


def test_the_figure_over_seeds_is_the_ratio_of_the_summed_times() -> None:
    """A seed whose int8 broke through a plateau early misses alone (0.74 here); the summed
    times weigh each seed by how long it took, as a ratio of means does."""
    s = summarise([_seed(92.8, 30.2), _seed(123.2, 33.9), _seed(77.1, 57.1)],
                  ["int8", "int2"])["int2"]
    assert s["seeds_within_target"] == 2
    assert s["time_vs_int8_of_totals"] == pytest.approx((30.2 + 33.9 + 57.1)
                                                        / (92.8 + 123.2 + 77.1))
    assert [round(x, 3) for x in s["time_vs_int8_per_seed"]] == [0.325, 0.275, 0.741]
    # a run that never reached the loss leaves the figure unknown, not flattered
    missed = summarise([_seed(92.8, 30.2), _seed(123.2, None)], ["int8", "int2"])["int2"]
    assert missed["time_vs_int8_of_totals"] is None and missed["seeds_within_target"] == 1
    assert summarise([_seed(None, 30.2)], ["int8", "int2"])["int2"][
        "time_vs_int8_of_totals"] is None
