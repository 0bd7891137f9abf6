"""Session affinity through sglang-router --policy manual, and what a killed worker does to it.

Two real `histate serve` workers (tiny model, 2-token answers) behind a real router
(histate.cluster.router's flags). Each answer names the worker that served it
(meta_info.histate.worker) and each worker counts what it served (/server_info num_requests).
"""
import asyncio
import json
import time
import urllib.error
import urllib.request

import aiohttp

from histate.bench.backends import ROUTING_KEY_HEADER, StreamBroken, make_backend
from histate.bench.run import BenchOptions, run_bench
from histate.bench.sessions import RetryPolicy
from histate.sim.replay import ReplayConfig
from histate.sim.workloads import AgentWorkloadConfig, agent_workload

MAX_KEYS = 64


def _generate(router_url, key, prompt=(1, 2, 3, 4)):
    """(HTTP status, the worker URL that served it, or the error body)."""
    body = json.dumps({"input_ids": list(prompt), "sampling_params": {"max_new_tokens": 2}}).encode()
    request = urllib.request.Request(router_url + "/generate", data=body,
                                     headers={"Content-Type": "application/json", ROUTING_KEY_HEADER: key})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, "http://" + json.loads(resp.read())["meta_info"]["histate"]["worker"]
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")[:300]


def _place_sessions(router_url, worker_urls, keys_per_worker=3):
    """Send one request per new session key until every worker holds `keys_per_worker` of them (the
    router picks a new key's worker at random): {key: worker URL}."""
    placement = {}
    for i in range(MAX_KEYS):
        key = f"session-{i}"
        status, worker = _generate(router_url, key, prompt=(i, 0, 7))
        assert status == 200, worker
        placement[key] = worker
        if all(list(placement.values()).count(url) >= keys_per_worker for url in worker_urls):
            return placement
    raise AssertionError(f"{MAX_KEYS} sessions never reached every worker: {placement}")


def _num_requests(worker_url):
    with urllib.request.urlopen(worker_url + "/server_info", timeout=10) as resp:
        return json.loads(resp.read())["num_requests"]


def test_each_sessions_requests_land_on_one_worker(cluster):
    pool, router = cluster
    placement = _place_sessions(router.url, pool.urls)
    for turn in range(1, 3):
        for i, key in enumerate(placement):
            status, worker = _generate(router.url, key, prompt=(i, turn, 7))
            assert (status, worker) == (200, placement[key]), (key, turn)
    per_worker = {url: 3 * list(placement.values()).count(url) for url in pool.urls}
    assert {url: _num_requests(url) for url in pool.urls} == per_worker


def test_bench_through_the_router_keeps_session_trees_together(cluster):
    """histate bench streams through the router (flush fans out to both workers) and its sessions'
    later turns hit: the prefix stayed on the worker that cached it."""
    pool, router = cluster
    workload = agent_workload(AgentWorkloadConfig(
        num_sessions=4, num_turns=3, system_prompt_num_tokens=128, first_input_num_tokens=(128, 256),
        append_num_tokens=(64, 128), output_num_tokens=(2, 3), tool_gap_s=(0.0, 0.01), human_gap_probability=0.0,
        session_start_spread_s=0.01, truncation_rate=0.0, rewind_edit_rate=0.0, fork_rate=0.0,
        compaction_rate=0.0, seed=5))
    result = run_bench(workload, BenchOptions(router.url, admission=ReplayConfig(max_live_sessions=4),
                                              progress=False, request_timeout_s=60))
    assert result.summary["bench"]["cache_flushed"] is True and result.summary["bench"]["retries"] == 0
    records = result.run.records
    assert len(records) == workload.num_requests
    later = [r for r in records if r.session_index > 0]
    assert later and all(r.reused_tokens > 0 for r in later), [(r.session_id, r.reused_tokens) for r in later]
    # each session on one worker (which one is the router's random draw: both, or one, may get all four)
    servers = {}
    for r in records:
        servers.setdefault(r.session_id, set()).add(r.server)
    assert all(len(s) == 1 and s <= {u.removeprefix("http://") for u in pool.urls} for s in servers.values()), servers


def test_a_killed_workers_sessions_move_and_the_others_stay(cluster):
    pool, router = cluster
    placement = _place_sessions(router.url, pool.urls)
    dead, live = pool.urls

    pool.kill(0)
    killed_s = time.monotonic()
    moved_after_s = None
    for turn in range(3):
        for key in placement:
            status, worker = _generate(router.url, key)
            assert status == 200, f"{key} after the kill: HTTP {status}: {worker}"
            assert worker == live, (key, worker)  # the dead worker's keys moved, the live ones stayed
            if moved_after_s is None and placement[key] == dead:
                moved_after_s = time.monotonic() - killed_s
    router.wait_for(lambda: dead not in router.healthy_urls(), 30, f"{dead} marked unhealthy")
    unhealthy_after_s = time.monotonic() - killed_s
    print(f"first request of a dead worker's session served by the live one {moved_after_s:.2f} s after "
          f"the kill; router listed the dead worker unhealthy by {unhealthy_after_s:.2f} s")
    assert {w["url"] for w in router.list_workers()} == {dead, live}  # unhealthy, still listed


def test_a_request_streaming_from_a_killed_worker_is_resent_to_the_live_one(cluster):
    """The router cannot retry a stream it has started forwarding: the client sees the body end early
    (StreamBroken); histate bench's retry resends it, and the router sends it to the live worker."""
    pool, router = cluster
    placement = _place_sessions(router.url, pool.urls, keys_per_worker=1)
    key = next(k for k, worker in placement.items() if worker == pool.urls[0])

    async def stream_then_kill():
        backend = make_backend("sglang", router.url)
        retries = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            request = asyncio.ensure_future(RetryPolicy(max_attempts=2, backoff_s=0.0).call(
                lambda: backend.generate(http, list(range(1, 50)), 300, key), retries.append))
            await asyncio.sleep(1.0)  # 300 tokens take seconds on CPU: it is mid-stream
            assert not request.done()
            pool.kill(0)
            return await request, retries

    done, retries = asyncio.run(stream_then_kill())
    assert done.completion_tokens == 300
    assert len(retries) == 1 and isinstance(retries[0], StreamBroken), retries
    assert _generate(router.url, key)[1] == pool.urls[1]


def test_workers_can_be_removed_and_added_back(cluster):
    pool, router = cluster
    dead, live = pool.urls
    router.remove_worker(dead)
    assert {w["url"] for w in router.list_workers()} == {live}
    assert {_generate(router.url, f"session-{i}")[1] for i in range(8)} == {live}
    router.add_worker(dead)
    assert router.healthy_urls() == {dead, live}
