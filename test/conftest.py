"""Suite-wide pytest configuration: markers and Hypothesis profiles.

Profiles: `dev` (quick local runs) and `ci` (derandomized, more steps); choose with HYPOTHESIS_PROFILE.
"""
import os

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
