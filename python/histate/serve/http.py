"""HTTP front of `histate serve`: the API subset `histate bench`, SGLang's `bench_serving` and OpenAI clients use.

  POST /generate         SGLang native: `text` or `input_ids`, `sampling_params.max_new_tokens` (ignore_eos is
                         implied: there is no EOS, every request produces exactly max_new_tokens),
                         `stream`. Events `data: {"text", "output_ids", "meta_info"}` then `data: [DONE]`;
                         `text` and `output_ids` are cumulative, as SGLang streams them; meta_info as
                         SGLang's (prompt_tokens, completion_tokens, cached_tokens, and at the end
                         cached_tokens_details by tier) plus `histate` (kv_hit_tokens, the checkpoint's
                         tier, queue and serve time)
  POST /v1/completions   OpenAI completions with a text or token-id `prompt`, `max_tokens`, `stream`,
                         `stream_options.include_usage`; one chunk per token with that token's text;
                         usage.prompt_tokens_details.cached_tokens
  GET  /v1/models, /model_info (and /get_model_info), /health;  POST /flush_cache (empties every tier)
  GET  /server_info (and /get_server_info)  SGLang's server facts sglang-router reads when it adds a
                         worker (served_model_name, dp_size), plus this worker's `url` and `num_requests`
                         (requests it has started) -- how a cluster test sees where a router sent what

Every /generate answer's meta_info.histate also names the `worker` (the host:port the request came in
on), so a client behind a router sees which worker served it.

With `--l3-master`, `cached_tokens` counts local and L3 hits together; meta_info adds
`l3_cached_tokens` (the L3 part) and cached_tokens_details an `l3` entry, and /server_info's
`histate_stats` the worker's counters (requests, local and L3 hit tokens, L3 puts, bytes, misses).
Without it, nothing of this appears and every answer is as before.

Text is the reference tokenizer's (histate/reference/tokenizer.py: one character per token), so every
streamed token carries non-empty text -- what SGLang's and OpenAI's clients stamp TTFT on. Which
request fields are served, accepted or refused is api.py's; sampling is greedy whatever `temperature`
says (the model has random weights; its tokens mean nothing). Bad requests get HTTP 400 with
`{"error": {"message", "type", "code"}}`, as SGLang answers them. A client that hangs up mid-stream
stops its request's decoding, quietly: it is an ordinary event for a server, not an error.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from typing import Optional

from aiohttp import web

from ..core import Tier
from .api import MODEL_NAME, BadRequest, GenerateCall, Limits, parse_completion, parse_generate
from .engine import Job, ServingEngine

ENGINE = web.AppKey("engine", ServingEngine)
COUNTS = web.AppKey("counts", dict)    # num_requests: /generate and /v1/completions calls started
_ids = itertools.count()


def build_app(engine: ServingEngine) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    app[ENGINE] = engine
    app[COUNTS] = {"num_requests": 0}
    app.add_routes([
        web.post("/generate", _generate), web.post("/v1/completions", _completions),
        web.get("/v1/models", _models), web.get("/model_info", _model_info), web.get("/get_model_info", _model_info),
        web.get("/server_info", _server_info), web.get("/get_server_info", _server_info),
        web.get("/health", _health), web.post("/flush_cache", _flush),
    ])
    return app


# --- request parsing ---------------------------------------------------------------------------

async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _limits(engine: ServingEngine) -> Limits:
    return Limits(engine.tokenizer, engine.config.max_context_num_tokens, engine.config.max_new_tokens)


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                             status=status)


# --- running a request -------------------------------------------------------------------------

class _Stream:
    """A submitted job's events, delivered on the event loop."""

    def __init__(self, engine: ServingEngine, call: GenerateCall) -> None:
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.job = Job(call.token_ids, call.max_new_tokens,
                       lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event))
        self.rid = call.rid or f"{next(_ids):x}"
        self.started_s = time.monotonic()
        engine.submit(self.job)

    async def __aiter__(self):
        while True:
            event = await self.events.get()
            yield event
            if event[0] != "token":
                return


async def _run(request: web.Request, call: GenerateCall, fmt) -> web.StreamResponse:
    """Submit the job and answer: an event per token when streaming, one JSON object otherwise.
    `fmt(job, call, output_ids, cached_tokens, done)` -> the payloads to send."""
    engine = request.app[ENGINE]
    request.app[COUNTS]["num_requests"] += 1
    job = _Stream(engine, call)
    response: Optional[web.StreamResponse] = None
    output_ids: list = []
    try:
        async for kind, *data in job:
            if kind == "error":
                if response is None:
                    return _error(data[0], 500)
                await _send(response, {"error": {"message": data[0], "type": "internal_error", "code": 500}})
                break
            if kind == "token":
                output_ids.append(data[0])
                if call.stream:
                    if response is None:
                        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                               "Cache-Control": "no-cache"})
                        await response.prepare(request)
                    for payload in fmt(job, call, output_ids, data[1], None):
                        await _send(response, payload)
                continue
            payloads = fmt(job, call, output_ids, data[0]["cached_tokens"], data[0])
            if not call.stream:
                return web.json_response(payloads[0])
            for payload in payloads:
                await _send(response, payload)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    except ConnectionResetError:  # the client hung up (aiohttp's ClientConnectionResetError is one)
        return response
    finally:
        job.job.cancel()  # no-op once done; stops decoding early if the client went away


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


def _cached_tokens_details(done: dict) -> dict:
    """SGLang's cached_tokens_details: reused tokens per cache source (local tiers, then L3 when the
    server has one)."""
    by_tier = done["cached_tokens_by_tier"]
    details = {"device": by_tier.get(Tier.GPU, 0), "host": by_tier.get(Tier.CPU, 0), "storage": by_tier.get(Tier.SSD, 0)}
    if done.get("l3_cached_tokens") is not None:
        details["l3"] = done["l3_cached_tokens"]
    return details


# --- SGLang /generate ----------------------------------------------------------------------------

def _worker_address(request: web.Request) -> str:
    """host:port this request came in on: the worker's name as a router's worker URL has it."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return f"{sockname[0]}:{sockname[1]}" if sockname else ""


def _sglang_payloads(tokenizer, worker: str):
    def fmt(job: _Stream, call: GenerateCall, output_ids, cached_tokens, done: Optional[dict]) -> list:
        meta = {"id": job.rid, "finish_reason": None, "prompt_tokens": len(call.token_ids),
                "completion_tokens": len(output_ids), "cached_tokens": cached_tokens,
                "e2e_latency": time.monotonic() - job.started_s}
        if done is not None:
            meta["finish_reason"] = {"type": "length", "length": len(output_ids)}
            if cached_tokens:
                meta["cached_tokens_details"] = _cached_tokens_details(done)
            meta["histate"] = {k: done[k] for k in ("kv_hit_tokens", "checkpoint_tier", "planned_checkpoint_pages",
                                                    "queue_s", "serve_s")}
            meta["histate"]["worker"] = worker
            if done.get("l3_cached_tokens") is not None:
                meta["l3_cached_tokens"] = done["l3_cached_tokens"]
        return [{"text": tokenizer.decode(output_ids), "output_ids": list(output_ids), "meta_info": meta}]

    return fmt


async def _generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        call = parse_generate(await _json_body(request), _limits(engine))
    except BadRequest as err:
        return _error(str(err))
    return await _run(request, call, _sglang_payloads(engine.tokenizer, _worker_address(request)))


# --- OpenAI /v1/completions ----------------------------------------------------------------------

def _openai_payloads(tokenizer):
    def fmt(job: _Stream, call: GenerateCall, output_ids, cached_tokens, done: Optional[dict]) -> list:
        base = {"id": f"cmpl-{job.rid}", "object": "text_completion", "created": int(time.time()),
                "model": MODEL_NAME}
        usage = {"prompt_tokens": len(call.token_ids), "completion_tokens": len(output_ids),
                 "total_tokens": len(call.token_ids) + len(output_ids),
                 "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        if not call.stream:
            choice = {"index": 0, "text": tokenizer.decode(output_ids), "logprobs": None, "finish_reason": "length"}
            return [{**base, "choices": [choice], "usage": usage}]
        if done is None:  # one chunk per token, with that token's text
            choice = {"index": 0, "text": tokenizer.token_text(output_ids[-1]), "logprobs": None, "finish_reason": None}
            return [{**base, "choices": [choice], "usage": None}]
        finish = {**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
                  "usage": None}
        if not call.include_usage:
            return [finish]
        last = {**base, "choices": [], "usage": usage}
        if call.cache_details:  # SGLang's extension, where its bench_serving --cache-report reads it
            last["sglext"] = {"cached_tokens_details": _cached_tokens_details(done)}
        return [finish, last]

    return fmt


async def _completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        call = parse_completion(await _json_body(request), _limits(engine))
    except BadRequest as err:
        return _error(str(err))
    return await _run(request, call, _openai_payloads(engine.tokenizer))


# --- info ------------------------------------------------------------------------------------------

async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                          "owned_by": "histate"}]})


async def _model_info(request: web.Request) -> web.Response:
    """SGLang's /model_info fields (model_path, tokenizer_path, is_generation) plus histate serve's own."""
    return web.json_response({**request.app[ENGINE].info(), "served_model_name": MODEL_NAME})


async def _server_info(request: web.Request) -> web.Response:
    """SGLang's /server_info keys that sglang-router reads (discover_metadata.rs: served_model_name
    names the worker's model in the router; dp_size 1 = not data-parallel) and this worker's counters.
    No `model_path`: the router would try to fetch a tokenizer of that name from the Hugging Face hub
    (register_tokenizer.rs); `tokenizer_path` is a local directory it does not read from here."""
    engine = request.app[ENGINE]
    model_facts = {k: v for k, v in engine.info().items() if k != "model_path"}
    return web.json_response({
        **model_facts, "served_model_name": MODEL_NAME, "tokenizer_path": str(engine.tokenizer_dir), "dp_size": 1,
        "max_running_requests": 1, "max_context_num_tokens": engine.config.max_context_num_tokens,
        "histate_policy": engine.config.policy, "url": f"http://{_worker_address(request)}",
        "num_requests": request.app[COUNTS]["num_requests"], "histate_stats": engine.server_stats()})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _flush(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    request.app[ENGINE].flush(lambda event: loop.call_soon_threadsafe(done.set_result, event))
    await done
    return web.Response(text="Cache flushed.")


# --- running the server ----------------------------------------------------------------------------

class ServerThread:
    """The server on its own event loop in a background thread (tests, benchmark scripts)."""

    def __init__(self, engine: ServingEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: Optional[web.AppRunner] = None
        self.url = ""
        self._thread = threading.Thread(target=self._serve, args=(host, port), name="histate-serve-http",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if not self.url:
            raise RuntimeError(f"histate serve did not start on {host}:{port}")

    def _serve(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)

        async def start():
            self._runner = web.AppRunner(build_app(self.engine), handle_signals=False)
            await self._runner.setup()
            await web.TCPSite(self._runner, host, port).start()
            bound_host, bound_port = self._runner.addresses[0][:2]
            self.url = f"http://{bound_host}:{bound_port}"

        try:
            self._loop.run_until_complete(start())
        finally:
            self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self.engine.close()


def run_forever(engine: ServingEngine, host: str, port: int) -> None:
    """`histate serve`: serve until Ctrl-C."""
    web.run_app(build_app(engine), host=host, port=port, print=None)
