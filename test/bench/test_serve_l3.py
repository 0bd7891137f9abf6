"""`histate serve --l3-master`: two servers (two workers, their own tiers and SSD directories) on one
loopback Mooncake store. A session's turn 2 sent to the other server resumes from L3, streams the
cold run's greedy tokens, and says so in meta_info and /get_server_info. Without --l3-master none of
these fields appear (test_serve.py covers that server's answers being as before).

Hand count: turn 1 has 300 tokens (page keys cover [0, 299): 4 pages, terminal state at 256 tokens),
turn 2 appends 40: server B resumes 256 tokens from L3 and none locally.
"""
import json
import random
import urllib.request
import uuid

import pytest

from histate.cli import main
from histate.l3 import services
from test.bench.test_serve import _ids, _post


@pytest.fixture(scope="module")
def two_l3_servers(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("histate_kernels")
    reason = services.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from histate.serve.engine import ServeConfig, ServingEngine
    from histate.serve.http import ServerThread

    with services.LoopbackMooncake(segment_size_bytes=32 * 2**20) as mooncake:
        prefix = f"serve-{uuid.uuid4().hex[:8]}"
        servers = [ServerThread(ServingEngine(ServeConfig(
            "histate", ssd_dir=tmp_path_factory.mktemp(f"ssd-{name}"), ssd_backend="file", check_mirror=True,
            l3_master=mooncake.master_address, l3_key_prefix=prefix))) for name in "AB"]
        try:
            yield servers
        finally:
            for server in servers:
                server.close()


def _server_info(server) -> dict:
    with urllib.request.urlopen(server.url + "/get_server_info") as response:
        return json.loads(response.read())


def test_turn_two_on_the_other_server_resumes_from_l3(two_l3_servers):
    from histate.reference.runner import ModelRunner

    a, b = two_l3_servers
    rng = random.Random(18)
    turn_1 = _ids(rng, 300)
    status, body = _post(a.url + "/generate", {"input_ids": turn_1, "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and body["meta_info"]["l3_cached_tokens"] == 0
    turn_2 = turn_1 + _ids(rng, 40)
    status, events = _post(b.url + "/generate", {"input_ids": turn_2, "sampling_params": {"max_new_tokens": 4},
                                                 "stream": True})
    assert status == 200
    meta = events[-1]["meta_info"]
    assert (meta["cached_tokens"], meta["l3_cached_tokens"]) == (256, 256)
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0, "l3": 256}
    assert all(e["meta_info"]["cached_tokens"] == 256 for e in events)
    assert events[-1]["output_ids"] == list(ModelRunner("fp32").cold_run(turn_2, 4).decode_tokens)

    stats_a, stats_b = _server_info(a)["histate_stats"], _server_info(b)["histate_stats"]
    assert (stats_a["requests"], stats_a["l3"]["objects_put"]) == (1, 5)  # KV pages 0-3, the state at 4
    assert (stats_b["requests"], stats_b["local_hit_tokens"], stats_b["l3_hit_tokens"]) == (1, 0, 256)
    assert stats_b["l3"]["client"]["misses"] == 0 and stats_b["l3"]["objects_put"] == 2
    assert _server_info(b)["l3_key_prefix"] == _server_info(a)["l3_key_prefix"]


def test_a_server_without_l3_reports_no_l3_fields(histate_server):
    status, body = _post(histate_server.url + "/generate", {"input_ids": [7] * 100,
                                                            "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and "l3_cached_tokens" not in body["meta_info"]
    info = _server_info(histate_server)
    assert "l3" not in info["histate_stats"] and "l3_master" not in info
    assert info["histate_stats"]["requests"] >= 1


@pytest.mark.parametrize("argv, message", [
    (["--l3-key-prefix", "x"], "--l3-key-prefix: needs --l3-master"),
    (["--l3-pin-ttl-s", "60"], "--l3-pin-ttl-s: needs --l3-master"),
    (["--policy", "none", "--l3-master", "127.0.0.1:1"], "--l3-master needs a cache policy"),
])
def test_serve_refuses_l3_flags_that_would_do_nothing(capsys, argv, message):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err
