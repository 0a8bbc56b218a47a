"""tools/bench_wan.py's arithmetic: pipeline ratios paired by round, and the issue's targets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

bench_wan = pytest.importorskip("bench_wan")


def test_each_rounds_run_is_compared_with_the_same_rounds_unshaped_run() -> None:
    results = {"unshaped": {"pipeline_runs_tokens_per_s": [100.0, 200.0, 150.0]},
               "far": {"pipeline_runs_tokens_per_s": [90.0, 160.0, None]}}
    bench_wan.pipeline_ratios(results)
    assert results["far"]["pipeline_ratios"] == [0.9, 0.8]  # a failed run is left out
    assert results["far"]["pipeline_ratio_vs_unshaped"] == pytest.approx(0.85)
    assert results["unshaped"]["pipeline_ratio_vs_unshaped"] == 1.0


def test_a_round_is_contended_when_others_loaded_either_of_its_runs() -> None:
    results = {"unshaped": {"pipeline_runs_tokens_per_s": [100.0, 100.0, 100.0, 100.0],
                            "pipeline_runs_others_cpu_share": [0.0, 0.3, 0.05, 0.0]},
               "continent": {"pipeline_runs_tokens_per_s": [90.0, 80.0, 90.0, 78.0],
                             "pipeline_runs_others_cpu_share": [0.02, 0.0, None, 0.25]}}
    bench_wan.pipeline_ratios(results)
    assert results["continent"]["pipeline_contended_rounds"] == [1, 3]
    assert results["unshaped"]["pipeline_contended_rounds"] == [1]
    # the median still counts every round: the contended ones are named, not dropped
    assert results["continent"]["pipeline_ratio_vs_unshaped"] == pytest.approx(0.85)


def test_the_pipeline_targets_need_the_ratio_and_nothing_lost() -> None:
    def profile(ratio: float | None, lost: int) -> dict[str, object]:
        return {"pipeline_ratio_vs_unshaped": ratio, "pipeline": {"lost": lost},
                "rtt_ms": 0.0, "raw_tcp_vs_link_rate": None, "transport_vs_raw_tcp": 1.0}

    targets = bench_wan._targets({"unshaped": profile(1.0, 0), "far": profile(0.91, 0),
                                  "continent": profile(None, 1)})
    assert targets["pipeline_ge_0.9x_unshaped_far"] is True
    assert targets["pipeline_ge_0.9x_unshaped_continent"] is False  # not measured: not met
    assert targets["pipeline_lost_0_continent"] is False
    assert targets["pipeline_lost_0_far"] is True
    assert bench_wan._targets({"far": profile(0.86, 0)})["pipeline_ge_0.9x_unshaped_far"] is False


def test_transport_and_all_reduce_targets_are_the_issues() -> None:
    def profile(transport: float, bus: float | None) -> dict[str, object]:
        return {"pipeline_ratio_vs_unshaped": 1.0, "pipeline": {"lost": 0}, "rtt_ms": 0.0,
                "raw_tcp_vs_link_rate": None, "transport_vs_raw_tcp": transport,
                "allreduce": {"bus_bandwidth_vs_link_rate": bus}}

    targets = bench_wan._targets({"region": profile(0.95, 0.5), "continent": profile(0.89, 0.71),
                                  "far": profile(0.9, None)})
    assert targets["transport_ge_0.9x_raw_tcp_region"] is True
    assert targets["transport_ge_0.9x_raw_tcp_continent"] is False
    assert targets["allreduce_bus_ge_0.7x_link_continent"] is True
    assert targets["allreduce_bus_ge_0.7x_link_far"] is False  # not measured: not met
    assert not any(k.startswith("allreduce") and k.endswith("region") for k in targets)


def test_the_bandwidth_bound_profile_is_measured_only_when_asked_for() -> None:
    assert "uplink" in bench_wan.PROFILES and "uplink" not in bench_wan.DEFAULT_PROFILES
    assert bench_wan.PROFILES["uplink"][1] == bench_wan.PROFILES["uplink"][2]  # both ways


def test_a_hop_of_the_wide_model_moves_its_output_and_input_gradient_with_the_codec() -> None:
    """Issue 26's arithmetic: 8 x 128 tokens of width 512 are 1.08 MB a hop in int8 (a float16
    scale per 64 values), 4.3 s over the 2 Mbit/s uplink; int2 (centred activations in blocks
    of 512 and their channel means, gradients in blocks of 512) at most a quarter, less with
    the gradient's codes compressed."""
    from bench_wan_bandwidth import BANDWIDTH_MODEL, hop_bytes

    env = {**BANDWIDTH_MODEL, "SWARMD_MODEL_WIDTH": "512"}
    int8 = hop_bytes({**env, "SWARMD_WIRE_CODEC": "int8"})
    int2 = hop_bytes({**env, "SWARMD_WIRE_CODEC": "int2"})
    assert int8["shape"] == [8, 128, 512] and int8["tokens"] == 1024
    assert int8["hop_bytes"] == 2 * 8 * 128 * 512 * (1 + 2 / 64)
    plain = hop_bytes({**env, "SWARMD_WIRE_CODEC": "int2", "SWARMD_WIRE_LOWBIT_ZSTD": "off"})
    assert plain["hop_bytes"] == 8 * 128 * 512 * (2 / 8 + 2 / 512) * 2 + 512 * 2
    assert plain["hop_bytes"] * 4 <= int8["hop_bytes"]
    # the gradient's stochastic codes, compressed with zstd (the default), take about 0.7
    assert int2["hop_bytes"] < 0.9 * plain["hop_bytes"]
    assert int8["hop_bytes"] * 8 / (bench_wan.PROFILES["uplink"][2] * 1e6) == pytest.approx(
        4.33, abs=0.01)


def test_the_uplink_rate_is_chosen_for_the_regime_on_the_machine_that_runs_it() -> None:
    from bench_wan_bandwidth import TARGET_RATIO, uplink_rate_for

    hop, tokens = 1_081_344, 1024
    for unshaped in (634.0, 1783.0, 50_000.0):  # a slow CPU, this one, a GPU
        mbit = uplink_rate_for(hop, tokens, unshaped)
        transfer_s, compute_s = hop * 8 / (mbit * 1e6), tokens / unshaped
        assert transfer_s / compute_s == pytest.approx(TARGET_RATIO)
    assert uplink_rate_for(hop, tokens, 1783.0) == pytest.approx(6.03, abs=0.01)
