"""tools/bench_scale.py's pure parts: which short rounds count against the swarm (those outside
a kill's window), and its targets."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_scale  # noqa: E402


def test_short_rounds_count_only_between_polls_clear_of_every_kill_window() -> None:
    # slot 0 led a short round between each pair of polls; slot 1 (another stage) too
    polls = [(float(t), {0: t, 1: t}) for t in range(0, 10)]
    windows = [(3.5, 5.5)]  # polls 3-4, 4-5 and 5-6 overlap it
    assert bench_scale._short_outside(polls, windows, [0], after=0.0) == 9 - 3
    assert bench_scale._short_outside(polls, windows, [0, 1], after=0.0) == 2 * (9 - 3)
    assert bench_scale._short_outside(polls, [], [0], after=7.0) == 2  # 7-8, 8-9
    assert bench_scale._short_outside(polls, [(2.0, float("inf"))], [0], after=0.0) == 1


def _run(short_late: int | None, short_all: int, lost: int = 0) -> dict:
    stage = {"rounds_short_after_first_minute": short_late,
             "rounds_short_after_first_minute_outside_kills": short_late or 0,
             "rounds_short_outside_kills": short_all}
    return {"lost": lost, "stages": [stage, dict(stage)],
            "membership": {"converge_periods": 0.5, "rejoin_periods": [1.0]},
            "memory_ratio": 1.1}


def test_targets_say_none_for_the_first_minute_of_a_shorter_run() -> None:
    t = bench_scale.targets(_run(None, 0), None)
    assert t["rounds_include_live_mates_after_first_minute"] is None
    assert t["rounds_include_live_mates_outside_kills"] and t["lost_0"]
    assert t["memory_within_1_2x"] is None and t["membership_within_3_periods"]
    t = bench_scale.targets(_run(2, 2, lost=1), {"memory": {}})
    assert t["rounds_include_live_mates_after_first_minute"] is False
    assert not t["rounds_include_live_mates_outside_kills"] and not t["lost_0"]
    assert t["memory_within_1_2x"]


def test_a_rejoin_that_never_converged_fails_the_membership_target() -> None:
    run = _run(0, 0)
    run["membership"]["rejoin_periods"] = [None]
    assert not bench_scale.targets(run, None)["membership_within_3_periods"]


def test_prepare_answer_quantiles_sum_the_processes_buckets() -> None:
    one = [[0.001, 2], [0.01, 9], [0.1, 10], [3.0, 10], ["+Inf", 10]]
    two = [[0.001, 0], [0.01, 80], [0.1, 89], [3.0, 90], ["+Inf", 90]]
    got = bench_scale.answer_quantiles([one, two])
    assert got == {"count": 100, "p50_le": 0.01, "p99_le": 0.1, "max_le": 3.0}
    assert bench_scale.answer_quantiles([]) == {"count": 0, "p50_le": None, "p99_le": None,
                                                "max_le": None}


def test_a_daemon_that_moved_counts_at_the_stage_its_status_names() -> None:
    """Balancing moves a daemon: its counters and step belong to the stage it serves now (they
    were summed with its start stage's, whose step it no longer shares)."""
    import os
    from types import SimpleNamespace

    status = {"stage": 1, "counters": {"stage.step": 7}}
    proc = SimpleNamespace(proc=SimpleNamespace(pid=os.getpid()), get=lambda path: status)
    slot = bench_scale.Slot(index=3, stage=0, proc=proc)  # type: ignore[arg-type]
    assert slot.now_stage == 0  # nothing seen yet: where it started
    slot.sample()
    assert (slot.now_stage, slot.step) == (1, 7)
    status.pop("stage")  # a status without it (an older daemon): the last seen stays
    slot.sample()
    assert slot.now_stage == 1
