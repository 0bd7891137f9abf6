"""Capacity at a latency target: how many concurrent agent sessions one GPU sustains.

Operators size fleets by the load a server carries within a latency target, not by hit rate
(kv-cache-tester's `working_set_tester`: the most users with p95 TTFT <= 2 s). Here the load knob is
the replay's live-session limit (`ReplayConfig.max_live_sessions`: how many root sessions run at once;
the next one starts when one ends), and the capacity of a policy is the largest limit whose replay
meets every target (p95 TTFT <= 2 s and p99 <= 5 s by default).

The search assumes that latency grows with load, which holds for the aggregate but not probe by
probe: a replay at a higher limit reorders arrivals and can come out slightly faster. It therefore
never reports a limit above one that failed: it grows the limit geometrically from `start` until a
probe fails, then bisects between the highest passing and the lowest failing probe. Every probe is
kept (`CapacityResult.probes`) for the latency-against-load plot, and `non_monotone` flags a search
where a lower limit failed although a higher one passed. Pure: the measurement is a callable.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

DEFAULT_TARGETS = {"ttft_p95_s": 2.0, "ttft_p99_s": 5.0}


@dataclass
class CapacityResult:
    capacity: int                # the largest passing limit (0: even `min_sessions` fails)
    probes: dict = field(default_factory=dict)  # limit -> the measured metrics
    capped: bool = False         # `max_sessions` passed: the capacity is at least this, maybe more

    def passed(self, limit: int, targets: Mapping[str, float]) -> bool:
        return meets(self.probes[limit], targets)

    def non_monotone(self, targets: Mapping[str, float]) -> bool:
        """A probe failed below a limit that passed (the search then trusts the failure)."""
        failed = [k for k, m in self.probes.items() if not meets(m, targets)]
        passed = [k for k, m in self.probes.items() if meets(m, targets)]
        return bool(failed and passed and min(failed) < max(passed))


def meets(metrics: Mapping[str, float], targets: Mapping[str, float]) -> bool:
    """Every target met; a missing or NaN metric fails (a run that served nothing sustains nothing)."""
    for name, bound in targets.items():
        value = metrics.get(name)
        if value is None or not value <= bound:
            return False
    return True


def find_capacity(measure: Callable[[int], Mapping[str, float]], targets: Mapping[str, float] = DEFAULT_TARGETS,
                  start: int = 16, min_sessions: int = 1, max_sessions: int = 256,
                  growth: float = 1.5, known: Optional[Mapping[int, Mapping[str, float]]] = None) -> CapacityResult:
    """The largest live-session limit in [min_sessions, max_sessions] meeting `targets` (module docstring).
    `known`: probes measured before (a resumed search), reused instead of measured again."""
    if not 1 <= min_sessions <= start <= max_sessions:
        raise ValueError(f"need 1 <= min_sessions <= start <= max_sessions, got {min_sessions}, {start}, {max_sessions}")
    if growth <= 1:
        raise ValueError(f"growth must be > 1, got {growth}")
    result = CapacityResult(0, dict(known or {}))

    def ok(limit: int) -> bool:
        if limit not in result.probes:
            result.probes[limit] = dict(measure(limit))
        return meets(result.probes[limit], targets)

    lo, hi = 0, None  # highest limit that passed (0: none yet), lowest that failed
    limit = start
    if ok(limit):
        lo = limit
        while lo < max_sessions:
            limit = min(max_sessions, max(lo + 1, int(lo * growth)))
            if not ok(limit):
                hi = limit
                break
            lo = limit
        else:
            result.capacity, result.capped = lo, True
            return result
    else:
        hi = limit
        while hi > min_sessions:
            limit = max(min_sessions, min(hi - 1, int(hi / growth)))
            if ok(limit):
                lo = limit
                break
            hi = limit
        else:
            return result  # even min_sessions fails: capacity 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    result.capacity = lo
    return result
