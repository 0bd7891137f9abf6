"""Two SGLang servers with `--enable-histate --histate-l3 mooncake` behind sglang-router: a session
moved to the other server resumes from what the first one wrote to the shared L3, and answers as stock
SGLang does cold.

The loopback fleet: a Mooncake master and store service on 127.0.0.1 (histate.l3.services), two
SGLang servers on this CPU (each its own SSD directory; L3 is the shared tier under them), and
sglang-router with `--policy manual`, which sends a request to the worker its `X-SMG-Routing-Key`
maps to. The session's first turns go to one server; then the router drops that server (what an
operator's scale-down does) and the next turn lands on the other, which never saw the session: any
cached token there came from L3 (its `histate_l3_pages_total{result="hit"}` says so).
"""
from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest

from .client import LOGPROB_TOLERANCE, generate, metric_sum, tokens
from .conftest import HISTATE_ARGS



def _via_router(router_url: str, ids: list, key: str):
    body = json.dumps({"input_ids": ids, "return_logprob": True,
                       "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}).encode()
    request = urllib.request.Request(router_url + "/generate", body,
                                     {"Content-Type": "application/json", "X-SMG-Routing-Key": key})
    with urllib.request.urlopen(request, timeout=600) as response:
        out = json.load(response)
    return out["output_ids"], int(out["meta_info"]["cached_tokens"]), [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def _settled(url: str, metric: str, quiet_s: float = 2.0, deadline_s: float = 60.0) -> float:
    """The metric once it is positive and has not moved for `quiet_s`: the session's L3 writes (its KV
    pages and its state, written by the storage backup thread after the turn's response) are done. Waiting
    only for the first byte let the moved turn arrive, under load, while the state was still on its way,
    and a hybrid prefetch without its state is no hit (the full suite once saw `cached 0`)."""
    deadline = time.monotonic() + deadline_s
    value, since = metric_sum(url, metric), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = metric_sum(url, metric)
        if now != value:
            value, since = now, time.monotonic()
        elif value > 0 and time.monotonic() - since >= quiet_s:
            break
    return value


def test_a_moved_session_resumes_from_l3_and_answers_exactly(servers, fleet, ssd_root, tmp_path):
    from histate.cluster.router import Router, router_executable
    from histate.l3.services import LoopbackMooncake, unavailable_reason

    reason = unavailable_reason() or (None if router_executable() else "sglang-router is not installed")
    if reason:
        pytest.skip(f"no loopback cluster here: {reason}")
    with LoopbackMooncake(64 << 20, log_dir=str(tmp_path / "mooncake")) as mooncake:
        specs = [(f"l3-{i}", HISTATE_ARGS + ("--histate-ssd-dir", str(ssd_root / f"l3-{i}"), "--histate-l3", "mooncake"))
                 for i in range(2)]
        workers = fleet.get(*specs, env=mooncake.env)
        try:
            with Router([w.url for w in workers], log_dir=tmp_path) as router:
                before = {w.url: metric_sum(w.url, "histate_input_tokens_total") for w in workers}  # warm-up requests
                rng = random.Random(21)
                context = tokens(rng, 700)
                for _ in range(2):
                    ids, _, _ = _via_router(router.url, context, "session-1")
                    context = context + ids + tokens(rng, 150)
                served = lambda w: metric_sum(w.url, "histate_input_tokens_total") - before[w.url]
                first = max(workers, key=served)
                other = next(w for w in workers if w is not first)
                assert served(other) == 0, "the router split the session"
                written = _settled(first.url, "histate_l3_written_bytes_total")
                assert written > 0, "nothing reached L3"
                router.remove_worker(first.url)
                ids, cached, logprobs = _via_router(router.url, context, "session-1")
                assert served(other) > 0, "the moved turn did not reach the other server"
                assert cached > 0 and metric_sum(other.url, "histate_l3_pages_total", result="hit") > 0, \
                    f"the moved session resumed from nothing in L3 (cached {cached})"
                cold = generate(servers.reference.url, context)
                assert list(cold.output_ids) == ids
                assert max(abs(a - b) for a, b in zip(cold.logprobs, logprobs)) <= LOGPROB_TOLERANCE
        finally:
            for name, _ in specs:
                fleet.stop(name)
