"""The test that ships with upstream/series 0004 ([observability] a cache backend's own series).

Written as it would sit in SGLang's own test tree (no HiState import), against the patched copy that
`make upstream-check` builds.
"""
from __future__ import annotations

import prometheus_client
import pytest

from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

LABELS = {"cache_type": "ToyCache", "tp_rank": 1, "pp_rank": 0, "dp_rank": 0}


class Recorded:
    made: list = []

    def __init__(self, name, documentation, labelnames=(), **kwargs):
        self.name, self.documentation, self.labelnames, self.kwargs = name, documentation, list(labelnames), kwargs
        Recorded.made.append(self)


class InjectedCollector(RadixCacheMetricsCollector):
    """As `stat_loggers` injects a backend (ray_wrappers.RayRadixCacheMetricsCollector does this)."""

    _counter_cls = Recorded
    _gauge_cls = Recorded
    _histogram_cls = Recorded


@pytest.fixture
def collector():
    Recorded.made = []
    return InjectedCollector(labels=dict(LABELS))


def test_a_backends_counter_has_the_collectors_rank_labels_and_backend(collector):
    own = len(Recorded.made)  # the collector's own series, made through the same injected class
    assert own > 0
    family = collector.add_counter("toy_hits_total", "Toy hits.", ("tier",))
    assert family is Recorded.made[own]
    assert (family.name, family.documentation) == ("sglang:toy_hits_total", "Toy hits.")
    assert family.labelnames == ["cache_type", "tp_rank", "pp_rank", "dp_rank", "tier"]


def test_a_backends_gauge_keeps_one_value_per_rank_by_default(collector):
    family = collector.add_gauge("toy_resident", "Toy units resident.", ("tier",))
    assert family.name == "sglang:toy_resident" and family.kwargs == {"multiprocess_mode": "mostrecent"}
    assert collector.add_gauge("toy_sum", "x", multiprocess_mode="livesum").kwargs == {"multiprocess_mode": "livesum"}


def test_without_injection_the_series_are_prometheus_clients_and_bind_with_the_collectors_labels(monkeypatch):
    registry = prometheus_client.CollectorRegistry()
    made = []
    real_counter = prometheus_client.Counter

    def counter(**kwargs):
        made.append(kwargs["name"])
        return real_counter(**kwargs, registry=registry)

    class Quiet(RadixCacheMetricsCollector):  # SGLang's own series out of the process-wide registry
        _counter_cls = Recorded
        _histogram_cls = Recorded

    quiet = Quiet(labels=dict(LABELS))
    monkeypatch.setattr(prometheus_client, "Counter", counter)
    monkeypatch.setattr(Quiet, "_counter_cls", None)  # the default: prometheus_client, looked up at call time
    family = quiet.add_counter("toy_hits_total", "Toy hits.", ("tier",))
    family.labels(**quiet.labels, tier="host").inc(3)
    assert made == ["sglang:toy_hits_total"]
    assert registry.get_sample_value("sglang:toy_hits_total", {**{k: str(v) for k, v in LABELS.items()},
                                                                "tier": "host"}) == 3


def test_the_ray_backend_makes_a_backends_gauges_through_ray_too():
    from sglang.srt.observability import ray_wrappers

    assert ray_wrappers.RayRadixCacheMetricsCollector._gauge_cls is ray_wrappers.RayGaugeWrapper
