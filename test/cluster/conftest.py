"""Fixtures of the cluster tests: real `histate serve` worker processes behind a real sglang-router.

Skipped, with the reason, where sglang-router is not installed or the workers cannot run (they need
the `reference` extra and sgl-kernel-ext). Everything binds 127.0.0.1; every process started here is
ended (process groups) when its fixture finishes, failed test or not.
"""
import pytest

from histate.cluster.router import Router, router_executable
from histate.cluster.workers import WorkerPool


@pytest.fixture(scope="session", autouse=True)
def _needs_router_and_workers():
    if router_executable() is None:
        pytest.skip("sglang-router is not installed (pip install sglang-router==0.3.2): no cluster tests")
    for module in ("torch", "transformers", "histate_kernels", "aiohttp"):
        pytest.importorskip(module, reason=f"histate serve workers need {module}")


@pytest.fixture
def cluster(tmp_path):
    """Two workers behind a --policy manual router: (pool, router)."""
    with WorkerPool(2, base_dir=tmp_path) as pool, Router(pool.urls, log_dir=tmp_path) as router:
        yield pool, router


CLUSTER_ARGS = dict(sessions=6, turns=4, seed=3)
CLUSTER_LIVE_SESSIONS = 6
CLUSTER_L3_BYTES = 64 * 2**20


@pytest.fixture(scope="session")
def cluster_report(tmp_path_factory):
    """One `histate cluster` run (its four runs, every answer checked against a cold recompute), shared
    by the failover tests and the simulator's twin: (workload, output directory, summary)."""
    from histate.cluster.workload import cluster_workload
    from histate.cluster.run import ClusterOptions, cold_output_digests, run_cluster, summarize, write_report
    from histate.l3.services import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"Mooncake is unavailable: {reason}")
    workload = cluster_workload(CLUSTER_ARGS["sessions"], CLUSTER_ARGS["turns"], CLUSTER_ARGS["seed"])
    options = ClusterOptions(num_workers=2, max_live_sessions=CLUSTER_LIVE_SESSIONS, seed=CLUSTER_ARGS["seed"],
                             kill_after_fraction=0.5, l3_segment_bytes=CLUSTER_L3_BYTES, progress=False)
    out = tmp_path_factory.mktemp("cluster")
    runs = run_cluster(workload, options, out / "logs")
    summary = summarize(runs, cold_output_digests(workload, CLUSTER_ARGS["seed"]))
    write_report(summary, runs, out)
    return workload, out, summary
