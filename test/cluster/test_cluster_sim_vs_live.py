"""The simulator's cluster mode against the loopback cluster on the same sessions (issue 18: within 5
points before it extrapolates to 16 servers). The session's one small `histate cluster` run (2 workers, 6 sessions
x 4 turns; conftest.cluster_report), then each run's twin in the simulator (histate/cluster/sim_twin.py: the live
placement, the live kill point, L3 on/off, the workers' budgets). Skipped like the other cluster
tests when sglang-router, the workers' dependencies or Mooncake are missing."""
import math

from histate.cluster.sim_twin import TwinOptions, compare, format_table, read_live

from .conftest import CLUSTER_ARGS, CLUSTER_L3_BYTES, CLUSTER_LIVE_SESSIONS

TOLERANCE_POINTS = 5.0


def test_simulated_hit_rates_are_within_5_points_of_live_for_every_run(cluster_report):
    """The cluster's and every worker's token hit rate, live vs simulated, within 5 points on every run.
    Bugs this caught: the simulator matching a page-aligned prompt's last page, which the worker never
    keys (reference/executor.py); a kill at a completion count firing at another moment than live;
    the engine admitting a request that arrived during the step finishing the one before it, at its
    arrival, against a cache without that request's pages (sim/engine.py `_admit_waiting`; 6 points
    on one worker, once in CI and once in six runs here).
    The moved sessions' next requests are compared in the table but not asserted: on this cluster they
    are four requests of ~800 tokens, one 64-token page is 8 points, and which branch-point checkpoint
    exists when one arrives depends on arrival order within a few milliseconds (seen once in four CI
    runs; benchmark/cluster_sim_vs_live.py measures them on 16 sessions)."""
    workload, live_dir, _ = cluster_report
    table = compare(workload, read_live(live_dir), TwinOptions(max_live_sessions=CLUSTER_LIVE_SESSIONS,
                                                               seed=CLUSTER_ARGS["seed"],
                                                               l3_segment_bytes=CLUSTER_L3_BYTES))
    report = format_table(table)
    assert set(table) == {"l3", "l3+kill", "no-l3+kill"}, report
    for name, both in table.items():
        live, sim = both["live"], both["sim"]
        assert sim["moved_sessions"] == live["moved_sessions"], report
        pairs = [(live["hit_rate"], sim["hit_rate"]), *zip(live["per_worker"], sim["per_worker"])]
        # a worker the router gave no session (its draw for a new key is random: all six on one
        # worker is 1 in 32) has no hit rate live, and must have none simulated either
        assert all(math.isnan(s) == math.isnan(lv) for lv, s in pairs), report
        gaps = [100 * abs(s - lv) for lv, s in pairs if not math.isnan(lv)]
        assert max(gaps) <= TOLERANCE_POINTS, f"{name}: {gaps}\n{report}"
