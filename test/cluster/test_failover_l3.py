"""The loopback cluster end to end (`histate cluster`'s four runs): a moved session restores its prefix
from L3, and no fault -- a worker killed, the store service killed -- makes any answer differ from a
cold recompute of its prompt. Real Mooncake master + store service, real `histate serve` workers with
--l3-master, real sglang-router --policy manual; 127.0.0.1 only."""
import pytest


@pytest.fixture(scope="module")
def report(cluster_report):
    workload, _, summary = cluster_report
    return workload, summary


def test_every_answer_of_every_run_equals_a_cold_recompute(report):
    workload, summary = report
    for name, run in summary["runs"].items():
        assert run["requests"] == workload.num_requests, name
        assert run["exact"] == workload.num_requests, name


def test_a_moved_session_resumes_from_l3_as_if_it_had_not_moved(report):
    _, summary = report
    run = summary["runs"]["l3+kill"]
    assert run["killed"] and run["moved_sessions"] >= 1
    assert run["moved_next_l3_hit_tokens"] > 0
    # Done-when: its next request's hit rate within 5 points of the same request without failure
    assert run["moved_next_hit_rate"] >= run["same_requests_without_failure_hit_rate"] - 0.05


def test_without_l3_a_moved_session_recomputes(report):
    _, summary = report
    run = summary["runs"]["no-l3+kill"]
    assert run["killed"] and run["moved_sessions"] >= 1
    assert run["moved_next_l3_hit_tokens"] == 0
    assert run["moved_next_hit_rate"] < run["same_requests_without_failure_hit_rate"] - 0.05


def test_a_killed_store_service_costs_l3_hits_never_answers(report):
    workload, summary = report
    run = summary["runs"]["l3+store-kill"]
    assert run["store_killed"] and run["kill_after_requests"] >= workload.num_requests // 2
    assert run["l3_hit_tokens_after_store_kill"] == 0
    assert run["exact"] == run["requests"] == workload.num_requests
