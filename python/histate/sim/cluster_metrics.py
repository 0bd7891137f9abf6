"""Cluster-mode metrics over a `cluster.ClusterRun` (pure; report text only, no I/O).

Per server: token hit rate (reused / input tokens of the requests it served) and L3 hit tokens.
Cluster: the same over every request, TTFT mean / p50 / p95 / p99 (metrics.summarize), L3 bytes
written / read and peak occupancy. After a failure: the TTFT of each moved session's first request
after the move, and -- given a run of the same workload without the failure -- the TTFT of the same
requests there (requests are identified by uid, which both runs share). All numbers are simulated.
"""
from __future__ import annotations

import math
from typing import Optional

from .metrics import PolicyRun, percentile, summarize


def as_policy_run(run) -> PolicyRun:
    """The cluster's records as a PolicyRun (the single-server summary and report read these)."""
    return PolicyRun(run.policy, run.records, None, {}, run.wall_s)


def _ttft_stats(ttfts: list) -> dict:
    return {"count": len(ttfts), "mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
            "p50_s": percentile(ttfts, 50), "p95_s": percentile(ttfts, 95)}


def summarize_cluster(run, baseline=None) -> dict:
    """`baseline`: the same workload's ClusterRun without the failure (paired moved-session TTFTs)."""
    overall = summarize(as_policy_run(run))
    servers = []
    for s in run.servers:
        servers.append({"server": s.index, "requests": s.requests,
                        "token_hit_rate": s.reused_tokens / s.input_tokens if s.input_tokens else math.nan,
                        "l3_hit_tokens": s.l3_hit_tokens, "failed_at_s": s.failed_at_s})
    out = {"policy": run.policy, "servers": servers, "l3": run.has_l3,
           "requests": overall["requests"], "token_hit_rate": overall["token_hit_rate"],
           "l3_hit_tokens": sum(run.l3_hit_tokens_by_uid.values()),
           "ttft_mean_s": overall["ttft_mean_s"], "ttft_p50_s": overall["ttft_p50_s"],
           "ttft_p95_s": overall["ttft_p95_s"], "ttft_p99_s": overall["ttft_p99_s"],
           "retried_requests": len(run.retried_uids), "moved_sessions": len(run.moved_roots)}
    if run.l3_stats is not None:
        st = run.l3_stats
        out.update(l3_bytes_written=st.bytes_written, l3_bytes_read=st.bytes_read,
                   l3_peak_used_bytes=st.peak_used_bytes, l3_evicted_objects=st.evicted_objects,
                   l3_puts_rejected=st.puts_rejected)
    if run.first_after_move_uids:
        out["moved_first_ttft"] = _ttft_stats(moved_first_ttfts(run))
        if baseline is not None:
            out["moved_first_ttft_without_failure"] = _ttft_stats(moved_first_ttfts(baseline,
                                                                                    run.first_after_move_uids))
    return out


def moved_first_ttfts(run, uids: Optional[list] = None) -> list:
    """TTFTs of `uids` in `run` (default: its own first-after-move requests), in `uids` order."""
    wanted = run.first_after_move_uids if uids is None else uids
    by_uid = {r.uid: r for r in run.records}
    return [by_uid[u].ttft_s for u in wanted if u in by_uid and not math.isnan(by_uid[u].first_token_s)]


def format_cluster_table(summaries: dict) -> str:
    """One line per policy, then per-server hit rates; every number is simulated."""
    head = (f"{'policy':<16} {'L3':>3} {'hit rate':>8} {'L3 hit Mtok':>11} {'TTFT mean':>9} {'p50':>7} {'p95':>7} "
            f"{'p99':>7} {'L3 GB wr/rd/peak':>18} {'moved first TTFT (no fail)':>27}")
    lines = ["cluster (simulated)", head, "-" * len(head)]
    for name, s in summaries.items():
        l3 = (f"{s['l3_bytes_written'] / 1e9:.0f}/{s['l3_bytes_read'] / 1e9:.0f}/{s['l3_peak_used_bytes'] / 1e9:.0f}"
              if "l3_bytes_written" in s else "-")
        moved = "-"
        if "moved_first_ttft" in s:
            moved = f"{s['moved_first_ttft']['mean_s']:.2f} s x{s['moved_first_ttft']['count']}"
            if "moved_first_ttft_without_failure" in s:
                moved += f" ({s['moved_first_ttft_without_failure']['mean_s']:.2f} s)"
        lines.append(f"{name:<16} {'yes' if s['l3'] else 'no':>3} {s['token_hit_rate'] * 100:7.2f}% "
                     f"{s['l3_hit_tokens'] / 1e6:11.2f} {s['ttft_mean_s']:8.3f}s {s['ttft_p50_s']:6.2f}s "
                     f"{s['ttft_p95_s']:6.2f}s {s['ttft_p99_s']:6.2f}s {l3:>18} {moved:>27}")
        per = ", ".join(f"{v['server']}: {v['token_hit_rate'] * 100:.1f}%" + (" (failed)" if v["failed_at_s"] is not None
                                                                              else "") for v in s["servers"])
        lines.append(f"  per-server hit rate: {per}")
    lines.append("L3 = shared Mooncake-model store (histate and sglang-hicache only; other policies run without it); "
                 "moved first TTFT = mean TTFT of each moved session's first request after the failure, "
                 "in parentheses the same requests in a run without the failure")
    return "\n".join(lines)
