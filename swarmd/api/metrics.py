"""The daemon's counters as Prometheus series, one per quantity.

Each counter of ``StatusInfo.counters`` (dotted names: ``stage.backward``,
``protocol_errors.truncated``, ``state.bytes``...) is its own series,
``swarmd_<name with dots as underscores>_total``, so a dashboard selects a quantity by name and
every series has one unit. Counters in milliseconds (``..._ms``) are exported in seconds
(``swarmd_<name>_seconds_total``); the few values that are levels, not counts (a stage's step,
its microbatches in flight), are gauges without ``_total``. A name that would not make a valid
metric name after this mapping, or that collides with one already made, is skipped and counted
in ``swarmd_metrics_skipped``.

Durations are histograms (``swarmd.api.histogram``), ``StatusInfo.histograms`` by dotted name:
``hop_seconds.forward`` is the family ``swarmd_hop_seconds`` with ``kind="forward"``,
``step_seconds`` the family ``swarmd_step_seconds`` (``histogram_families``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)

__all__ = ["GAUGES", "HISTOGRAM_DOCS", "metric_name", "counter_families", "histogram_families"]

#: the histograms a daemon keeps (name before the first dot -> help text)
HISTOGRAM_DOCS = {
    "hop_seconds": "Seconds from sending a microbatch to a peer of the next stage to its ok "
                   "(its compute and the chain after it), by kind (forward, backward)",
    "step_seconds": "Seconds between this stage peer's consecutive optimizer steps",
    "round_ask_seconds": "Seconds from asking a stage mate about an averaging round to its "
                         "answer, by kind (progress, prepare, start); a mate that does not "
                         "answer within ASK_TIMEOUT_S is not observed",
}

#: counters that hold a level, not a count: exported as gauges
GAUGES = frozenset({"stage.step", "stage.in_flight"})
#: what a series name may hold (Prometheus' data model)
_VALID = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
#: what a histogram's kind label may hold (short words: forward, backward)
_VALID_LABEL = re.compile(r"[a-z_]{1,32}")
#: names already taken by the daemon's other series, which a counter must not reuse
_RESERVED = frozenset({"up", "info", "uptime_seconds", "stage", "state", "connected_peers",
                       "throughput_samples_per_second", "queue_length", "reachability",
                       "relay_reservations", "stage_throughput", "stage_peers",
                       "stage_routable_peers", "bottleneck_stage", "swarm_stages",
                       "swarm_peers", "excluded_peers", "http_errors", "metrics_skipped",
                       "trainer_step", "trainer_loss", "trainer_val_loss", *HISTOGRAM_DOCS})


def metric_name(counter: str) -> tuple[str, str, float] | None:
    """(series name without ``_total``, "counter" or "gauge", the factor its value is
    multiplied by) for a counter's dotted name; None when it makes no valid name."""
    base = counter.replace(".", "_").replace("-", "_")
    kind, factor = ("gauge" if counter in GAUGES else "counter"), 1.0
    if kind == "counter" and base.endswith("_ms"):
        base, factor = base[:-3] + "_seconds", 1e-3
    name = f"swarmd_{base}"
    # (a counter family named ..._total loses that suffix: "total" would export "swarmd")
    if not base or not _VALID.fullmatch(base) or base in _RESERVED or name.endswith("_total"):
        return None
    return name, kind, factor


def counter_families(counters: Mapping[str, float]) -> Iterator[Metric]:
    """One family per counter (see the module docstring), then ``swarmd_metrics_skipped``."""
    seen: set[str] = set()
    skipped = 0
    for counter, value in sorted(counters.items()):
        named = metric_name(counter)
        if named is None or named[0] in seen:
            skipped += 1
            continue
        name, kind, factor = named
        seen.add(name)
        doc = f"The daemon's {counter!r}" + (" (seconds)" if factor != 1.0 else "")
        if kind == "gauge":
            yield GaugeMetricFamily(name, doc, value=value * factor)
        else:
            yield CounterMetricFamily(name, doc, value=value * factor)
    yield GaugeMetricFamily("swarmd_metrics_skipped", "Counters not exported: a name that "
                            "makes no valid series, or one another counter took", value=skipped)


def histogram_families(histograms: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    """One family per name in ``HISTOGRAM_DOCS``, from ``HistogramSnapshot.to_json`` forms by
    dotted name; a name it does not know, or a malformed one, is left out."""
    families: dict[str, HistogramMetricFamily] = {}
    for name, value in sorted(histograms.items()):
        base, _, kind = name.partition(".")
        if base not in HISTOGRAM_DOCS or (kind and not _VALID_LABEL.fullmatch(kind)):
            continue
        try:
            buckets = [("+Inf" if bound == "+Inf" else repr(float(bound)), int(n))
                       for bound, n in value["buckets"]]
            total = float(value["sum"])
        except (KeyError, TypeError, ValueError):
            continue
        if not buckets or buckets[-1][0] != "+Inf":
            continue
        family = families.get(base)
        if family is None:
            family = families[base] = HistogramMetricFamily(
                f"swarmd_{base}", HISTOGRAM_DOCS[base], labels=["kind"] if kind else None)
        elif bool(kind) != bool(family.samples and "kind" in family.samples[0].labels):
            continue  # one family is either labelled or not
        family.add_metric([kind] if kind else [], buckets, sum_value=total)
    yield from families.values()
