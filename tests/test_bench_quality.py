"""tools/bench_quality.py's pure parts: where a swarm's training first leaves the reference's,
and the summary over repeats (against the reference and against its noisy runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_quality  # noqa: E402


def test_the_first_step_apart_is_the_first_beyond_the_relative_bound() -> None:
    ref = [5.0, 4.0, 3.0, 2.5]
    assert bench_quality.first_step_apart(ref, ref) is None
    assert bench_quality.first_step_apart([5.0, 4.0 * (1 + 5e-4), 3.0, 2.5], ref) is None
    assert bench_quality.first_step_apart([5.0, 4.0, 3.01, 2.0], ref) == 3
    assert bench_quality.first_step_apart([5.0, 4.0], ref) is None  # a shorter run: its steps


def _run(seed: int, swarm: float, ref: float, noisy: list[float]) -> dict:
    finals = [ref, *noisy]
    return {"preset": "demo", "link": "loopback", "seed": seed, "final_val_loss": swarm,
            "ratio": swarm / ref, "export_ratio": swarm / ref, "trainer_steps": 10,
            "stage_optimizer_steps": [10, 10], "lost": 0,
            "reference": {"final_val_loss": ref, "settled_change_last_tenth": 0.001,
                          "noise": {"mean_final_val_loss": sum(finals) / len(finals),
                                    "spread": (max(finals) - min(finals)) / min(finals)}}}


def test_the_summary_compares_the_means_with_the_reference_and_with_its_noisy_runs() -> None:
    runs = [_run(0, 2.0, 2.0, [2.0, 2.0]), _run(1, 2.2, 2.0, [2.2, 2.2])]
    s = bench_quality.summarize(runs)["demo/loopback"]
    assert s["ratio_of_means"] == pytest.approx(4.2 / 4.0)
    assert s["ratio_to_noisy_means"] == pytest.approx(4.2 / (2.0 + 6.4 / 3))
    assert s["reference_spreads"] == [0.0, pytest.approx(0.1)]
    assert s["stages_step_once_per_trainer_step"] and s["reference_settled"]
    assert s["met"] is False and s["met_against_noisy_means"] is False and s["target"] == 1.01
