"""A loopback Mooncake master + store service per test module; skipped with the reason when Mooncake
cannot run here (the wheel or Debian's libibverbs1 missing)."""
import pytest

from histate.l3 import services


@pytest.fixture(scope="module")
def mooncake():
    reason = services.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with services.LoopbackMooncake(segment_size_bytes=32 * 2**20) as mc:
        yield mc


@pytest.fixture
def own_mooncake():
    """A master + store service for one test alone (tests that kill the store service)."""
    reason = services.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with services.LoopbackMooncake(segment_size_bytes=16 * 2**20) as mc:
        yield mc
