"""HiState's series reach SGLang's /metrics with the rank labels SGLang gives its own cache series.

On stock 0.5.23 the plugin makes them with prometheus_client and `radix_cache_metric_labels`; under
upstream/series 0004 (`RadixCacheMetricsCollector.add_counter` / `add_gauge`) through the collector SGLang
built for the cache (its labels and its metric backend). Either way the same names, labels and values:
this test runs on both (make upstream-check runs it on the patched copy).
"""
from __future__ import annotations

import pytest

from sglang_cpu.pools import build_cache, build_pools, key, publish_server_args

from ._scheduler_rig import new_req


class FakeFamily:
    """A metric family as prometheus_client's constructors make one; records what it was told."""

    made: dict = {}

    def __init__(self, name, documentation, labelnames=(), registry=None, **kwargs):
        self.name, self.labelnames, self.values = name, list(labelnames), {}
        FakeFamily.made[name] = self

    def labels(self, **labels):
        assert sorted(labels) == sorted(self.labelnames), (self.name, labels)
        family, label_key = self, tuple(sorted((k, str(v)) for k, v in labels.items()))

        class Bound:
            def inc(self, amount=1):
                family.values[label_key] = family.values.get(label_key, 0) + amount

            def set(self, value):
                family.values[label_key] = value

            def observe(self, value):
                family.values[label_key] = value

        return Bound()


@pytest.fixture
def fake_metrics(monkeypatch):
    """Every series (SGLang's and HiState's) goes to FakeFamily: no process-wide prometheus registry."""
    import prometheus_client
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    from histate.sglang_plugin import metrics

    FakeFamily.made = {}
    for attr in ("_counter_cls", "_gauge_cls", "_histogram_cls"):
        monkeypatch.setattr(RadixCacheMetricsCollector, attr, FakeFamily)
    monkeypatch.setattr(prometheus_client, "Counter", FakeFamily)  # the plugin's own path (stock SGLang)
    monkeypatch.setattr(prometheus_client, "Gauge", FakeFamily)
    monkeypatch.setattr(metrics, "_shared", {})
    return FakeFamily.made


def test_histate_series_carry_sglangs_cache_labels_and_count_lookups(sglang_plugins, fake_metrics):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.runtime_context import get_parallel

    publish_server_args()
    pools = build_pools(kv_tokens=512, mamba_slots=8)
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):  # the rank labels' source
        cache = build_cache("histate", pools, params_fields={"enable_metrics": True})
    assert cache.metrics_collector is not None  # SGLang's own collector for this cache
    rank_labels = sorted(cache.metrics_collector.labels)
    assert "tp_rank" in rank_labels and "cache_type" in rank_labels
    for name in ("sglang:histate_input_tokens_total", "sglang:histate_evictions_total", "sglang:histate_checkpoints"):
        assert name in fake_metrics, sorted(fake_metrics)
    assert sorted(fake_metrics["sglang:histate_input_tokens_total"].labelnames) == rank_labels
    assert sorted(fake_metrics["sglang:histate_evictions_total"].labelnames) == sorted(rank_labels + ["unit", "tier"])
    tokens = list(range(1, 33))
    cache.match_prefix(MatchPrefixParams(key=key(tokens), req=new_req("r0", tokens)))
    series = fake_metrics["sglang:histate_input_tokens_total"].values
    expected_labels = tuple(sorted((k, str(v)) for k, v in cache.metrics_collector.labels.items()))
    assert cache.histate.metrics.totals["input_tokens_total"] == 32, dict(cache.histate.metrics.totals)
    assert series == {expected_labels: 32}  # one lookup of 32 tokens, under SGLang's labels for this cache
    assert cache.histate.metrics.totals["input_tokens_total"] == 32
