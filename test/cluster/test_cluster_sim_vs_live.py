"""The simulator's cluster mode against the loopback cluster on the same sessions (issue 18: within 5
points before it extrapolates to 16 servers). The session's one small `histate cluster` run (2 workers, 6 sessions
x 4 turns; conftest.cluster_report), then each run's twin in the simulator (histate/cluster/sim_twin.py: the live
placement, the live kill point, L3 on/off, the workers' budgets). Skipped like the other cluster
tests when sglang-router, the workers' dependencies or Mooncake are missing."""
import math

from histate.cluster.sim_twin import TwinOptions, compare, format_table, max_gap_points, read_live

from .conftest import CLUSTER_ARGS, CLUSTER_L3_BYTES, CLUSTER_LIVE_SESSIONS

TOLERANCE_POINTS = 5.0


def test_simulated_hit_rates_are_within_5_points_of_live_for_every_run(cluster_report):
    """Cluster token hit rate per run, and the hit rate of the live run's moved sessions' next requests
    (the same requests on both sides). Bugs this caught: the simulator matching a
    page-aligned prompt's last page, which the worker never keys (reference/executor.py)."""
    workload, live_dir, _ = cluster_report
    table = compare(workload, read_live(live_dir), TwinOptions(max_live_sessions=CLUSTER_LIVE_SESSIONS,
                                                               seed=CLUSTER_ARGS["seed"],
                                                               l3_segment_bytes=CLUSTER_L3_BYTES))
    report = format_table(table)
    assert set(table) == {"l3", "l3+kill", "no-l3+kill"}, report
    for name, both in table.items():
        assert both["sim"]["moved_sessions"] == both["live"]["moved_sessions"], report
        assert not math.isnan(both["sim"]["hit_rate"]), report
    gaps = max_gap_points(table)
    assert all(gap <= TOLERANCE_POINTS for gap in gaps.values()), f"{gaps}\n{report}"
