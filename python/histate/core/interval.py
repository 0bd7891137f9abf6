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
(`plan_positions`). The interior hits beyond the near-end window are learned by absolute depth
(depth_prior.py): a depth bin's mass inside the segment sits at the bin's first page and is taken from
the uniform share. With no learned mass it is the paper's rule, position for position.
"""
from __future__ import annotations

import math
import heapq
from bisect import bisect_left, bisect_right, insort
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


def hit_points(start_pages: int, end_pages: int, near_end_probs: Sequence[float] = (),
               depth_bins: Sequence[tuple] = ()) -> dict:
    """position -> learned interior-hit mass inside (start, end): p'_k at end - k, and each depth bin's
    mass at its first page (a checkpoint there serves every hit of the bin; depth_prior.py)."""
    points: dict = {}
    for k, prob in enumerate(near_end_probs, start=1):
        pos = end_pages - k
        if prob and pos > start_pages:
            points[pos] = points.get(pos, 0.0) + prob
    for first, _last, mass in depth_bins:
        if mass and start_pages < first < end_pages:
            points[first] = points.get(first, 0.0) + mass
    return points


class _PointMass:
    """The learned hit mass as sorted positions with prefix sums: the recompute a set of checkpoints
    leaves on it, and what one more checkpoint saves."""

    __slots__ = ("positions", "prefix")

    def __init__(self, points: dict):
        self.positions = sorted(points)
        self.prefix = [0.0]
        for pos in self.positions:
            self.prefix.append(self.prefix[-1] + points[pos])

    def mass(self, lo: int, hi: int) -> float:
        """Mass at positions in [lo, hi)."""
        return self.prefix[bisect_left(self.positions, hi)] - self.prefix[bisect_left(self.positions, lo)]

    def grid_cost(self, start: int, interval: int) -> float:
        """sum of mass * (position - nearest checkpoint <= position) for the checkpoints start,
        start + interval, ... (every position lies past `start`, so the nearest one below is
        arithmetic: no search)."""
        total, prefix = 0.0, self.prefix
        for i, pos in enumerate(self.positions):
            total += (prefix[i + 1] - prefix[i]) * ((pos - start) % interval)
        return total

    def saving(self, checkpoints: Sequence[int], candidate: int, end_pages: int) -> float:
        """How much a checkpoint at `candidate` lowers `cost`: every hit from it to the next checkpoint
        resumes there instead of at the one before it."""
        i = bisect_right(checkpoints, candidate)
        nxt = checkpoints[i] if i < len(checkpoints) else end_pages
        return (candidate - checkpoints[i - 1]) * self.mass(candidate, nxt)


def plan_positions(start_pages: int, end_pages: int, checkpoint_pages_equiv: float, pressure_ratio: float,
                   supported: Sequence[int], near_end_probs: Sequence[float] = (),
                   depth_bins: Sequence[tuple] = ()) -> list[int]:
    """Eq. 5 over the interval grid and the learned hit positions together: for each supported interval,
    add checkpoints at learned positions (near-end offsets, depth bins) greedily while each lowers
    C_mem + C_recomp; keep the cheapest plan. Ties go to the larger interval. Returns the intermediate
    positions (the terminal is not included).

    The learned masses are shares of interior hits; the uniform share is what neither explains inside
    this segment: 1 - sum(p') - (depth mass inside the segment). A checkpoint's saving only shrinks as
    others are added (it serves fewer hits, from nearer), so the greedy is evaluated lazily."""
    num_pages = end_pages - start_pages
    depth_inside = sum(mass for _first, _last, mass in depth_bins)
    uniform = max(0.0, 1.0 - sum(near_end_probs) - depth_inside)
    one = pressure_ratio * checkpoint_pages_equiv  # C_mem of one checkpoint
    learned = _PointMass(hit_points(start_pages, end_pages, near_end_probs, depth_bins))
    # A checkpoint at c saves at most (c - start) * (mass at or after c): one that cannot pay for
    # itself that way is never chosen.
    # (position, its index in the sorted positions: the prefix sum below it).
    positions, prefix = learned.positions, learned.prefix
    useful = [(c, i) for i, c in enumerate(positions) if (c - start_pages) * (prefix[-1] - prefix[i]) > one]
    best_cost, best_plan = math.inf, []
    for interval in sorted(supported, reverse=True):
        num_grid = num_intermediate(num_pages, interval)
        cost = one * num_grid + uniform * recompute_cost_pages(num_pages, interval)
        if cost >= best_cost:
            # The learned part only adds (a non-negative recompute, and `one` per added checkpoint):
            # this interval cannot beat the best, and a tie goes to the larger one, already seen.
            continue
        grid = list(range(start_pages + interval, end_pages, interval))
        chosen = [start_pages] + grid
        if positions:
            cost += learned.grid_cost(start_pages, interval)
            # Each candidate's saving against the grid alone, by arithmetic: the grid point below it,
            # the next one (or the end), and the mass between (`_PointMass.saving`'s same terms).
            heap = []
            for c, at_c in useful:
                offset = (c - start_pages) % interval
                if not offset:
                    continue  # on the grid
                nxt = c - offset + interval
                mass = (prefix[bisect_left(positions, nxt)] if nxt < end_pages else prefix[-1]) - prefix[at_c]
                heap.append((-(offset * mass), c))
            heapq.heapify(heap)
            while heap:
                _bound, c = heapq.heappop(heap)
                saving = learned.saving(chosen, c, end_pages)
                stale = heap and (-saving, c) > heap[0]  # another candidate may be better now
                if saving <= one + 1e-12:
                    if stale:
                        continue  # savings only shrink: this one can never pay for itself, drop it
                    break  # the best saving left cannot pay for a checkpoint
                if stale:
                    heapq.heappush(heap, (-saving, c))
                    continue
                cost -= saving - one
                insort(chosen, c)
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
             near_end_probs: Sequence[float] = (), depth_bins: Sequence[tuple] = ()) -> list[int]:
        """Checkpoint depths for the segment (start, end]; the terminal `end_pages` always included.
        `depth_bins`: the depth prior's bins inside the segment (DepthPrior.bins_in)."""
        num_pages = end_pages - start_pages
        if num_pages <= 0:
            return []
        ratio = self.pressure_ratio(now_s)
        if not any(near_end_probs) and not depth_bins:
            interval = choose_interval_pages(num_pages, self.checkpoint_pages_equiv, ratio, self.supported)
            return list(range(start_pages + interval, end_pages, interval)) + [end_pages]
        return plan_positions(start_pages, end_pages, self.checkpoint_pages_equiv, ratio, self.supported,
                              near_end_probs, depth_bins) + [end_pages]
