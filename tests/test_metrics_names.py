"""Metrics one per quantity (issue 27): every counter its own ``swarmd_<name>_total`` series
with its unit in the name, levels as gauges, the process collector; read back with
prometheus_client's own parser."""

from __future__ import annotations

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
def test_any_counters_render_as_a_valid_exposition(counters: dict[str, int]) -> None:
    got = _families(counters)  # the parser raises on anything invalid
    exported = {metric_name(c)[0] for c in counters if metric_name(c) is not None}
    assert exported <= set(got)
