"""Token and time scale of a workload: the scaled-down runs a CPU server can serve in minutes.

Token scale s = 1/k (k a positive integer) merges every k consecutive pages of a request into one
page: the new page's key is the key of the last page of its group. Keys are prefix-chained, so that
key still names the whole prefix up to the group's end, and two requests share n scaled pages exactly
when they share the first n * k original pages (a prefix shared up to mid-group is lost: the scaled
workload shares at the granularity of k pages). Input lengths become floor(L / k) (which keeps one key
per full page), outputs max(1, round(O / k)). Page size stays the same, so the cache sees pages of the
usual size and the prompts' block structure is the trace's, coarser.

Time scale t multiplies every think/tool gap and arrival offset (0.1 = ten times faster agents).

`histate bench` and the replay it is compared with apply the same `scale_workload` to the same loaded
workload, so both see identical requests.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..sim.request import Request, Session, Workload, WorkloadStats


def pages_per_scaled_page(token_scale: float) -> int:
    """k for a token scale of 1/k; anything else is refused (pages cannot be split)."""
    if not (0 < token_scale <= 1) or not math.isfinite(token_scale):
        raise ValueError(f"token scale must be in (0, 1], got {token_scale}")
    k = round(1 / token_scale)
    if abs(k * token_scale - 1) > 1e-6:
        raise ValueError(f"token scale must be 1/k for an integer k (0.5, 0.25, 0.0625 ...), got {token_scale}")
    return k


def scale_workload(workload: Workload, token_scale: float = 1.0, time_scale: float = 1.0) -> Workload:
    if not (time_scale >= 0) or not math.isfinite(time_scale):
        raise ValueError(f"time scale must be >= 0, got {time_scale}")
    k = pages_per_scaled_page(token_scale)
    if k == 1 and time_scale == 1:
        return workload
    stats = WorkloadStats()
    stats.merge(workload.stats)
    stats.input_tokens = stats.output_tokens = 0
    sessions = [_scale_session(s, k, time_scale, stats) for s in workload.sessions]
    params = {**workload.params, "token_scale": token_scale, "time_scale": time_scale}
    return replace(workload, name=f"{workload.name} (tokens x{token_scale:g}, time x{time_scale:g})",
                   sessions=sessions, stats=stats, params=params)


def _scale_session(session: Session, k: int, time_scale: float, stats: WorkloadStats) -> Session:
    requests = tuple(_scale_request(r, k, time_scale, stats) for r in session.requests)
    children = tuple(_scale_session(c, k, time_scale, stats) for c in session.subagents)
    return replace(session, requests=requests, subagents=children,
                   start_offset_s=session.start_offset_s * time_scale)


def _scale_request(req: Request, k: int, time_scale: float, stats: WorkloadStats) -> Request:
    num_pages = len(req.page_keys)
    # Output pages continue the prompt's page numbering: page p (0-based) ends a group when (p+1) % k == 0.
    output_keys = tuple(key for i, key in enumerate(req.output_page_keys) if (num_pages + i + 1) % k == 0)
    scaled = replace(req, input_num_tokens=req.input_num_tokens // k,
                     output_num_tokens=max(1, round(req.output_num_tokens / k)),
                     page_keys=req.page_keys[k - 1::k], output_page_keys=output_keys,
                     gap_before_s=req.gap_before_s * time_scale, offset_s=req.offset_s * time_scale)
    stats.input_tokens += scaled.input_num_tokens
    stats.output_tokens += scaled.output_num_tokens
    return scaled
