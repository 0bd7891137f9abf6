"""`histate bench` sends every request of a session tree with its root's id as X-SMG-Routing-Key.

The server here only records the header of each request and answers a valid stream: what is tested
is the client (the real router's use of the key is test/cluster/test_router.py's).
"""
import asyncio
import json
import threading

import pytest
from aiohttp import web

from histate.bench.backends import ROUTING_KEY_HEADER
from histate.bench.run import BenchOptions, run_bench
from histate.sim.replay import ReplayConfig
from histate.sim.traces import LoadOptions, load_weka
from test.sim.helpers import ids, weka_request, weka_session, weka_subagent, write_jsonl


class _RecordingServer:
    """A /generate that answers any prompt with max_new_tokens tokens and records (key, prompt length)."""

    def __init__(self) -> None:
        self.seen = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._started.wait(timeout=30)

    async def _generate(self, request):
        body = await request.json()
        self.seen.append((request.headers.get(ROUTING_KEY_HEADER), len(body["input_ids"])))
        n = body["sampling_params"]["max_new_tokens"]
        events = [{"output_ids": [1] * k, "meta_info": {"prompt_tokens": len(body["input_ids"]),
                                                         "completion_tokens": k, "cached_tokens": 0}}
                  for k in range(1, n + 1)]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return web.Response(text=text, content_type="text/event-stream")

    async def _model_info(self, request):
        return web.json_response({"model_path": "fake", "vocab_size": 512})

    async def _flush(self, request):
        return web.Response(text="ok")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.add_routes([web.post("/generate", self._generate), web.get("/get_model_info", self._model_info),
                        web.post("/flush_cache", self._flush)])
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._started.set()
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


@pytest.fixture
def recording_server():
    server = _RecordingServer()
    try:
        yield server
    finally:
        server.close()


def test_each_request_carries_its_root_sessions_id(recording_server, tmp_path):
    child = weka_subagent(t=3.0, duration_s=2.0, requests=[weka_request(1.2, 200, ids(500, 3), out=3),
                                                           weka_request(2.0, 330, ids(500, 5), out=2)])
    sessions = [weka_session("p", [weka_request(0.0, 300, ids(1, 4), out=3), child,
                                   weka_request(3.1, 500, ids(1, 7), out=2, think=0.05)]),
                weka_session("q", [weka_request(0.0, 130, ids(900, 2), out=2),
                                   weka_request(1.0, 200, ids(900, 3), out=2, think=0.05)])]
    workload = load_weka(write_jsonl(tmp_path / "t.jsonl", sessions), LoadOptions())
    run_bench(workload, BenchOptions(recording_server.url, admission=ReplayConfig(max_live_sessions=2),
                                     progress=False))
    assert sorted(recording_server.seen) == sorted([("p", 300), ("p", 200), ("p", 330), ("p", 500),
                                                    ("q", 130), ("q", 200)])
