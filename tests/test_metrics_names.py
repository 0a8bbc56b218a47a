"""Metrics one per quantity (issue 27): every counter its own ``swarmd_<name>_total`` series
with its unit in the name, levels as gauges, the process collector; read back with
prometheus_client's own parser."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swarmd.api.metrics import counter_families, metric_name


class _Collector:
    def __init__(self, counters: dict[str, float]) -> None:
        self.counters = counters

    def collect(self):  # type: ignore[no-untyped-def]
        return counter_families(self.counters)


def _families(counters: dict[str, float]) -> dict[str, tuple[str, float]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(counters))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return {f.name: (f.type, f.samples[0].value) for f in text_string_to_metric_families(text)}


def test_each_counter_is_a_series_with_its_unit_and_levels_are_gauges() -> None:
    got = _families({"stage.backward": 7, "state.bytes": 1200, "step_gate_closed_ms": 2500,
                     "stage.step": 12, "stage.in_flight": 3, "refused.report_sender": 1})
    assert got["swarmd_stage_backward"] == ("counter", 7)
    assert got["swarmd_state_bytes"] == ("counter", 1200)
    assert got["swarmd_step_gate_closed_seconds"] == ("counter", 2.5)
    assert got["swarmd_stage_step"] == ("gauge", 12)
    assert got["swarmd_stage_in_flight"] == ("gauge", 3)
    assert got["swarmd_refused_report_sender"] == ("counter", 1)
    assert got["swarmd_metrics_skipped"] == ("gauge", 0)


def test_a_name_that_makes_no_series_or_collides_is_skipped_and_counted() -> None:
    got = _families({"a.b": 1, "a_b": 2, "bad name": 3, "up": 4, "x_total": 5})
    assert got["swarmd_a_b"] == ("counter", 1)  # "a.b" first (sorted), "a_b" collides
    assert "swarmd_up" not in got or got["swarmd_up"][0] != "counter"
    assert got["swarmd_metrics_skipped"] == ("gauge", 4)


@given(st.dictionaries(st.text(max_size=30), st.integers(0, 2**40), max_size=20))
@example({"A\n": 0})  # "$" matches before a final newline: the name was taken (hypothesis)
@example({"total": 0})  # swarmd_total: a counter family named "swarmd" (hypothesis)
def test_any_counters_render_as_a_valid_exposition(counters: dict[str, int]) -> None:
    got = _families(counters)  # the parser raises on anything invalid
    exported = {metric_name(c)[0] for c in counters if metric_name(c) is not None}
    assert exported <= set(got)


def _histogram_text(histograms: dict[str, object]) -> str:
    from swarmd.api.metrics import histogram_families

    class Collector:
        def collect(self):  # type: ignore[no-untyped-def]
            return histogram_families(histograms)  # type: ignore[arg-type]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_hop_and_step_times_are_histograms_with_their_kind() -> None:
    from swarmd.api.histogram import HOP_BOUNDS_S, STEP_BOUNDS_S, Histograms

    h = Histograms()
    for s in (0.002, 0.004, 0.3, 7.0):
        h.observe("hop_seconds.forward", s, HOP_BOUNDS_S)
    h.observe("hop_seconds.backward", 0.02, HOP_BOUNDS_S)
    h.observe("step_seconds", 1.5, STEP_BOUNDS_S)
    h.observe("step_seconds", 400.0, STEP_BOUNDS_S)  # past the last bound: +Inf only
    h.observe("step_seconds", float("nan"), STEP_BOUNDS_S)  # not observed
    text = _histogram_text({k: v.to_json() for k, v in h.snapshot().items()})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["swarmd_hop_seconds"].type == "histogram"
    assert families["swarmd_step_seconds"].type == "histogram"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    fwd = (("kind", "forward"),)
    assert samples[("swarmd_hop_seconds_count", fwd)] == 4
    assert samples[("swarmd_hop_seconds_sum", fwd)] == pytest.approx(7.306)
    assert samples[("swarmd_hop_seconds_bucket", (*fwd, ("le", "0.005")))] == 2
    assert samples[("swarmd_hop_seconds_bucket", (*fwd, ("le", "+Inf")))] == 4
    assert samples[("swarmd_hop_seconds_count", (("kind", "backward"),))] == 1
    assert samples[("swarmd_step_seconds_count", ())] == 2
    assert samples[("swarmd_step_seconds_bucket", (("le", "300.0"),))] == 1


def test_unknown_or_malformed_histograms_are_left_out() -> None:
    good = {"buckets": [[1.0, 1], ["+Inf", 1]], "sum": 0.5, "count": 1}
    text = _histogram_text({"other_seconds": good, "hop_seconds.Bad Kind": good,
                            "hop_seconds.forward": {"buckets": [[1.0, 1]], "sum": 0.5},
                            "step_seconds": {"sum": 1}, "hop_seconds.backward": good})
    names = {(s.name, s.labels.get("kind")) for f in text_string_to_metric_families(text)
             for s in f.samples}
    assert ("swarmd_hop_seconds_count", "backward") in names
    assert not any(n.startswith(("swarmd_other", "swarmd_step")) for n, _ in names)
    assert ("swarmd_hop_seconds_count", "forward") not in names


@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                          st.integers(-5, 10**6)), max_size=50))
def test_a_histogram_counts_every_finite_non_negative_value_once(values: list[float]) -> None:
    from swarmd.api.histogram import HOP_BOUNDS_S, Histogram

    h = Histogram(HOP_BOUNDS_S)
    for v in values:
        h.observe(v)
    snap = h.snapshot()
    kept = [v for v in values if v == v and abs(v) != float("inf") and v >= 0]
    assert snap.count == len(kept) and h.rejected == len(values) - len(kept)
    counts = [n for _, n in snap.buckets]
    assert counts == sorted(counts) and counts[-1] == snap.count
    for bound, n in snap.buckets:
        assert n == sum(1 for v in kept if v <= bound)
