"""Streaming clients of the two server APIs `histate bench` speaks, and what counts as a wrong answer.

* `sglang`: SGLang's native `POST /generate` with `input_ids`, `sampling_params.max_new_tokens`,
  `ignore_eos` and `stream: true`. The server answers with server-sent events `data: {json}` ending
  with `data: [DONE]` (sglang/srt/entrypoints/http_server.py `serve_generate_request`); every event
  carries `meta_info` with `prompt_tokens`, `completion_tokens` and `cached_tokens`
  (sglang/srt/managers/tokenizer_manager.py, where meta_info is filled). This is also what
  `histate serve` answers.
* `openai`: `POST /v1/completions` with a token-id prompt, `max_tokens`, `ignore_eos` and
  `stream_options.include_usage`, as vLLM and SGLang serve it; cached tokens come from
  `usage.prompt_tokens_details.cached_tokens` in the last event (vLLM fills it only with
  `--enable-prompt-tokens-details`; without it they are reported as unknown, never as 0).

`server_info` also reads the longest request the server takes where it says so (`histate serve`'s
max_context_num_tokens and max_new_tokens in /get_model_info, vLLM's max_model_len in /v1/models),
for the bench to check the workload against before sending anything.

TTFT is measured on the client from sending the request to the first event that carries an output
token. A server that returns a different prompt length than it was sent, or a different number of
output tokens than forced, is answering wrongly: the bench stops with one line naming the field.
Transport failures and 5xx/429 answers before the first token are `TransientError`s (the caller
retries them), and so is a stream that breaks after its first token (`StreamBroken`): behind a router
that is a worker dying mid-request, and the resent request goes to a live worker (sglang-router cannot
retry a stream it has started forwarding; the client sees aiohttp's "Response payload is not
completed"). The retried request is measured from its resend. Everything else is a `BenchError`.

Every request of an agent session carries `X-SMG-Routing-Key: <its root session's id>` (subagents
share their root's), so sglang-router's `--policy manual` keeps a whole session tree on one worker,
where its prefix cache is; a server without a router ignores the header.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import aiohttp

from ..core import MISS_REASONS

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router's manual policy (sgl-model-gateway policies/manual.rs)


class BenchError(Exception):
    """A fatal, one-line problem: bad flags, an unreachable server, a wrong answer."""


class TransientError(BenchError):
    """A failure that may pass when retried (connection refused or reset, timeout, 5xx, 429)."""


class StreamBroken(TransientError):
    """The connection broke after the first token (a worker behind a router died mid-request)."""


@dataclass(slots=True)
class Completion:
    ttft_s: float                   # send -> first event with an output token
    latency_s: float                # send -> last event
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: Optional[int]    # reused prompt tokens; None when the server does not say
    kv_hit_tokens: Optional[int] = None  # histate's KV match (>= cached), when the server reports it
    server: Optional[str] = None         # the worker that served it (histate serve names itself)
    l3_hit_tokens: Optional[int] = None  # of cached_tokens, those read from the shared L3 store
    output_digest: str = ""              # BLAKE2b of the output ids, when the server streams them
    miss_tokens: Optional[dict] = None   # uncached prompt tokens by reason (SGLang --histate-miss-reasons)


def miss_reasons(value) -> Optional[dict]:
    """meta_info["histate_miss"] of SGLang with --histate-miss-reasons (a one-element list, docs/misses.md):
    the tokens by reason, or None when the server did not send them (or sent something else)."""
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict):
        return None
    tokens = value[0].get("tokens")
    if not isinstance(tokens, dict) or set(tokens) != set(MISS_REASONS):
        return None
    if not all(isinstance(v, int) and v >= 0 for v in tokens.values()):
        return None
    return {reason: tokens[reason] for reason in MISS_REASONS}


def output_digest(output_ids: list) -> str:
    """A short, exact name of an output: equal digests = equal token ids (what exactness checks compare)."""
    return hashlib.blake2b(",".join(map(str, output_ids)).encode(), digest_size=12).hexdigest()


@dataclass(slots=True)
class ServerInfo:
    model: Optional[str] = None
    vocab_size: Optional[int] = None
    policy: Optional[str] = None    # histate serve's cache policy
    # The longest request the server takes, when it says (None: unknown): a request over it would be
    # refused mid-run, so the bench checks the workload against these first (run.check_server_limits).
    max_prompt_num_tokens: Optional[int] = None   # /get_model_info max_context_num_tokens (histate serve)
    max_new_tokens: Optional[int] = None          # /get_model_info max_new_tokens (histate serve)
    max_total_num_tokens: Optional[int] = None    # /v1/models max_model_len, prompt + output (vLLM)


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Backend:
    """Shared transport: status checks, the SSE reader, transient-error mapping."""

    name = ""
    generate_path = ""

    def __init__(self, base_url: str, model: Optional[str] = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model

    def url(self, path: str) -> str:
        return self.base_url + path

    async def _get_json(self, http: aiohttp.ClientSession, path: str, required: bool = True):
        url = self.url(path)
        try:
            async with http.get(url) as resp:
                if resp.status != 200:
                    if not required:
                        return None
                    await _raise_for_status(resp, url)
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise TransientError(f"cannot reach {url}: {_one_line(err) or type(err).__name__}") from None
        except ValueError:
            if not required:
                return None
            raise BenchError(f"{url}: answer is not JSON") from None

    async def flush_cache(self, http: aiohttp.ClientSession) -> bool:
        """Empty the server's prefix cache so the run starts cold, as a replay does. False if refused."""
        for path in self.flush_paths:
            try:
                async with http.post(self.url(path)) as resp:
                    if resp.status == 200:
                        return True
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
        return False

    async def generate(self, http: aiohttp.ClientSession, token_ids: list, max_new_tokens: int,
                       routing_key: Optional[str] = None) -> Completion:
        """Stream one request; `routing_key` (the root session's id) goes in ROUTING_KEY_HEADER."""
        url = self.url(self.generate_path)
        payload = self.payload(token_ids, max_new_tokens)
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        start = time.perf_counter()
        first_s = last_s = None
        final = None
        try:
            async with http.post(url, json=payload, headers=headers) as resp:
                await _raise_for_status(resp, url)
                async for event in _sse_events(resp, url):
                    if "error" in event:
                        raise BenchError(f"{url}: server error: {_one_line(_error_message(event['error']))}")
                    now = time.perf_counter()
                    if first_s is None and self.has_token(event, url):
                        first_s = now
                    last_s = now
                    final = self.merge(final, event)
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            what = _one_line(err) or type(err).__name__
            if first_s is None:
                raise TransientError(f"{url}: {what}") from None
            raise StreamBroken(f"{url}: stream broke after the first token: {what}") from None
        if first_s is None:
            raise BenchError(f"{url}: the stream ended without an output token")
        done = self.completion(final, url)
        if done.prompt_tokens != len(token_ids):
            raise BenchError(f"{url}: prompt_tokens={done.prompt_tokens}, but the prompt has {len(token_ids)} "
                             f"token ids (does the server re-tokenize it?)")
        if done.completion_tokens != max_new_tokens:
            raise BenchError(f"{url}: completion_tokens={done.completion_tokens}, forced {max_new_tokens} "
                             f"(does the server honour ignore_eos?)")
        done.ttft_s, done.latency_s = first_s - start, last_s - start
        return done


class SGLangBackend(_Backend):
    name = "sglang"
    generate_path = "/generate"
    flush_paths = ("/flush_cache",)

    def payload(self, token_ids: list, max_new_tokens: int) -> dict:
        return {"input_ids": token_ids, "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0.0}}

    def has_token(self, event: dict, url: str) -> bool:
        meta = event.get("meta_info")
        if not isinstance(meta, dict):
            raise BenchError(f"{url}: event lacks meta_info (is this an SGLang /generate endpoint?)")
        return bool(meta.get("completion_tokens") or event.get("output_ids"))

    def merge(self, final, event: dict):
        return event  # meta_info is cumulative: the last event holds the totals

    def completion(self, event: dict, url: str) -> Completion:
        meta = event["meta_info"]
        values = {}
        for field in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            value = meta.get(field)
            if not isinstance(value, int) or value < 0:
                raise BenchError(f"{url}: meta_info.{field} is {value!r}, expected a count")
            values[field] = value
        histate = meta.get("histate") if isinstance(meta.get("histate"), dict) else {}
        kv_hit, l3_hit, worker = histate.get("kv_hit_tokens"), meta.get("l3_cached_tokens"), histate.get("worker")
        output_ids = event.get("output_ids")
        return Completion(0.0, 0.0, values["prompt_tokens"], values["completion_tokens"], values["cached_tokens"],
                          kv_hit if isinstance(kv_hit, int) else None,
                          worker if isinstance(worker, str) else None, l3_hit if isinstance(l3_hit, int) else None,
                          output_digest(output_ids) if isinstance(output_ids, list) else "",
                          miss_reasons(meta.get("histate_miss")))

    async def server_info(self, http: aiohttp.ClientSession) -> ServerInfo:
        info = await self._get_json(http, "/get_model_info")
        if not isinstance(info, dict):
            raise BenchError(f"{self.url('/get_model_info')}: expected a JSON object")
        return _with_model_info(ServerInfo(info.get("model_path")), info)


class OpenAIBackend(_Backend):
    name = "openai"
    generate_path = "/v1/completions"
    flush_paths = ("/reset_prefix_cache", "/flush_cache")  # vLLM (dev mode), SGLang

    def payload(self, token_ids: list, max_new_tokens: int) -> dict:
        return {"model": self.model, "prompt": token_ids, "max_tokens": max_new_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def has_token(self, event: dict, url: str) -> bool:
        choices = event.get("choices")
        if choices is None and "usage" not in event:
            raise BenchError(f"{url}: event has neither choices nor usage (is this a /v1/completions endpoint?)")
        return bool(choices)

    def merge(self, final, event: dict):
        return event if event.get("usage") else final

    def completion(self, event, url: str) -> Completion:
        usage = event.get("usage") if event else None
        if not isinstance(usage, dict):
            raise BenchError(f"{url}: no usage in the stream (stream_options.include_usage ignored?)")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        for field, value in (("prompt_tokens", prompt), ("completion_tokens", completion)):
            if not isinstance(value, int) or value < 0:
                raise BenchError(f"{url}: usage.{field} is {value!r}, expected a count")
        return Completion(0.0, 0.0, prompt, completion, cached if isinstance(cached, int) else None)

    async def server_info(self, http: aiohttp.ClientSession) -> ServerInfo:
        listing = await self._get_json(http, "/v1/models")
        models = listing.get("data") if isinstance(listing, dict) else None
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise BenchError(f"{self.url('/v1/models')}: no model listed")
        if self.model is None:
            self.model = models[0]["id"]
        listed = next((m for m in models if isinstance(m, dict) and m.get("id") == self.model), {})
        server = ServerInfo(self.model, max_total_num_tokens=_int_or_none(listed.get("max_model_len")))
        info = await self._get_json(http, "/get_model_info", required=False)  # histate serve / SGLang
        return _with_model_info(server, info) if isinstance(info, dict) else server


BACKENDS = {"sglang": SGLangBackend, "openai": OpenAIBackend}


def make_backend(name: str, base_url: str, model: Optional[str] = None) -> _Backend:
    return BACKENDS[name](base_url, model)


async def _raise_for_status(resp: aiohttp.ClientResponse, url: str) -> None:
    if resp.status == 200:
        return
    body = await resp.text(errors="replace")
    try:
        message = _error_message(json.loads(body).get("error", body))
    except (ValueError, AttributeError):
        message = body
    text = f"{url}: HTTP {resp.status}: {_one_line(message)}"
    if resp.status >= 500 or resp.status == 429:
        raise TransientError(text)
    raise BenchError(text)


def _error_message(error) -> str:
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _with_model_info(server: ServerInfo, info: dict) -> ServerInfo:
    """`server` plus what /get_model_info says: vocabulary, histate serve's policy and limits."""
    server.vocab_size = _int_or_none(info.get("vocab_size"))
    server.policy = info.get("histate_policy")
    server.max_prompt_num_tokens = _int_or_none(info.get("max_context_num_tokens"))
    server.max_new_tokens = _int_or_none(info.get("max_new_tokens"))
    return server


def _int_or_none(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def _sse_events(resp: aiohttp.ClientResponse, url: str) -> AsyncIterator[dict]:
    """JSON payloads of `data:` lines until `data: [DONE]` (lines split by hand: SGLang's cumulative
    output_ids make lines longer than aiohttp's readline limit on long outputs)."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                event = json.loads(data)
            except ValueError:
                raise BenchError(f"{url}: not JSON in the event stream: {data[:80]!r}") from None
            if not isinstance(event, dict):
                raise BenchError(f"{url}: event is not a JSON object: {data[:80]!r}")
            yield event
    if buffer.strip():
        raise BenchError(f"{url}: stream ended inside an event")
