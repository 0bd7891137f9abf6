"""`interval.plan_positions` against a plain reading of its docstring, on random segments and priors.

The reference below restates eq. 5 with learned hit positions the slow way, sharing nothing with the
planner but `recompute_cost_pages` (eq. 3's closed form, tested by hand in test_interval_by_hand.py):
every interval is planned in full (no bound skips one), each candidate's saving is recomputed from the
definition (the hit mass between it and the next checkpoint, times how much nearer it is) against
the checkpoints chosen so far, and the greedy is eager: each round takes the largest saving (the
smallest position on a tie) while it exceeds one checkpoint's cost. The planner computes the same
thing with arithmetic on the grid, a lazy heap and a bound that skips intervals that cannot win; any
difference in the positions it returns is a bug in one of those shortcuts.
"""
import math
import random

from histate.core.interval import hit_points, plan_positions, recompute_cost_pages

SUPPORTED = (2, 4, 8, 16, 32, 64)


def _reference(start: int, end: int, ns: float, ratio: float, supported, near_end, depth_bins) -> list:
    points = hit_points(start, end, near_end, depth_bins)
    uniform = max(0.0, 1.0 - sum(near_end) - sum(mass for _, _, mass in depth_bins))
    one = ratio * ns

    def learned_cost(chosen):
        return sum(mass * (pos - max(c for c in chosen if c <= pos)) for pos, mass in sorted(points.items()))

    def saving(chosen, c):
        below = max(x for x in chosen if x <= c)
        nxt = min([x for x in chosen if x > c] + [end])
        return (c - below) * sum(mass for pos, mass in points.items() if c <= pos < nxt)

    best_cost, best = math.inf, []
    for interval in sorted(supported, reverse=True):
        chosen = [start, *range(start + interval, end, interval)]
        cost = one * (len(chosen) - 1) + uniform * recompute_cost_pages(end - start, interval) + learned_cost(chosen)
        while True:
            gains = [(saving(chosen, c), -c) for c in points if c not in chosen]
            if not gains:
                break
            gain, neg_c = max(gains)
            if gain <= one + 1e-12:
                break
            cost -= gain - one
            chosen = sorted([*chosen, -neg_c])
        if cost < best_cost - 1e-12:
            best_cost, best = cost, chosen[1:]
    return best


def _case(rng: random.Random) -> tuple:
    start = rng.choice([0, rng.randrange(1, 400)])
    end = start + rng.randrange(1, 300)
    near_end = tuple(rng.choice([0.0, rng.random() * 0.2]) for _ in range(rng.randrange(0, 12)))
    depth_bins, first = [], 0
    for _ in range(rng.randrange(0, 8)):
        first += rng.randrange(1, 80)
        depth_bins.append((first, first + rng.randrange(0, 40), rng.random() * 0.1))
    inside = tuple(b for b in depth_bins if start < b[0] < end)
    return start, end, rng.choice([0.5, 1.0, 4.0, 16.0]), rng.choice([0.05, 0.3, 1.0, 3.0]), near_end, inside


def test_the_planner_returns_what_the_slow_reading_of_eq5_returns():
    rng = random.Random(20261205)
    learned = 0
    for _ in range(1500):
        start, end, ns, ratio, near_end, depth_bins = _case(rng)
        got = plan_positions(start, end, ns, ratio, SUPPORTED, near_end, depth_bins)
        want = _reference(start, end, ns, ratio, SUPPORTED, near_end, depth_bins)
        assert got == want, (start, end, ns, ratio, near_end, depth_bins)
        learned += bool(set(got) - set(range(start, end, 2)))
    assert learned > 100  # the learned positions, not only the grid, were exercised
