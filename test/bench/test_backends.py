"""The bench's clients against servers that answer wrongly, fail, or are not there.

These fake servers stand for *remote* servers misbehaving (the client's error paths); the client's
normal path is tested against the real `histate serve` in test_serve.py / test_bench_live.py.
"""
import asyncio
import json
import socket

import aiohttp
import pytest
from aiohttp import web

from histate.bench.backends import BenchError, TransientError, make_backend
from histate.bench.sessions import RetryPolicy


def _sse(*events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _meta(completion_tokens, prompt_tokens=3, cached_tokens=0, **extra):
    return {"meta_info": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "cached_tokens": cached_tokens, **extra}, "output_ids": [1] * completion_tokens}


async def _with_server(handler, body, path="/generate", backend="sglang"):
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as http:
            return await body(make_backend(backend, f"http://{host}:{port}"), http)
    finally:
        await runner.cleanup()


def _serve_text(text, status=200):
    async def handler(request):
        return web.Response(text=text, status=status, content_type="text/event-stream")
    return handler


def _generate(handler, ids=(1, 2, 3), max_new=2, backend="sglang", path="/generate"):
    async def body(client, http):
        return await client.generate(http, list(ids), max_new)
    return asyncio.run(_with_server(handler, body, path, backend))


def test_sglang_stream_is_parsed_into_counts_and_times():
    done = _generate(_serve_text(_sse(_meta(1), _meta(2, cached_tokens=2, histate={"kv_hit_tokens": 3}))))
    assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens, done.kv_hit_tokens) == (3, 2, 2, 3)
    assert 0 < done.ttft_s <= done.latency_s


@pytest.mark.parametrize("events, message", [
    ([{"text": "x"}], "event lacks meta_info"),
    ([_meta(1), _meta(1)], "completion_tokens=1, forced 2 (does the server honour ignore_eos?)"),
    ([_meta(2, prompt_tokens=5)], "prompt_tokens=5, but the prompt has 3 token ids"),
    ([_meta(2, cached_tokens=None)], "meta_info.cached_tokens is None"),
    ([_meta(0)], "the stream ended without an output token"),
    ([{"error": {"message": "boom"}}], "server error: boom"),
])
def test_wrong_answers_are_fatal_one_liners(events, message):
    with pytest.raises(BenchError) as info:
        _generate(_serve_text(_sse(*events)))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not isinstance(info.value, TransientError)


def test_http_errors_split_into_fatal_and_transient():
    with pytest.raises(BenchError, match=r"HTTP 400: input_ids must be") as info:
        _generate(_serve_text(json.dumps({"error": {"message": "input_ids must be ints"}}), status=400))
    assert not isinstance(info.value, TransientError)
    with pytest.raises(TransientError, match="HTTP 503"):
        _generate(_serve_text("overloaded", status=503))
    with pytest.raises(BenchError, match="not JSON in the event stream"):
        _generate(_serve_text("data: {oops\n\n"))


def test_openai_usage_and_missing_cached_tokens():
    chunk = {"choices": [{"index": 0, "text": "a"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                      "prompt_tokens_details": {"cached_tokens": 1}}}
    done = _generate(_serve_text(_sse(chunk, chunk, usage)), backend="openai", path="/v1/completions")
    assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (3, 2, 1)
    usage["usage"]["prompt_tokens_details"] = None  # vLLM without --enable-prompt-tokens-details
    done = _generate(_serve_text(_sse(chunk, chunk, usage)), backend="openai", path="/v1/completions")
    assert done.cached_tokens is None
    with pytest.raises(BenchError, match="no usage in the stream"):
        _generate(_serve_text(_sse(chunk, chunk)), backend="openai", path="/v1/completions")


def test_transient_failures_are_retried_then_given_up():
    calls = []

    async def flaky(request):
        calls.append(1)
        if len(calls) < 3:
            return web.Response(status=500, text="warming up")
        return web.Response(text=_sse(_meta(1), _meta(2)), content_type="text/event-stream")

    async def body(client, http):
        retries = []
        done = await RetryPolicy(max_attempts=3, backoff_s=0.0).call(
            lambda: client.generate(http, [1, 2, 3], 2), retries.append)
        return done, retries

    done, retries = asyncio.run(_with_server(flaky, body))
    assert done.completion_tokens == 2 and len(retries) == 2 and len(calls) == 3
    calls.clear()

    async def body_two_attempts(client, http):
        return await RetryPolicy(max_attempts=2, backoff_s=0.0).call(lambda: client.generate(http, [1, 2, 3], 2))

    with pytest.raises(BenchError, match=r"HTTP 500: warming up \(gave up after 2 attempts\)") as info:
        asyncio.run(_with_server(flaky, body_two_attempts))
    assert not isinstance(info.value, TransientError)


def test_a_stream_broken_after_its_first_token_is_retried():
    """What a client behind sglang-router sees when the worker dies mid-stream: the chunked body ends
    early. The request is resent (the router sends it to a live worker)."""
    calls = []

    async def dies_once(request):
        calls.append(1)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps(_meta(1))}\n\n".encode())
        if len(calls) == 1:
            request.transport.close()  # the worker is gone: no last chunk
            return response
        await response.write(f"data: {json.dumps(_meta(2))}\n\ndata: [DONE]\n\n".encode())
        return response

    async def body(client, http):
        retries = []
        done = await RetryPolicy(max_attempts=2, backoff_s=0.0).call(
            lambda: client.generate(http, [1, 2, 3], 2), retries.append)
        return done, retries

    done, retries = asyncio.run(_with_server(dies_once, body))
    assert done.completion_tokens == 2 and len(calls) == 2
    assert len(retries) == 1 and "stream broke after the first token" in str(retries[0])


def closed_port_url():
    """A URL on a port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_server_is_transient():
    async def body():
        async with aiohttp.ClientSession() as http:
            return await make_backend("sglang", closed_port_url()).generate(http, [1], 1)

    with pytest.raises(TransientError, match="generate: "):
        asyncio.run(body())


def test_vllms_max_model_len_is_checked_before_anything_is_sent():
    """vLLM lists max_model_len (prompt + output) in /v1/models; a longer request is refused up front."""
    from histate.bench.run import check_server_limits
    from histate.sim.replay import ReplayConfig
    from histate.sim.request import Request, Session, Workload, WorkloadStats

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 1000}]})

    async def run():
        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        try:
            async with aiohttp.ClientSession() as http:
                return await make_backend("openai", f"http://{host}:{port}").server_info(http)
        finally:
            await runner.cleanup()

    info = asyncio.run(run())
    assert (info.model, info.max_total_num_tokens, info.max_prompt_num_tokens) == ("m", 1000, None)
    requests = (Request(0, "s", 0, 900, 50, (), 0.0), Request(1, "s", 1, 990, 20, (), 0.0))
    workload = Workload("w", [Session("s", requests)], WorkloadStats(sessions=1, requests=2))
    with pytest.raises(BenchError, match=r"1 of the 2 admitted requests have prompt \+ output over the server's max "
                                         r"model length of 1,000 tokens \(max_model_len in /v1/models; the longest "
                                         r"has 1,010\); nothing was sent"):
        check_server_limits(workload, ReplayConfig(), info)
