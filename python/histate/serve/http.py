"""HTTP front of `histate serve`: the API subset `histate bench` (and SGLang's own clients) use.

  POST /generate         SGLang native: `input_ids`, `sampling_params.max_new_tokens` (ignore_eos is
                         implied: there is no EOS, every request produces exactly max_new_tokens),
                         `stream`. Events `data: {"text", "output_ids", "meta_info"}` then `data: [DONE]`,
                         meta_info as SGLang's (prompt_tokens, completion_tokens, cached_tokens, and at
                         the end cached_tokens_details by tier) plus `histate` (kv_hit_tokens, the
                         checkpoint's tier, queue and serve time)
  POST /v1/completions   OpenAI completions with a token-id `prompt`, `max_tokens`, `stream`,
                         `stream_options.include_usage`; usage.prompt_tokens_details.cached_tokens
  GET  /v1/models, /get_model_info, /health;  POST /flush_cache (empties every tier)

Sampling is greedy whatever `temperature` says, and there is no tokenizer: prompts are token ids
only and `text` is always "" (the model has random weights; its tokens mean nothing). Bad requests
get HTTP 400 with `{"error": {"message", "type", "code"}}`, as SGLang answers them.
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
from .engine import Job, ServingEngine

MODEL_NAME = "histate-tiny-qwen3.5"
ENGINE = web.AppKey("engine", ServingEngine)
_ids = itertools.count()


class BadRequest(ValueError):
    pass


def build_app(engine: ServingEngine) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    app[ENGINE] = engine
    app.add_routes([
        web.post("/generate", _generate), web.post("/v1/completions", _completions),
        web.get("/v1/models", _models), web.get("/get_model_info", _model_info),
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


def _token_ids(value, field: str, engine: ServingEngine) -> list:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]  # OpenAI: a batch of one prompt
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{field} must be a non-empty list of token ids (this server has no tokenizer)")
    vocab = engine.info()["vocab_size"]
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value):
        raise BadRequest(f"{field}: every token id must be an integer in [0, {vocab})")
    limit = engine.config.max_context_num_tokens
    if len(value) > limit:
        raise BadRequest(f"{field}: {len(value)} tokens exceed the max context of {limit}")
    return value


def _count(value, field: str, default: int, engine: ServingEngine) -> int:
    value = default if value is None else value
    limit = engine.config.max_new_tokens
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
        raise BadRequest(f"{field} must be an integer in [1, {limit}], got {value!r}")
    return value


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                             status=status)


# --- running a request -------------------------------------------------------------------------

class _Stream:
    """A submitted job's events, delivered on the event loop."""

    def __init__(self, engine: ServingEngine, token_ids: list, max_new_tokens: int) -> None:
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.job = Job(token_ids, max_new_tokens,
                       lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event))
        self.rid = f"{next(_ids):x}"
        self.started_s = time.monotonic()
        engine.submit(self.job)

    async def __aiter__(self):
        while True:
            event = await self.events.get()
            yield event
            if event[0] != "token":
                return


async def _run(request: web.Request, token_ids: list, max_new_tokens: int, stream: bool, fmt) -> web.StreamResponse:
    """Submit the job and answer: an event per token when streaming, one JSON object otherwise.
    `fmt(job, token_ids, output_ids, cached_tokens, done, stream)` -> the payloads to send."""
    engine = request.app[ENGINE]
    job = _Stream(engine, token_ids, max_new_tokens)
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
                if stream:
                    if response is None:
                        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                               "Cache-Control": "no-cache"})
                        await response.prepare(request)
                    for payload in fmt(job, token_ids, output_ids, data[1], None, stream):
                        await _send(response, payload)
                continue
            payloads = fmt(job, token_ids, output_ids, data[0]["cached_tokens"], data[0], stream)
            if not stream:
                return web.json_response(payloads[0])
            for payload in payloads:
                await _send(response, payload)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        job.job.cancel()  # no-op once done; stops decoding early if the client went away


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


# --- SGLang /generate ----------------------------------------------------------------------------

def _sglang_payloads(job: _Stream, token_ids, output_ids, cached_tokens, done: Optional[dict], stream) -> list:
    meta = {"id": job.rid, "finish_reason": None, "prompt_tokens": len(token_ids),
            "completion_tokens": len(output_ids), "cached_tokens": cached_tokens,
            "e2e_latency": time.monotonic() - job.started_s}
    if done is not None:
        meta["finish_reason"] = {"type": "length", "length": len(output_ids)}
        by_tier = done["cached_tokens_by_tier"]
        if cached_tokens:  # SGLang's cached_tokens_details: tokens per cache source
            meta["cached_tokens_details"] = {"device": by_tier.get(Tier.GPU, 0), "host": by_tier.get(Tier.CPU, 0),
                                             "storage": by_tier.get(Tier.SSD, 0)}
        meta["histate"] = {k: done[k] for k in ("kv_hit_tokens", "checkpoint_tier", "planned_checkpoint_pages",
                                                "queue_s", "serve_s")}
    return [{"text": "", "output_ids": list(output_ids), "meta_info": meta}]


async def _generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await _json_body(request)
        if "text" in body and "input_ids" not in body:
            raise BadRequest("text prompts are not supported: send input_ids (this server has no tokenizer)")
        token_ids = _token_ids(body.get("input_ids"), "input_ids", engine)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = _count(params.get("max_new_tokens"), "sampling_params.max_new_tokens", 128, engine)
    except BadRequest as err:
        return _error(str(err))
    return await _run(request, token_ids, max_new, bool(body.get("stream")), _sglang_payloads)


# --- OpenAI /v1/completions ----------------------------------------------------------------------

def _openai_payloads(include_usage: bool):
    def fmt(job: _Stream, token_ids, output_ids, cached_tokens, done: Optional[dict], stream) -> list:
        base = {"id": f"cmpl-{job.rid}", "object": "text_completion", "created": int(time.time()),
                "model": MODEL_NAME}
        finish = None if done is None else "length"
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
        usage = {"prompt_tokens": len(token_ids), "completion_tokens": len(output_ids),
                 "total_tokens": len(token_ids) + len(output_ids),
                 "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        if not stream:
            return [{**base, "choices": [choice], "usage": usage}]
        if done is None:
            return [{**base, "choices": [choice], "usage": None}]
        return [{**base, "choices": [choice], "usage": None}] + \
            ([{**base, "choices": [], "usage": usage}] if include_usage else [])

    return fmt


async def _completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await _json_body(request)
        token_ids = _token_ids(body.get("prompt"), "prompt", engine)
        max_new = _count(body.get("max_tokens"), "max_tokens", 16, engine)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object")
    except BadRequest as err:
        return _error(str(err))
    fmt = _openai_payloads(bool(options.get("include_usage")))
    return await _run(request, token_ids, max_new, bool(body.get("stream")), fmt)


# --- info ------------------------------------------------------------------------------------------

async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                          "owned_by": "histate"}]})


async def _model_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].info())


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
