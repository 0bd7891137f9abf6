"""HiState's Prometheus series, exported the way SGLang exports its own cache metrics.

SGLang runs prometheus_client in multiprocess mode (PROMETHEUS_MULTIPROC_DIR is set by the
launcher before any collector exists; the HTTP server's /metrics aggregates every process), and
its collectors create series with the `sglang:` prefix and the rank labels of
`radix_cache_metric_labels`. HiState's series follow the same conventions so they appear on the
same /metrics page next to `sglang:evicted_tokens_total` and friends:

  sglang:histate_prefix_hits_total{tier}        requests whose first pass resumed from a checkpoint, by
                                                the tier it was in when matched (a host hit SGLang could
                                                not load back counts at the device prefix it used)
  sglang:histate_reused_tokens_total            tokens reused (DESIGN.md hit accounting: c)
  sglang:histate_input_tokens_total             tokens looked up (hit rate = reused / input)
  sglang:histate_checkpoints{tier}              checkpoints resident per tier (gauge)
  sglang:histate_host_write_policy{policy,chosen_by} 1 on HiCache's host write policy (gauge): chosen_by
                                                operator (--hicache-write-policy) | histate (not given:
                                                write_policy.py)
  sglang:histate_evictions_total{unit,tier}     eviction decisions by unit (checkpoint | bundle) and tier
  sglang:histate_ssd_read_bytes_total           bytes read from the SSD tier
  sglang:histate_ssd_written_bytes_total        bytes written to the SSD tier
  sglang:histate_l3_pages_total{result}         pages and states looked up in the shared L3 (hit | miss)
  sglang:histate_l3_read_bytes_total            bytes read from the shared L3 (--histate-l3)
  sglang:histate_l3_written_bytes_total         bytes written to the shared L3
  sglang:histate_prefill_chunk_cuts_total{kind} chunked-prefill cuts floored to the state grid
  sglang:histate_short_prefill_passes_total{result} passes of a long chunked prefill under
                                                --histate-short-prefill-first: capped (short ones went first)
                                                | aged (ran uncapped: it had yielded max-yields passes in a row)
  sglang:histate_captures_total{result}         planned checkpoints of prefill passes: tracked | extra |
                                                off_grid | no_slot | no_track | unfilled (the last four dropped;
                                                unfilled: the forward did not write every layer)
  sglang:histate_checkpoints_homed_total        historical checkpoints left on SSD alone
  sglang:histate_kv_demoted_tokens_total        host KV written to SSD ahead of its eviction (victim tier)
  sglang:histate_ssd_restores_total{result}     SSD checkpoint restores (ok | miss: a fault on some rank)
  sglang:histate_ssd_restore_rechecks_total     admission rounds a request skipped for an SSD checkpoint only its
                                                admission match found (restore_recheck.py)
  sglang:histate_state_writes_total{result}     write_back: checkpoints written to the SSD at creation (stored |
                                                failed: some rank's store does not hold it; state_writes.py)
  sglang:histate_miss_tokens_total{reason}      uncached prompt tokens by reason (--histate-miss-reasons;
                                                docs/misses.md)
  sglang:histate_tool_wait_turns_total{event}   tool-wait residency: held | expired | back_in_time | back_late
                                                (--histate-tool-wait-prefetch)

Every value is also kept as a plain integer in `totals` (tests and benchmarks read these), so
recording works identically with Prometheus off (`--enable-metrics` not given).
"""
from __future__ import annotations

import threading
from collections import Counter as _Tally
from typing import Any, Mapping, Optional

from histate.core import SGLANG_TIER_NAMES

TIERS = tuple(SGLANG_TIER_NAMES.values())
UNITS = ("checkpoint", "bundle")
GAUGES = frozenset({"checkpoints", "host_write_policy"})
"""Series that are gauges (set, not incremented); the rest are counters."""

_shared: dict[tuple, "HiStateMetrics"] = {}
_shared_lock = threading.Lock()


class HiStateMetrics:
    """Counters for one SGLang process (one scheduler rank)."""

    def __init__(self, labels: Optional[Mapping[str, str]] = None, *, export: bool = False,
                 registry: Any = None, counter_cls: Any = None, gauge_cls: Any = None):
        self.labels = dict(labels or {})
        self.totals: _Tally = _Tally()
        self._prom: dict[str, Any] = {}
        if export:
            self._init_prometheus(registry, counter_cls, gauge_cls)

    def _init_prometheus(self, registry: Any, counter_cls: Any, gauge_cls: Any) -> None:
        # Imported late: prometheus_client must see PROMETHEUS_MULTIPROC_DIR first (SGLang sets it).
        from prometheus_client import REGISTRY
        from prometheus_client import Counter as PromCounter
        from prometheus_client import Gauge as PromGauge

        counter_cls = counter_cls or PromCounter
        gauge_cls = gauge_cls or PromGauge
        registry = registry if registry is not None else REGISTRY
        names = list(self.labels)
        self._define_series(
            lambda key, doc, extra: counter_cls(name=f"sglang:histate_{key}", documentation=doc,
                                                labelnames=names + list(extra), registry=registry),
            lambda key, doc, extra: gauge_cls(name=f"sglang:histate_{key}", documentation=doc,
                                              labelnames=names + list(extra), multiprocess_mode="mostrecent",
                                              registry=registry))

    def export_through(self, collector: Any) -> None:
        """Create the series through SGLang's radix-cache collector (upstream/series 0004: `add_counter` /
        `add_gauge`): its rank labels and its metric backend (prometheus_client, or the one `stat_loggers`
        injects, e.g. Ray), instead of prometheus_client and labels of our own. What was recorded before
        (plain totals) is carried into the new series."""
        self.labels = dict(collector.labels)
        self._define_series(lambda key, doc, extra: collector.add_counter(f"histate_{key}", doc, extra),
                            lambda key, doc, extra: collector.add_gauge(f"histate_{key}", doc, extra))
        for tally_key, value in self.totals.items():
            key, values = (tally_key, ()) if isinstance(tally_key, str) else (tally_key[0], tally_key[1:])
            if value:
                bound = self._prom[key].labels(**self.labels, **dict(zip(self._extra_names[key], values)))
                bound.set(value) if key in GAUGES else bound.inc(value)

    def _define_series(self, make_counter: Any, make_gauge: Any) -> None:
        self._extra_names: dict[str, tuple] = {}

        def counter(key: str, doc: str, extra: tuple = ()) -> None:
            self._extra_names[key] = tuple(extra)
            self._prom[key] = make_counter(key, doc, tuple(extra))

        counter("prefix_hits_total", "Requests that resumed from a checkpoint, by the checkpoint's tier.",
                ("tier",))
        counter("reused_tokens_total", "Tokens reused without recomputation (KV + a checkpoint).")
        counter("input_tokens_total", "Tokens looked up in the cache (denominator of the hit rate).")
        counter("evictions_total", "Unified-eviction decisions by unit (intermediate checkpoint or "
                "terminal bundle: last KV segment + terminal checkpoint) and tier (device, host, storage).",
                ("unit", "tier"))
        counter("ssd_read_bytes_total", "Bytes read from HiState's SSD tier.")
        counter("ssd_written_bytes_total", "Bytes written to HiState's SSD tier.")
        counter("l3_pages_total", "KV pages and states read from the shared L3 (--histate-l3): 'hit' (loaded, "
                "exact size) or 'miss' (absent, evicted, a fault or a dead store service).", ("result",))
        counter("l3_read_bytes_total", "Bytes read from the shared L3 tier.")
        counter("l3_written_bytes_total", "Bytes written to the shared L3 tier.")
        counter("prefill_chunk_cuts_total", "Chunked-prefill cuts floored to the state grid so the next pass "
                "captures its planned checkpoints (no pass is added).", ("kind",))
        counter("short_prefill_passes_total", "Passes of a long chunked prefill under short-prefill-first: "
                "'capped' (waiting short prefills went first), 'aged' (ran uncapped after max-yields capped "
                "passes in a row).", ("result",))
        counter("captures_total", "Planned checkpoints of prefill passes: 'tracked' (SGLang's track slot), "
                "'extra' (a slot of their own, same pass), 'off_grid' / 'no_slot' / 'no_track' / 'unfilled' (dropped; 'unfilled': "
                "the forward did not write the slot in every recurrent layer).", ("result",))
        counter("checkpoints_homed_total", "Device or host copies of historical checkpoints dropped once "
                "their SSD copy was acknowledged (asymmetric tiering).")
        counter("kv_demoted_tokens_total", "Host KV tokens written to the SSD ahead of their eviction (the SSD "
                "is the host's victim tier for KV).")
        counter("ssd_restores_total", "Checkpoints restored from the SSD tier to a host slot; 'miss' when "
                "any rank could not read its copy (the request then runs without it).", ("result",))
        counter("ssd_restore_rechecks_total", "Admission rounds a request skipped so that an SSD checkpoint only its "
                "admission match found is restored first.")
        counter("state_writes_total", "Under --hicache-write-policy write_back: checkpoints written to the SSD at "
                "creation through a host staging slot; 'failed' when some rank's store does not hold it (the "
                "checkpoint keeps its device copy).", ("result",))
        counter("miss_tokens_total", "Prompt tokens not served from cache, by reason (--histate-miss-reasons; "
                "docs/misses.md): no_prefix, kv_evicted, state_evicted, no_checkpoint, not_restored, page_boundary.",
                ("reason",))
        counter("tool_wait_turns_total", "Tool-wait residency (--histate-tool-wait-prefetch on): 'held' (a finished "
                "turn's path held for its next turn), 'expired' (a hold let go at its deadline), 'back_in_time' / "
                "'back_late' (a held turn's continuation matched before / after its deadline).", ("event",))
        self._extra_names["checkpoints"] = ("tier",)
        self._prom["checkpoints"] = make_gauge("checkpoints", "Checkpoints resident per tier.", ("tier",))
        self._extra_names["host_write_policy"] = ("policy", "chosen_by")
        self._prom["host_write_policy"] = make_gauge(
            "host_write_policy", "1 on HiCache's host write policy: chosen_by 'operator' (--hicache-write-policy, "
            "or a record built without a command line) or 'histate' (the flag not given: write_back with an SSD "
            "tier, no L3 and a host KV pool at most 1.8x the device's).", ("policy", "chosen_by"))

    def _inc(self, key: str, amount: float, **extra: str) -> None:
        tally_key = key if not extra else (key, *extra.values())
        self.totals[tally_key] += amount
        series = self._prom.get(key)
        if series is not None and amount:
            series.labels(**self.labels, **extra).inc(amount)

    def record_lookup(self, input_tokens: int) -> None:
        """A request's first match."""
        self._inc("input_tokens_total", input_tokens)

    def record_hit(self, reused_tokens: int, tier: str) -> None:
        """A request's first pass resumes from a checkpoint `reused_tokens` deep that was in `tier`."""
        self._inc("reused_tokens_total", reused_tokens)
        self._inc("prefix_hits_total", 1, tier=tier)

    def record_misses(self, tokens_by_reason: Mapping[str, int]) -> None:
        """One request's uncached prompt tokens by reason (core/misses.py)."""
        for reason, num_tokens in tokens_by_reason.items():
            self._inc("miss_tokens_total", num_tokens, reason=reason)

    def record_tool_wait(self, event: str, count: int = 1) -> None:
        self._inc("tool_wait_turns_total", count, event=event)

    def record_eviction(self, unit: str, tier: int) -> None:
        self._inc("evictions_total", 1, unit=unit, tier=SGLANG_TIER_NAMES[tier])

    def record_ssd_io(self, *, read_bytes: int = 0, written_bytes: int = 0) -> None:
        if read_bytes:
            self._inc("ssd_read_bytes_total", read_bytes)
        if written_bytes:
            self._inc("ssd_written_bytes_total", written_bytes)

    def record_l3_io(self, *, hits: int = 0, misses: int = 0, read_bytes: int = 0, written_bytes: int = 0) -> None:
        if hits:
            self._inc("l3_pages_total", hits, result="hit")
        if misses:
            self._inc("l3_pages_total", misses, result="miss")
        if read_bytes:
            self._inc("l3_read_bytes_total", read_bytes)
        if written_bytes:
            self._inc("l3_written_bytes_total", written_bytes)

    def record_restore(self, *, ok: bool) -> None:
        self._inc("ssd_restores_total", 1, result="ok" if ok else "miss")

    def record_restore_recheck(self) -> None:
        self._inc("ssd_restore_rechecks_total", 1)

    def record_state_writes(self, *, stored: int, failed: int) -> None:
        if stored:
            self._inc("state_writes_total", stored, result="stored")
        if failed:
            self._inc("state_writes_total", failed, result="failed")

    def record_chunk_cut(self, kind: str) -> None:
        self._inc("prefill_chunk_cuts_total", 1, kind=kind)

    def record_short_prefill_pass(self, result: str) -> None:
        self._inc("short_prefill_passes_total", 1, result=result)

    def record_captures(self, result: str, count: int) -> None:
        if count:
            self._inc("captures_total", count, result=result)

    def record_demoted(self, num_tokens: int) -> None:
        self._inc("kv_demoted_tokens_total", num_tokens)

    def record_homed(self, count: int) -> None:
        self._inc("checkpoints_homed_total", count)

    def set_host_write_policy(self, policy: str, chosen_by: str) -> None:
        self.totals[("host_write_policy", policy, chosen_by)] = 1
        gauge = self._prom.get("host_write_policy")
        if gauge is not None:
            gauge.labels(**self.labels, policy=policy, chosen_by=chosen_by).set(1)

    def set_checkpoints(self, tier: str, count: int) -> None:
        self.totals[("checkpoints", tier)] = count
        gauge = self._prom.get("checkpoints")
        if gauge is not None:
            gauge.labels(**self.labels, tier=tier).set(count)


def shared_metrics(labels: Optional[Mapping[str, str]] = None, *, export: bool = False) -> HiStateMetrics:
    """The process-wide instance (the tree cache and the storage backend record into the same
    series; Prometheus refuses to register a series name twice in one process)."""
    key = tuple(sorted((labels or {}).items()))
    with _shared_lock:
        metrics = _shared.get(key)
        if metrics is None or (export and not metrics._prom):
            metrics = HiStateMetrics(labels, export=export)
            _shared[key] = metrics
        return metrics


def upstream_cache_series() -> bool:
    """Whether SGLang's radix-cache collector creates a cache backend's own series (upstream/series 0004:
    `RadixCacheMetricsCollector.add_counter` / `add_gauge`). Then HiState's series are made through the
    collector SGLang built for the cache, with its labels and metric backend."""
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    return hasattr(RadixCacheMetricsCollector, "add_counter")


def radix_cache_labels(cache_class_name: str) -> dict[str, str]:
    """SGLang's rank labels for cache series (same helper its RadixCacheMetricsCollector uses)."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.observability.metrics_collector import radix_cache_metric_labels
    from sglang.srt.runtime_context import get_observability, get_parallel

    labels = radix_cache_metric_labels(cache_class_name, get_parallel(), is_dp_attention_enabled())
    extra = get_observability().extra_metric_labels
    if extra:
        labels.update(extra)
    return labels
