"""Every L3 fault of `histate cluster --faults` on one loopback cluster: a miss, never a wrong answer.

One cluster (real Mooncake master + store service, two `histate serve` workers with --l3-master,
sglang-router --policy manual) runs every scenario of histate.cluster.faults in order. Each test
asserts, for its scenario: every answer equals a cold recompute of its prompt (computed in this
process, not by the workers), the fault fired (a worker counter that only the fault moves), and no
request of the faulted run waited longer than STALL_BOUND_S for its first token.
"""
import pytest

from histate.cluster.faults import STALL_BOUND_S, FaultOptions, run_faults


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from histate.l3.services import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"Mooncake is unavailable: {reason}")
    runs = run_faults(FaultOptions(sessions=2, turns=2, seed=7), tmp_path_factory.mktemp("faults"))
    return {r.name: r for r in runs}


def _exact_and_bounded(r, runs=2):
    assert r.requests == r.checked == runs * 2 * 2, r  # 2 sessions x 2 turns per run
    assert r.wrong == 0, r
    assert r.max_ttft_s < STALL_BOUND_S, r


def test_without_a_fault_the_measure_run_restores_from_l3(results):
    r = results["none"]
    _exact_and_bounded(r)
    assert r.l3_hits > 0 and r.l3_hit_tokens > 0  # so a fault's zero below is the fault's doing


@pytest.mark.parametrize("name", ["garbage", "truncated"])
def test_damaged_objects_fail_the_frame_check_and_are_misses(results, name):
    r = results[name]
    _exact_and_bounded(r)
    assert r.fired["objects_damaged"] > 0
    assert r.fired["client_corrupt"] > 0 and r.fired["client_corrupt_removed"] > 0
    assert r.l3_hit_tokens == 0


def test_a_full_store_refuses_puts_after_bounded_retries(results):
    r = results["full"]
    _exact_and_bounded(r)
    assert r.fired["junk_objects"] > 0 and r.fired["object_put_failures"] > 0
    assert r.fired["client_put_retries"] == 3 * r.fired["object_put_failures"]  # PUT_RETRY_BACKOFF_S: 3
    assert r.l3_hit_tokens == 0  # nothing of this scenario was written


def test_a_paused_store_costs_bounded_timeouts_not_stalls(results):
    r = results["slow"]
    _exact_and_bounded(r)
    assert r.fired["client_timeouts"] > 0 and r.fired["client_skipped_down"] > 0


def test_a_killed_store_service_is_a_miss(results):
    r = results["store-kill"]
    _exact_and_bounded(r)
    assert r.fired["shortened_hits"] > 0 and r.l3_hit_tokens == 0


def test_a_killed_master_is_a_bounded_miss_and_workers_write_to_its_restart(results):
    r = results["master-restart"]
    _exact_and_bounded(r, runs=2 + r.after_runs)
    assert r.fired["object_put_failures"] > 0 and r.l3_hit_tokens == 0, r.fired  # puts the dead master failed
    assert r.after["objects_put"] > 0 and r.after["object_put_failures"] == 0
