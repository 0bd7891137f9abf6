"""Closed-loop agent sessions against a live server, with `histate replay`'s admission, in wall time.

The rules are the replay driver's (histate/sim/replay.py), executed with real waits:
* admission: the root sessions of `admission_order(workload, config)` (seeded shuffle, `max_sessions`),
  at most `max_live_sessions` live at once; a root's slot frees when every session of its tree is done;
* a session's request 0 is sent `gap_before_s` after the session is released; request i > 0
  `gap_before_s` after the later of request i - 1's last token and the end of every child session in
  its `after_sessions`;
* a subagent is released when its parent's request `spawn_after_index` completes (-1: with its parent).

Every request is sent with its root session's id as routing key (backends.ROUTING_KEY_HEADER): a
router with session affinity keeps the whole tree, subagents included, on the worker holding its prefix.

One record per completed request, in the replay's `RequestRecord` (times in seconds since the run
started): arrival = when the request was sent, first token and completion as the client saw them,
and the request's position in its session (`session_index`: the report's non-first percentiles
leave out each session's cold first request).
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from ..sim.metrics import RequestRecord
from ..sim.replay import ReplayConfig, admission_order
from ..sim.request import Workload
from .backends import BenchError, TransientError
from .prompts import PromptBuilder


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3           # a request (or the readiness probe) is tried at most this often
    backoff_s: float = 0.5          # wait before retry i: backoff_s * 2**(i-1)

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.backoff_s < 0:
            raise ValueError(f"retries must be >= 0 and backoff >= 0, got {self}")

    async def call(self, make_call, on_retry: Callable = lambda err: None):
        """Await `make_call()`; retry TransientErrors; the last one becomes a BenchError."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await make_call()
            except TransientError as err:
                if attempt == self.max_attempts:
                    raise BenchError(f"{err} (gave up after {attempt} attempt{'s' * (attempt > 1)})") from None
                on_retry(err)
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))


def admitted_requests(workload: Workload, config: ReplayConfig) -> int:
    return sum(len(s.requests) for root in admission_order(workload, config) for s in root.iter_sessions())


class ClosedLoop:
    """Drives one workload through a backend. `records` grows as requests complete, so a run that is
    interrupted or fails still has everything that finished."""

    def __init__(self, workload: Workload, backend, http, prompts: PromptBuilder, config: ReplayConfig,
                 retry: RetryPolicy = RetryPolicy(), on_request_done: Callable = lambda record: None) -> None:
        self.workload, self.backend, self.http, self.prompts = workload, backend, http, prompts
        self.config, self.retry, self.on_request_done = config, retry, on_request_done
        self.records: list = []
        self.num_retries = 0
        self.cached_tokens_reported = True
        self._t0 = 0.0
        self._tasks: set = set()
        self._failure: asyncio.Future | None = None

    def now_s(self) -> float:
        return time.perf_counter() - self._t0

    async def run(self) -> list:
        loop = asyncio.get_running_loop()
        self._t0 = time.perf_counter()
        self._failure = loop.create_future()
        admission = self._spawn(self._admit_all())
        try:
            await asyncio.wait({admission, self._failure}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # failure, Ctrl-C (cancellation) or done: stop everything still running
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._failure.done():
            raise self._failure.exception()
        return self.records

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guard(self, coro) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # the first failure stops the run (run() re-raises it)
            if not self._failure.done():
                self._failure.set_exception(err)

    async def _admit_all(self) -> None:
        slots = asyncio.Semaphore(self.config.max_live_sessions)
        roots = []
        for root in admission_order(self.workload, self.config):
            await slots.acquire()
            roots.append(self._spawn(self._run_tree(root, slots)))
        await asyncio.gather(*roots)

    async def _run_tree(self, root, slots: asyncio.Semaphore) -> None:
        try:
            done = {s.session_id: asyncio.Event() for s in root.iter_sessions()}
            await self._run_session(root, done, root.session_id)
        finally:
            slots.release()

    async def _run_session(self, session, done: dict, root_id: str) -> None:
        children = defaultdict(list)
        for child in session.subagents:
            children[child.spawn_after_index].append(child)
        spawned = [self._spawn(self._run_session(c, done, root_id)) for c in children.pop(-1, [])]
        for index, req in enumerate(session.requests):
            for child_id in req.after_sessions:
                await done[child_id].wait()
            await asyncio.sleep(req.gap_before_s)
            await self._send(req, root_id)
            spawned += [self._spawn(self._run_session(c, done, root_id)) for c in children.pop(index, [])]
        done[session.session_id].set()  # its own requests are done (what after_sessions waits for)
        await asyncio.gather(*spawned)  # the tree's slot frees when every descendant is done too

    async def _send(self, req, routing_key: str) -> None:
        token_ids = self.prompts.prompt(req)
        sent = []

        async def attempt():
            sent.append(self.now_s())
            return await self.backend.generate(self.http, token_ids, req.output_num_tokens, routing_key)

        def count_retry(err):
            self.num_retries += 1

        done = await self.retry.call(attempt, count_retry)
        arrival_s = sent[-1]
        if done.cached_tokens is None:
            self.cached_tokens_reported = False
        reused = done.cached_tokens or 0
        kv_hit = done.kv_hit_tokens if done.kv_hit_tokens is not None else reused
        record = RequestRecord(req.uid, req.session_id, int(req.flags), arrival_s, len(token_ids), kv_hit, reused,
                               math.nan, arrival_s + done.ttft_s, arrival_s + done.latency_s,
                               session_index=req.index, server=done.server or "",
                               l3_hit_tokens=done.l3_hit_tokens or 0, output_digest=done.output_digest,
                               miss_tokens=done.miss_tokens)
        self.records.append(record)
        self.on_request_done(record)
