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
