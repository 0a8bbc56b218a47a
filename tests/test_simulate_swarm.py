"""The balancing simulator, small: swarmd beats static placement, the oracle is an upper bound,
the run is deterministic, and the CLI prints what the benchmarks read."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from simulate_swarm import main, optimum_upper_bound, simulate  # noqa: E402

from swarmd.balancing.policy import BalancingConfig  # noqa: E402

FIGURES = ("mean_fraction_of_optimum", "moves_per_peer_hour", "recovery_s",
           "recovery_check_periods")


@pytest.fixture(scope="module")
def small() -> dict:
    return simulate(200, 4, 2.0, 0.2, seed=3)


def test_swarmd_beats_static_placement_and_nears_the_optimum(small: dict) -> None:
    pol = small["policies"]
    assert set(pol) == {"none", "petals", "swarmd"}
    sw, none = pol["swarmd"], pol["none"]
    assert sw["mean_fraction_of_optimum"] >= 0.9
    assert sw["mean_fraction_of_optimum"] > none["mean_fraction_of_optimum"]
    assert sw["mean_fraction_of_optimum"] >= pol["petals"]["mean_fraction_of_optimum"]
    assert 0 < sw["moves_per_peer_hour"] <= 0.5 and none["moves"] == 0
    assert sw["recovery_s"] is not None and sw["recovery_check_periods"] <= 4
    assert none["recovery_s"] is None or none["recovery_s"] > 2 * sw["recovery_s"]


def test_the_timeline_really_churns_and_drops(small: dict) -> None:
    for run in small["policies"].values():
        ev = run["events"]
        assert ev["joins"] > 30 and ev["leaves"] > 30 and ev["drop_removed"] >= 10
        assert run["fraction_after_drop"] < 0.9        # the drop does hurt
        assert 0 <= run["lpt_gap_max"] < 0.02           # the bound is tight here
        assert 0 < run["mean_fraction_of_optimum"] <= 1


def test_targets_are_reported_and_can_fail(small: dict) -> None:
    assert all(t["ok"] for t in small["targets"].values()), small["targets"]
    frozen = simulate(200, 4, 2.0, 0.2, seed=3, config=BalancingConfig(threshold=100.0))
    # a threshold nothing reaches makes swarmd static: it no longer beats "none"
    assert frozen["policies"]["swarmd"]["moves"] == 0
    assert not frozen["targets"]["swarmd_above_none"]["ok"]
    assert not frozen["targets"]["swarmd_recovery_check_periods"]["ok"]


def test_runs_are_deterministic() -> None:
    a = simulate(120, 3, 1.0, 0.5, seed=9, policies=("swarmd",))
    b = simulate(120, 3, 1.0, 0.5, seed=9, policies=("swarmd",))
    for x in (a, b):
        x.pop("wall_s")
        x["policies"]["swarmd"].pop("wall_s")
    assert a == b


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        simulate(200, 4, 1.0, 0.2, seed=1, policies=("magic",))
    with pytest.raises(ValueError):
        simulate(5, 4, 1.0, 0.2, seed=1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([1.0, 2.0, 3.0, 7.0, 20.0]), min_size=1, max_size=7),
       st.integers(1, 3))
def test_the_oracle_bounds_every_assignment(ts: list[float], stages: int) -> None:
    bound = optimum_upper_bound(sum(ts), sorted(ts, reverse=True)[:stages], stages)
    best = 0.0
    for assignment in itertools.product(range(stages), repeat=len(ts)):
        totals = [0.0] * stages
        for t, s in zip(ts, assignment):
            totals[s] += t
        best = max(best, min(totals))
    assert bound >= best - 1e-9
    if max(ts) * stages <= sum(ts):
        assert bound == pytest.approx(sum(ts) / stages)


def test_cli_prints_one_json_object_last(capsys: pytest.CaptureFixture) -> None:
    assert main(["--peers", "100", "--stages", "3", "--hours", "0.5", "--churn", "0.3",
                 "--seed", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["scenario"]["peers"] == 100
    # --check turns a missed target into exit status 1
    assert main(["--peers", "100", "--stages", "3", "--hours", "0.5", "--seed", "2",
                 "--threshold", "100", "--json", "--check"]) == 1


def test_cli_as_a_process() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "simulate_swarm.py"), "--peers", "200",
         "--stages", "4", "--hours", "1", "--churn", "0.2", "--seed", "1", "--json"],
        capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for policy in ("none", "petals", "swarmd"):
        assert set(FIGURES) <= set(out["policies"][policy])
    assert {"scenario", "balancing", "oracle", "targets", "wall_s"} <= set(out)
    for t in out["targets"].values():
        assert set(t) == {"value", "target", "ok"}
