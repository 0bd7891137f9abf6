"""`histate bench`: one workload against one live server, written in `histate replay`'s report schema.

Order of a run: check the URL, ask the server what it is (readiness, vocabulary, the policy of a
`histate serve`), empty its prefix cache (a replay starts cold too), replay the admitted sessions
closed-loop, then write requests.csv / summary.json / plots with `histate.sim.report`. The run is one
"policy" of the report, named by `--label` (default: the policy `histate serve` reports, else "live").

Before anything is sent, the admitted requests are checked against the limits the server reports
(`histate serve`'s max context and max new tokens, vLLM's max_model_len): a workload the server would
refuse part of is refused up front, in one line saying which flag clips it (`check_server_limits`).

A run that stops early keeps what it measured. Ctrl-C: requests in flight are abandoned, everything
completed is written, and summary.json says `interrupted: true`. A failure once requests are going
out (the server dies, a request fails all its retries, a wrong answer) raises `RunFailed`, which
carries the partial result (its summary's `bench.error` says why) for the caller to write; a
failure before the first request (unreachable server, limits, vocabulary) raises a plain
BenchError: nothing was measured.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

import aiohttp

from ..sim.metrics import PolicyRun, percentile
from ..sim.replay import ReplayConfig, admission_order
from ..sim.report import build_summary, format_table, write_outputs
from ..sim.request import Workload
from .backends import BenchError, ServerInfo, make_backend
from .prompts import PromptBuilder
from .scaling import pages_per_scaled_page
from .sessions import ClosedLoop, RetryPolicy, admitted_requests

DEFAULT_VOCAB_SIZE = 32000  # ids below this are ordinary tokens in every tokenizer we target


@dataclass(frozen=True)
class BenchOptions:
    base_url: str
    backend: str = "sglang"
    model: Optional[str] = None              # OpenAI model name (default: the first of /v1/models)
    vocab_size: Optional[int] = None         # default: the server's (histate serve), else DEFAULT_VOCAB_SIZE
    label: Optional[str] = None
    admission: ReplayConfig = field(default_factory=ReplayConfig)  # max_live_sessions, max_sessions, seed
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    flush_cache: bool = True
    progress: bool = True
    on_record: Optional[Callable] = None     # called with each completed RequestRecord (histate cluster's failure trigger)


@dataclass
class BenchResult:
    run: PolicyRun
    summary: dict
    interrupted: bool = False
    error: Optional[str] = None        # why a run that had started stopped early (module docstring)


class RunFailed(BenchError):
    """The run failed after requests went out; `result` keeps every request that completed."""

    def __init__(self, result: BenchResult) -> None:
        super().__init__(result.error)
        self.result = result


def check_base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"--base-url: expected http://HOST:PORT, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise BenchError(f"--base-url: bad port in {url!r}") from None
    return url.rstrip("/")


def check_server_limits(workload: Workload, admission: ReplayConfig, info: ServerInfo) -> None:
    """Raise BenchError if an admitted request is longer than the server takes. Refused, not clipped:
    a live run of a silently clipped workload is no longer the one `histate replay` predicts;
    --max-context clips both the same way, and the message says what value fits."""
    requests = [r for root in admission_order(workload, admission) for s in root.iter_sessions() for r in s.requests]
    k = pages_per_scaled_page(workload.params.get("token_scale", 1.0))  # --max-context counts trace tokens
    checks = (  # (limit, tokens of a request, what is over, where the server said it, the fix)
        (info.max_prompt_num_tokens, lambda r: r.input_num_tokens, "prompts over the server's max context of",
         "max_context_num_tokens in /get_model_info",
         lambda limit: f"pass --max-context {limit * k} (a session ends at its first longer request; give "
                       f"histate replay the same) or a smaller --token-scale"),
        (info.max_new_tokens, lambda r: r.output_num_tokens, "outputs over the server's max new tokens of",
         "max_new_tokens in /get_model_info", lambda limit: "pass a smaller --token-scale"),
        (info.max_total_num_tokens, lambda r: r.input_num_tokens + r.output_num_tokens,
         "prompt + output over the server's max model length of", "max_model_len in /v1/models",
         lambda limit: "pass a smaller --max-context or --token-scale"),
    )
    for limit, num_tokens, what, source, fix in checks:
        over = [num_tokens(r) for r in requests if limit is not None and num_tokens(r) > limit]
        if over:
            raise BenchError(f"{len(over):,} of the {len(requests):,} admitted requests have {what} {limit:,} "
                             f"tokens ({source}; the longest has {max(over):,}); nothing was sent: {fix(limit)}")


def run_bench(workload: Workload, options: BenchOptions) -> BenchResult:
    """Run the bench (blocking). Raises BenchError for a problem found before the first request and
    RunFailed (with the partial result) for one later; Ctrl-C returns the partial result."""
    base_url = check_base_url(options.base_url)
    backend = make_backend(options.backend, base_url, options.model)
    state = _RunState(workload, backend, options)
    try:
        asyncio.run(state.main())
    except KeyboardInterrupt:
        state.interrupted = True
    except BenchError as err:
        if state.loop_driver is None:  # nothing was sent: nothing to keep
            raise
        state.error = str(err)
    finally:
        if state.bar is not None:
            state.bar.close()
    result = state.result()
    if result.error:
        raise RunFailed(result)
    return result


class _RunState:
    def __init__(self, workload: Workload, backend, options: BenchOptions) -> None:
        self.workload, self.backend, self.options = workload, backend, options
        self.loop_driver: Optional[ClosedLoop] = None
        self.info = None
        self.cache_flushed: Optional[bool] = None
        self.interrupted = False
        self.error: Optional[str] = None
        self.bar = None
        self.started_s = time.perf_counter()

    async def main(self) -> None:
        options = self.options
        timeout = aiohttp.ClientTimeout(total=options.request_timeout_s, sock_connect=options.connect_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            self.info = await options.retry.call(lambda: self.backend.server_info(http))
            vocab = options.vocab_size or self.info.vocab_size or DEFAULT_VOCAB_SIZE
            if self.info.vocab_size and vocab > self.info.vocab_size:
                raise BenchError(f"--vocab-size {vocab} exceeds the server's vocabulary ({self.info.vocab_size})")
            check_server_limits(self.workload, options.admission, self.info)
            if options.flush_cache:
                self.cache_flushed = await self.backend.flush_cache(http)
            prompts = PromptBuilder(self.workload.page_num_tokens, vocab, salt=options.admission.seed)
            self.bar = progress_bar(admitted_requests(self.workload, options.admission), self.label) \
                if options.progress else None
            self.loop_driver = ClosedLoop(self.workload, self.backend, http, prompts, options.admission,
                                          options.retry, self._on_request_done)
            self.started_s = time.perf_counter()
            await self.loop_driver.run()

    @property
    def label(self) -> str:
        if self.options.label:
            return self.options.label
        return (self.info.policy if self.info and self.info.policy else None) or "live"

    def _on_request_done(self, record) -> None:
        if self.options.on_record is not None:
            self.options.on_record(record)
        if self.bar is None:
            return
        self.bar.update()
        records = self.loop_driver.records
        if len(records) % 10 == 1:
            ttfts = [r.ttft_s for r in records]
            reused = sum(r.reused_tokens for r in records)
            self.bar.set_postfix_str(f"TTFT p50 {percentile(ttfts, 50):.3f}s hit {reused / max(1, sum(r.input_tokens for r in records)):.0%}")

    def result(self) -> BenchResult:
        records = self.loop_driver.records if self.loop_driver else []
        wall_s = time.perf_counter() - self.started_s
        run = PolicyRun(self.label, list(records), None, {}, wall_s)
        summary = build_summary({self.label: run})
        driver = self.loop_driver
        summary["bench"] = {
            "base_url": self.backend.base_url, "backend": self.backend.name, "model": self.backend.model,
            "server_policy": self.info.policy if self.info else None, "workload": self.workload.name,
            "admitted_requests": admitted_requests(self.workload, self.options.admission),
            "completed_requests": len(records), "interrupted": self.interrupted, "error": self.error,
            "retries": driver.num_retries if driver else 0,
            "cached_tokens_reported": driver.cached_tokens_reported if driver else None,
            "cache_flushed": self.cache_flushed, "wall_s": wall_s,
            "max_live_sessions": self.options.admission.max_live_sessions, "seed": self.options.admission.seed,
            "workload_params": self.workload.params,
        }
        return BenchResult(run, summary, self.interrupted, self.error)


def report(result: BenchResult, out_dir: Path, plots: bool) -> list:
    """Print the replay table and write the outputs; returns the paths written."""
    print(format_table(result.summary))
    bench = result.summary["bench"]
    if not bench["cached_tokens_reported"]:
        print("note: the server does not report cached tokens (vLLM: --enable-prompt-tokens-details); hit rate shows 0")
    if bench["cache_flushed"] is False:
        print("note: the server refused to flush its prefix cache; the run did not start cold")
    n, wall = bench["completed_requests"], bench["wall_s"]
    state = "interrupted after" if result.interrupted else "stopped by an error after" if result.error else "completed"
    print(f"  {result.run.policy}: {state} {n} of {bench['admitted_requests']} requests in {wall:.1f} s "
          f"({bench['retries']} retries)")
    written = write_outputs({result.run.policy: result.run}, result.summary, out_dir, plots=plots)
    print("wrote " + ", ".join(str(p) for p in written))
    return written


def progress_bar(total: int, name: str, unit: str = "req"):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"{name:>16}", unit=unit, mininterval=0.5)

