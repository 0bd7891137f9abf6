"""A loopback Mooncake master + store service per test module; skipped with the reason when Mooncake
cannot run here (the wheel or Debian's libibverbs1 missing)."""
import pytest

from histate.l3 import services


def _loopback(segment_size_bytes: int):
    reason = services.unavailable_reason()
    if reason:
        pytest.skip(reason)
    return services.LoopbackMooncake(segment_size_bytes=segment_size_bytes)


@pytest.fixture(scope="module")
def mooncake():
    with _loopback(32 * 2**20) as mc:
        yield mc


@pytest.fixture
def own_mooncake():
    """A master + store service for one test alone (tests that kill the store service)."""
    with _loopback(services.MIN_SEGMENT_SIZE_BYTES) as mc:
        yield mc
