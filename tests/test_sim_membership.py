"""The membership simulator, small: the design's figures hold, and the checks can fail."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from sim_membership import main, simulate  # noqa: E402

from swarmd.membership import ScheduleConfig  # noqa: E402

BUDGET = ScheduleConfig().budget_bytes_per_s


@pytest.fixture(scope="module")
def small() -> dict:
    return simulate(200, 4, 0.5, 0.3, seed=11, observers=6)


def test_traffic_stays_within_the_budget(small: dict) -> None:
    traffic = small["traffic"]
    assert traffic["in_bytes_per_s_max"] <= BUDGET
    assert traffic["out_bytes_per_s_max"] <= BUDGET
    assert traffic["in_bytes_per_s_mean"] > 0.5 * BUDGET   # and it uses it: snappy
    assert small["plan"]["modelled_in_bytes_per_s"] <= 0.8 * BUDGET + 1


def test_stage_totals_within_ten_percent(small: dict) -> None:
    totals = small["stage_totals"]
    assert totals["checks"] == 24 * 6
    assert totals["rel_error_max"] <= 0.10


def test_churn_happened_and_views_stay_fresh(small: dict) -> None:
    events, stale = small["events"], small["staleness"]
    assert events["joins"] > 5 and events["kills"] > 3 and events["graceful_leaves"] > 3
    assert events["live_expired"] == 0                       # no live peer ever dropped
    assert 0 < stale["killed_removed_after_periods_max"] <= 3.0
    assert stale["dead_listed_fraction_max"] < 0.05
    assert stale["live_missing_fraction_mean"] < 0.01
    assert stale["entry_age_s_max"] <= small["plan"]["expiry_s"] * 1.2
    assert 0 < stale["join_seen_after_s_max"] < small["plan"]["period_s"] * 1.5
    assert 0 < stale["leave_seen_after_s_max"] < small["plan"]["period_s"] * 1.5
    assert small["observer_dropped"].get("forged", 0) == 0


def test_a_fixed_short_period_would_blow_the_budget() -> None:
    """The measurement is not vacuous: announcing every 2 s whatever the size is caught."""
    flood = ScheduleConfig(max_period_s=2.0)
    out = simulate(100, 4, 0.05, 0.0, seed=2, observers=2, config=flood)
    assert out["traffic"]["in_bytes_per_s_mean"] > 5 * BUDGET


def test_small_swarm_is_snappy_and_deterministic(capsys: pytest.CaptureFixture) -> None:
    assert main(["--peers", "12", "--stages", "2", "--hours", "0.1", "--churn", "3",
                 "--observers", "4", "--seed", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    again = simulate(12, 2, 0.1, 3.0, seed=5, observers=4)
    out.pop("wall_s"), again.pop("wall_s")
    assert out == again
    assert out["plan"]["period_s"] < 3.5
    assert out["staleness"]["join_seen_after_s_max"] < 10          # agree within seconds
    assert out["traffic"]["in_bytes_per_s_max"] <= BUDGET


def test_rejects_impossible_arguments() -> None:
    with pytest.raises(ValueError):
        simulate(5, 2, 1.0, 0.1, seed=1, observers=12)
