"""The capacity search (sim/capacity.py) against latency curves whose answer is known by hand."""
import math

import pytest

from histate.sim.capacity import find_capacity, meets

TARGETS = {"ttft_p95_s": 2.0, "ttft_p99_s": 5.0}


def curve(p95_slope: float, p99_slope: float = 0.0):
    """p95 = slope x sessions (p99 likewise): passes up to floor(2 / slope) sessions."""
    calls = []

    def measure(n: int) -> dict:
        calls.append(n)
        return {"ttft_p95_s": p95_slope * n, "ttft_p99_s": p99_slope * n}
    return measure, calls


@pytest.mark.parametrize("slope, expected", [(0.1, 20), (0.05, 40), (0.5, 4), (2.0, 1), (2.5, 0), (0.001, 256)])
def test_finds_the_largest_passing_limit(slope, expected):
    measure, calls = curve(slope)
    result = find_capacity(measure, TARGETS, start=16)
    assert result.capacity == expected
    assert result.capped == (expected == 256)
    assert len(calls) == len(set(calls))  # no limit measured twice
    assert len(calls) <= 20


def test_p99_target_binds_too():
    measure, _ = curve(0.01, p99_slope=0.25)  # p95 passes to 200, p99 only to 20
    assert find_capacity(measure, TARGETS).capacity == 20


def test_a_nan_or_missing_metric_fails():
    assert not meets({"ttft_p95_s": math.nan, "ttft_p99_s": 1.0}, TARGETS)
    assert not meets({"ttft_p95_s": 1.0}, TARGETS)
    assert meets({"ttft_p95_s": 2.0, "ttft_p99_s": 5.0}, TARGETS)  # the bounds are inclusive


def test_never_reports_above_a_failure_and_flags_non_monotone_probes():
    # passes at 16, fails at 24, "passes" again at 20 and 22 (noise), fails at 23: capacity 22, and
    # a probe at 17 that failed would be flagged.
    table = {16: 1.0, 24: 3.0, 20: 1.9, 22: 1.9, 23: 2.1}
    result = find_capacity(lambda n: {"ttft_p95_s": table[n], "ttft_p99_s": 0}, TARGETS, start=16)
    assert result.capacity == 22
    assert not result.non_monotone(TARGETS)
    result.probes[17] = {"ttft_p95_s": 9.0, "ttft_p99_s": 0}
    assert result.non_monotone(TARGETS)


def test_known_probes_are_reused():
    measure, calls = curve(0.1)
    known = {16: {"ttft_p95_s": 1.6, "ttft_p99_s": 0.0}, 24: {"ttft_p95_s": 2.4, "ttft_p99_s": 0.0}}
    assert find_capacity(measure, TARGETS, start=16, known=known).capacity == 20
    assert 16 not in calls and 24 not in calls


def test_bad_arguments():
    with pytest.raises(ValueError):
        find_capacity(lambda n: {}, TARGETS, start=0)
    with pytest.raises(ValueError):
        find_capacity(lambda n: {}, TARGETS, growth=1.0)
