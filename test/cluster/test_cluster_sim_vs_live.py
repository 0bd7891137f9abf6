"""The simulator's cluster mode against the loopback cluster on the same sessions (issue 18: within 5
points before it extrapolates to 16 servers). One small `histate cluster` run (2 workers, 6 sessions x
3 turns, all three runs), then each run's twin in the simulator (histate/cluster/sim_twin.py: the live
placement, the live kill point, L3 on/off, the workers' budgets). Skipped like the other cluster
tests when sglang-router, the workers' dependencies or Mooncake are missing."""
import math
from argparse import Namespace

import pytest

from histate.cli import main as histate_main
from histate.cli import cluster_workload
from histate.cluster.sim_twin import MiB, TwinOptions, compare, format_table, max_gap_points, read_live

TOLERANCE_POINTS = 5.0


@pytest.fixture(scope="module")
def live_dir(tmp_path_factory):
    from histate.l3.services import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"Mooncake is unavailable: {reason}")
    out = tmp_path_factory.mktemp("cluster")
    assert histate_main(["cluster", "--sessions", "6", "--turns", "3", "--max-live-sessions", "4", "--seed", "0",
                         "--l3-mib", "64", "--out", str(out), "--no-progress"]) == 0
    return out


def test_simulated_hit_rates_are_within_5_points_of_live_for_every_run(live_dir):
    """Cluster token hit rate per run, and the moved sessions' next-request hit rate when live moved
    any (then the simulator must move some too). Bugs this caught: the simulator matching a
    page-aligned prompt's last page, which the worker never keys (reference/executor.py)."""
    workload = cluster_workload(Namespace(sessions=6, turns=3, seed=0))
    table = compare(workload, read_live(live_dir), TwinOptions(max_live_sessions=4, seed=0, l3_segment_bytes=64 * MiB))
    report = format_table(table)
    assert set(table) == {"l3", "l3+kill", "no-l3+kill"}, report
    for name, both in table.items():
        if both["live"]["moved_sessions"]:
            assert both["sim"]["moved_sessions"], f"{name}: live moved sessions, the simulator none\n{report}"
        assert not math.isnan(both["sim"]["hit_rate"]), report
    gaps = max_gap_points(table)
    assert all(gap <= TOLERANCE_POINTS for gap in gaps.values()), f"{gaps}\n{report}"
