"""Why did a policy reuse fewer tokens than `unlimited` (or than another policy)? Per request, per cause.

`histate replay --explain POLICY[,POLICY]` attaches an `EvictionLog` (a `histate.core.CacheObserver`)
to each named policy's cache, then attributes, for every request, the pages the policy failed to reuse
against a reference run (`unlimited`, the reuse ceiling, and each other named policy):

  kv_evicted        the KV of the first page past the policy's KV match had been in its cache and was
                    evicted before the request matched (which unit, when, evicted while serving which
                    request: the competing insert);
  kv_never_cached   that page never entered the policy's cache (an insert that failed, KV an engine
                    does not keep, pages another policy caches and this one never does);
  state_evicted     the KV stayed, but the deepest checkpoint that had ever existed between the reused
                    position and the hit was evicted (its unit, and eq. 7's t, C, M when it was chosen);
  no_checkpoint     the KV stayed and no checkpoint had ever been placed between the reused position and
                    the hit (admission: the hit landed inside a segment, away from every checkpoint);
  not_restorable    a checkpoint nearer the hit still existed when the request matched, yet was not used
                    (hit granularity, restore faults).

"Before the request matched": at its first admission, not its arrival. SGLang pins a prefix only once it
admits the request, so a request waiting in the queue loses what the cache evicts in the meantime; that
loss is an eviction (`RequestRecord.matched_s`; records without it are judged at their arrival).

Pages are attributed from the hit downwards: [m, ref) to a KV cause, then [c, min(m, ref)) to a state
cause (c = pages reused, m = KV pages matched, ref = the reference's c; DESIGN.md hit accounting).
The sum of the causes equals the policy's loss against the reference, request by request (tested).
Pure Python over the records and the log; no I/O.
"""
from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from ..core import CacheObserver, ItemKind, Tier, UnitKind
from .metrics import PolicyRun
from .request import Workload

CAUSES = ("kv_evicted", "kv_never_cached", "state_evicted", "no_checkpoint", "not_restorable")


@dataclass(frozen=True, slots=True)
class Eviction:
    """One eviction decision, as the evictor saw it."""

    time_s: float
    during_uid: Optional[int]  # the request being served when it happened (the competing insert)
    unit: str                  # "bundle" | "checkpoint"
    tier: str
    depth_pages: int           # end of the evicted node
    num_pages: int             # its KV segment length
    t_last_s: float            # eq. 7 terms at that moment (HiState's definitions of C and M)
    cost_tokens: float
    reclaim_tokens: float
    score: float


class EvictionLog(CacheObserver):
    """Records, per page key, when its KV and any checkpoint at it appeared and vanished, and why.

    Keys are prefix-chained (sim/request.py), so a key names one prefix: what happened to a key is what
    happened to that prefix, whichever session asks for it later.
    """

    def __init__(self) -> None:
        self.current_uid: Optional[int] = None  # set by the replay driver around cache calls
        self.evictions: list[Eviction] = []
        self._evicting: dict = {}  # id(node) -> index of the eviction in progress for that node
        self.kv_gone: dict = defaultdict(list)     # key -> [(time, eviction index or -1 for a fault)]
        self.ckpt_put: dict = defaultdict(list)    # key -> [time]
        self.ckpt_gone: dict = defaultdict(list)   # key -> [(time, eviction index or -1)]

    def set_request(self, uid: Optional[int]) -> None:
        self.current_uid = uid
        self._evicting.clear()

    # --- CacheObserver --------------------------------------------------------------------------

    def on_unit_evicted(self, node, unit: UnitKind, tier: Tier, now_s: float, terms: tuple) -> None:
        t_last, cost, reclaim, score = terms
        self._evicting[id(node)] = len(self.evictions)
        self.evictions.append(Eviction(now_s, self.current_uid, unit.value, tier.name, node.depth_pages,
                                       len(node.keys), t_last, cost, reclaim, score))

    def on_item_gone(self, node, kind: ItemKind, now_s: float) -> None:
        index = self._evicting.get(id(node), -1)  # -1: not an eviction (a reported fault)
        if kind is ItemKind.KV:
            for key in node.keys:
                self.kv_gone[key].append((now_s, index))
        else:
            self.ckpt_gone[node.keys[-1]].append((now_s, index))

    def on_checkpoint_put(self, node, tier: Tier, now_s: float) -> None:
        self.ckpt_put[node.keys[-1]].append(now_s)

    # --- queries at a request's arrival ----------------------------------------------------------

    @staticmethod
    def _last_before(events: list, time_s: float):
        """The latest (time, index) event strictly before `time_s`, or None."""
        i = bisect.bisect_left(events, (time_s, -2))
        return events[i - 1] if i else None

    def kv_eviction_before(self, key, time_s: float):
        return self._last_before(self.kv_gone.get(key, ()), time_s)

    def checkpoint_state_before(self, key, time_s: float) -> Optional[str]:
        """'alive', 'gone' or None (never placed) for a checkpoint at `key` just before `time_s`."""
        puts = self.ckpt_put.get(key)
        if not puts or puts[0] >= time_s:
            return None
        last_put = puts[bisect.bisect_left(puts, time_s) - 1]
        gone = self._last_before(self.ckpt_gone.get(key, ()), time_s)
        return "gone" if gone is not None and gone[0] >= last_put else "alive"


@dataclass
class Attribution:
    """One request's loss against the reference, split by cause (pages)."""

    uid: int
    session_id: str
    arrival_s: float
    loss_pages: int
    pages_by_cause: dict = field(default_factory=dict)
    eviction: Optional[int] = None  # the eviction behind the largest evicted share, if any
    matched_s: Optional[float] = None  # when it matched the cache (its first admission); causes are judged there


def attribute(workload: Workload, run: PolicyRun, reference: PolicyRun, log: EvictionLog) -> list[Attribution]:
    """Per-request attribution of `run`'s loss against `reference` (requests where it reused less)."""
    page = workload.page_num_tokens
    requests = {r.uid: r for r in workload.iter_requests()}
    ref = reference.by_uid()
    out = []
    for rec in sorted(run.records, key=lambda r: r.arrival_s):
        # What the cache held when the request matched, not when it arrived: a request waiting in the
        # queue loses what is evicted in between (SGLang pins a prefix only once a request is admitted).
        matched_s = rec.arrival_s if rec.matched_s is None else rec.matched_s
        other = ref.get(rec.uid)
        if other is None:
            continue
        c, m, target = rec.reused_tokens // page, rec.kv_hit_tokens // page, other.reused_tokens // page
        if target <= c:
            continue
        keys = requests[rec.uid].page_keys
        causes: dict = {}
        eviction = None
        if m < target:  # the KV of page m is missing
            event = log.kv_eviction_before(keys[m], matched_s)
            cause = "kv_evicted" if event is not None else "kv_never_cached"
            causes[cause] = target - m
            if event is not None and event[1] >= 0:
                eviction = event[1]
        top = min(m, target)
        if top > c:  # KV of [c, top) is there; no usable checkpoint in (c, top]
            deepest, state = None, None
            for depth in range(top, c, -1):
                state = log.checkpoint_state_before(keys[depth - 1], matched_s)
                if state is not None:
                    deepest = depth
                    break
            if deepest is None:
                causes["no_checkpoint"] = causes.get("no_checkpoint", 0) + top - c
            else:
                cause = "state_evicted" if state == "gone" else "not_restorable"
                causes[cause] = causes.get(cause, 0) + deepest - c
                if top > deepest:
                    causes["no_checkpoint"] = causes.get("no_checkpoint", 0) + top - deepest
                if state == "gone" and (eviction is None or deepest - c > causes.get("kv_evicted", 0)):
                    gone = log._last_before(log.ckpt_gone[keys[deepest - 1]], matched_s)
                    if gone is not None and gone[1] >= 0:
                        eviction = gone[1]
        out.append(Attribution(rec.uid, rec.session_id, rec.arrival_s, target - c, causes, eviction, matched_s))
    return out


def summarize_attribution(attributions: Sequence[Attribution], log: EvictionLog, page_num_tokens: int,
                          runs_by_uid: Mapping[int, object], top: int = 10) -> dict:
    """Totals per cause (tokens and shares), who evicted what, score terms at eviction, worst requests."""
    total = defaultdict(int)
    for a in attributions:
        for cause, pages in a.pages_by_cause.items():
            total[cause] += pages
    lost = sum(total.values())
    summary = {
        "requests_with_loss": len(attributions),
        "lost_tokens": lost * page_num_tokens,
        "by_cause": {c: {"tokens": total[c] * page_num_tokens, "share": (total[c] / lost if lost else 0.0)}
                     for c in CAUSES},
    }
    evicted = [(a, log.evictions[a.eviction]) for a in attributions if a.eviction is not None]
    if evicted:
        same = sum(1 for a, e in evicted if e.during_uid is not None
                   and getattr(runs_by_uid.get(e.during_uid), "session_id", None) == a.session_id)
        summary["evictions_behind_losses"] = {
            "count": len(evicted),
            "by_own_session_insert": same,
            "by_other_session_insert": len(evicted) - same,
            "by_unit": _count(e.unit for _, e in evicted),
            "by_tier": _count(e.tier for _, e in evicted),
            "median_idle_before_eviction_s": statistics.median(e.time_s - e.t_last_s for _, e in evicted),
            "median_eviction_to_reuse_s": statistics.median(a.matched_s - e.time_s for a, e in evicted),
            "median_cost_tokens": statistics.median(e.cost_tokens for _, e in evicted),
            "median_reclaim_tokens": statistics.median(e.reclaim_tokens for _, e in evicted),
        }
    worst = sorted(attributions, key=lambda a: -a.loss_pages)[:top]
    summary["worst_requests"] = [
        {"uid": a.uid, "session": a.session_id, "arrival_s": round(a.arrival_s, 3), "matched_s": round(a.matched_s, 3),
         "lost_tokens": a.loss_pages * page_num_tokens,
         "by_cause": {c: p * page_num_tokens for c, p in a.pages_by_cause.items()},
         "eviction": (_eviction_dict(log.evictions[a.eviction]) if a.eviction is not None else None)}
        for a in worst]
    return summary


def _count(items) -> dict:
    out: dict = defaultdict(int)
    for x in items:
        out[x] += 1
    return dict(out)


def _eviction_dict(e: Eviction) -> dict:
    return {"time_s": round(e.time_s, 3), "during_uid": e.during_uid, "unit": e.unit, "tier": e.tier,
            "depth_tokens": None if e.depth_pages is None else e.depth_pages, "t_last_s": round(e.t_last_s, 3),
            "C_tokens": round(e.cost_tokens, 1), "M_tokens": round(e.reclaim_tokens, 1), "score": round(e.score, 3)}


def explain(workload: Workload, runs: Mapping[str, PolicyRun], logs: Mapping[str, EvictionLog],
            references: Sequence[str] = ("unlimited",)) -> dict:
    """For each explained policy (a key of `logs`) and each reference run: the attribution summary."""
    report = {}
    page = workload.page_num_tokens
    for policy, log in logs.items():
        run = runs[policy]
        per_ref = {}
        for ref in references:
            if ref == policy or ref not in runs:
                continue
            atts = attribute(workload, run, runs[ref], log)
            per_ref[ref] = summarize_attribution(atts, log, page, run.by_uid())
        report[policy] = per_ref
    return report


def format_explain(report: Mapping[str, dict]) -> str:
    """The printed table: lost tokens per cause for each (policy, reference) pair."""
    lines = []
    header = f"{'policy':>18} {'vs':>16} {'lost tokens':>13} " + " ".join(f"{c:>16}" for c in CAUSES)
    lines.append(header)
    for policy, per_ref in report.items():
        for ref, s in per_ref.items():
            shares = " ".join(f"{100 * s['by_cause'][c]['share']:>15.1f}%" for c in CAUSES)
            lines.append(f"{policy:>18} {ref:>16} {s['lost_tokens']:>13,} {shares}")
    for policy, per_ref in report.items():
        for ref, s in per_ref.items():
            ev = s.get("evictions_behind_losses")
            if ev:
                lines.append(
                    f"{policy} vs {ref}: {ev['count']} losses traced to an eviction "
                    f"({ev['by_other_session_insert']} while serving another session, {ev['by_own_session_insert']} its own); "
                    f"units {ev['by_unit']}, tiers {ev['by_tier']}; median idle before eviction "
                    f"{ev['median_idle_before_eviction_s']:.0f} s, eviction to reuse {ev['median_eviction_to_reuse_s']:.0f} s, "
                    f"C {ev['median_cost_tokens']:.0f} tok, M {ev['median_reclaim_tokens']:.0f} tok")
    return "\n".join(lines)
