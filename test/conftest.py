"""Suite-wide pytest configuration: markers and Hypothesis profiles.

Profiles: `dev` (quick local runs) and `ci` (derandomized, more steps); choose with HYPOTHESIS_PROFILE.
"""
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=40, deadline=None)
settings.register_profile(
    "ci",
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "slow: long-running; still part of `make test`")
    config.addinivalue_line("markers", "services: starts servers or services of its own (below)")
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs in one worker (below)")


# Tests that start processes of their own (SGLang servers, `histate serve` workers, Mooncake services,
# the router) carry the `services` mark and, under `make test` (pytest-xdist, `--dist loadgroup`), run one
# after the other in one worker: they share package- and module-scoped fleets, and several servers side by
# side would share the machine's memory. (SGLang's 10 GiB host-memory reserve, which left no room beside
# other tests on a 24 GiB machine, is 1 GiB in the CPU test servers: sglang_cpu/server/patches.py.)
# Every other test file is its own group, so a module's fixtures are built once. Without `-n` the
# marks change nothing.
_SERVICE_TESTS = ("test/server/", "test/cluster/", "test/l3/", "test/bench/test_serve", "test/bench/test_sglang_clients.py",
                  "test/bench/test_bench_live.py", "test/reference/test_l3_resume.py", "test/sglang/test_l3_mooncake.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        services = path.startswith(_SERVICE_TESTS)
        if services:
            item.add_marker(pytest.mark.services)
        item.add_marker(pytest.mark.xdist_group("services" if services else path))
