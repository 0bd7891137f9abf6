"""Adaptive interval control (paper §3.2, eq. 3-6) and the residence-time EMAs it feeds on.

For a new segment of L pages the controller picks I* = argmin_I [C_mem(I) + C_recomp(I)] over the
supported set, with
    C_mem(I)    = (T_KV / T_state) * n_int(I) * N_s      (N_s: one checkpoint in pages of KV)
    C_recomp(I) = (1/L) * sum_{t=1}^{L-1} (t mod I)     (uniform hit position, p_t = 1/L)
Both are in pages. n_int(I) = ceil(L/I) - 1 counts the intermediate checkpoints exactly (the paper's
L/I also counts the terminal one, which is kept whatever I is, so it cannot change the argmin).

With a learned reuse-position prior (policy_state.py), p_t is no longer uniform near the segment's end:
an interior hit lands k pages before the end with probability p'_k and uniformly elsewhere with the
rest, u = 1 - sum(p'). Eq. 3 then becomes u * C_recomp(I) + sum_k p'_k * (distance from L - k back to
the nearest checkpoint), and eq. 5 also chooses which near-end positions L - k get a checkpoint
(`plan_positions`). With no learned mass it is the paper's rule, position for position.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from typing import Optional, Sequence


class Ema:
    """Exponential moving average that knows whether it has seen anything yet."""

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float, initial: Optional[float] = None):
        self.alpha = alpha
        self.value = initial

    def observe(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


def recompute_cost_pages(num_pages: int, interval_pages: int) -> float:
    """Eq. 3 with p_t = 1/L, in closed form: sum_{t<L} (t mod I) = q*I(I-1)/2 + r(r-1)/2."""
    if num_pages <= 0:
        return 0.0
    q, r = divmod(num_pages, interval_pages)
    total = q * interval_pages * (interval_pages - 1) // 2 + r * (r - 1) // 2
    return total / num_pages


def num_intermediate(num_pages: int, interval_pages: int) -> int:
    return max(0, math.ceil(num_pages / interval_pages) - 1)


def choose_interval_pages(
    num_pages: int, checkpoint_pages_equiv: float, pressure_ratio: float, supported: Sequence[int]
) -> int:
    """Eq. 5. `pressure_ratio` = T_KV / T_state. Ties go to the larger (sparser) interval."""
    best_i, best_cost = None, math.inf
    for interval in sorted(supported, reverse=True):
        cost = (pressure_ratio * num_intermediate(num_pages, interval) * checkpoint_pages_equiv
                + recompute_cost_pages(num_pages, interval))
        if cost < best_cost:
            best_i, best_cost = interval, cost
    return best_i


def near_end_recompute_pages(end_pages: int, near_end_probs: Sequence[float], checkpoints: Sequence[int]) -> float:
    """sum_k p'_k * ((end - k) - nearest checkpoint <= end - k), over near-end positions after the
    segment start. `checkpoints` is sorted and starts with the segment start."""
    cost = 0.0
    start = checkpoints[0]
    for k, prob in enumerate(near_end_probs, start=1):
        pos = end_pages - k
        if pos <= start or not prob:
            continue
        cost += prob * (pos - checkpoints[bisect_right(checkpoints, pos) - 1])
    return cost


def plan_positions(start_pages: int, end_pages: int, checkpoint_pages_equiv: float, pressure_ratio: float,
                   supported: Sequence[int], near_end_probs: Sequence[float] = ()) -> list[int]:
    """Eq. 5 over the interval grid and the near-end positions together: for each supported interval,
    add near-end checkpoints greedily while each lowers C_mem + C_recomp; keep the cheapest plan.
    Ties go to the larger interval. Returns the intermediate positions (the terminal is not included)."""
    num_pages = end_pages - start_pages
    uniform = 1.0 - sum(near_end_probs)
    one = pressure_ratio * checkpoint_pages_equiv  # C_mem of one checkpoint
    # A checkpoint at end - k serves at most the near-end mass of offsets 1..k, each at most the segment
    # away from the checkpoint before it: offsets whose bound cannot pay for a checkpoint are never chosen.
    reach, useful = 0.0, []
    for k, prob in enumerate(near_end_probs, start=1):
        reach += prob
        if prob > 0 and reach * num_pages > one and start_pages < end_pages - k:
            useful.append(end_pages - k)
    best_cost, best_plan = math.inf, []
    for interval in sorted(supported, reverse=True):
        grid = list(range(start_pages + interval, end_pages, interval))
        chosen = [start_pages] + grid
        cost = one * len(grid) + uniform * recompute_cost_pages(num_pages, interval)
        if near_end_probs:
            cost += near_end_recompute_pages(end_pages, near_end_probs, chosen)
            candidates = set(useful) - set(grid)
            while candidates:
                trial = min(((one + cost - near_end_recompute_pages(end_pages, near_end_probs, chosen)
                              + near_end_recompute_pages(end_pages, near_end_probs, sorted(chosen + [c])), c)
                             for c in candidates))
                if trial[0] >= cost - 1e-12:
                    break
                cost = trial[0]
                chosen = sorted(chosen + [trial[1]])
                candidates.discard(trial[1])
        if cost < best_cost:
            best_cost, best_plan = cost, chosen[1:]
    return best_plan


def continuous_optimum_pages(num_pages: int, checkpoint_pages_equiv: float, pressure_ratio: float) -> float:
    """Eq. 6: sqrt(2 L N_s T_KV/T_state), for documentation and tests of the discrete choice."""
    return math.sqrt(2.0 * num_pages * checkpoint_pages_equiv * pressure_ratio)


class TierFlow:
    """Bytes flowing into one tier, for Little's law: a full tier's mean residence time is its
    capacity divided by its insertion rate. It estimates T_KV / T_state before any eviction has been
    observed, when the EMAs have nothing to say (an empty tier's contents will stay about that long
    once it fills at today's rate)."""

    __slots__ = ("capacity_bytes", "first_write_s", "bytes_in")

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.first_write_s: Optional[float] = None
        self.bytes_in = 0

    def note(self, now_s: float, size_bytes: int) -> None:
        if self.first_write_s is None:
            self.first_write_s = now_s
        self.bytes_in += size_bytes

    def residence_s(self, now_s: Optional[float]) -> Optional[float]:
        if now_s is None or self.first_write_s is None or not self.bytes_in or now_s <= self.first_write_s:
            return None
        return self.capacity_bytes * (now_s - self.first_write_s) / self.bytes_in


class IntervalController:
    """Tracks T_KV and T_state and plans checkpoint positions for each new segment."""

    def __init__(self, checkpoint_pages_equiv: float, supported: Sequence[int], ema_alpha: float,
                 kv_flow: Optional[TierFlow] = None, state_flow: Optional[TierFlow] = None):
        self.checkpoint_pages_equiv = checkpoint_pages_equiv
        self.supported = tuple(supported)
        self.kv_residence_s = Ema(ema_alpha)  # how long KV keeps its place on the GPU
        self.state_residence_s = Ema(ema_alpha)  # how long a checkpoint survives in its home tier (SSD)
        self.first_state_write_s: Optional[float] = None
        self.kv_flow = kv_flow  # bytes into the GPU pool (Little's-law T_KV until one is observed)
        self.state_flow = state_flow  # bytes into the checkpoints' home tier (Little's-law T_state)

    def note_state_written(self, now_s: float) -> None:
        if self.first_state_write_s is None:
            self.first_state_write_s = now_s

    def pressure_ratio(self, now_s: Optional[float] = None) -> float:
        """T_KV / T_state; 1 while neither can be estimated.

        Observed residences (EMAs) are used once they exist. Before that, each is estimated by Little's
        law from its tier's capacity and insertion rate (`TierFlow`); T_state also has a censored lower
        bound: every checkpoint written so far is still in its home tier, so its residence is at least
        the age of the first one. Before any estimate, the ratio is the paper's neutral 1.
        """
        kv, st = self.kv_residence_s.value, self.state_residence_s.value
        if kv is None and self.kv_flow is not None:
            kv = self.kv_flow.residence_s(now_s)
        if st is None and now_s is not None:
            censored = now_s - self.first_state_write_s if self.first_state_write_s is not None else None
            little = self.state_flow.residence_s(now_s) if self.state_flow is not None else None
            st = max((x for x in (censored, little) if x is not None), default=None)
        if kv is None or st is None or st <= 0 or kv <= 0:
            return 1.0
        return kv / st

    def plan(self, start_pages: int, end_pages: int, now_s: Optional[float] = None,
             near_end_probs: Sequence[float] = ()) -> list[int]:
        """Checkpoint depths for the segment (start, end]; the terminal `end_pages` always included."""
        num_pages = end_pages - start_pages
        if num_pages <= 0:
            return []
        ratio = self.pressure_ratio(now_s)
        if not any(near_end_probs):
            interval = choose_interval_pages(num_pages, self.checkpoint_pages_equiv, ratio, self.supported)
            return list(range(start_pages + interval, end_pages, interval)) + [end_pages]
        return plan_positions(start_pages, end_pages, self.checkpoint_pages_equiv, ratio, self.supported,
                              near_end_probs) + [end_pages]
