"""`histate bench --calibrate CSV`: measure a server's prefill latency for `histate replay --calibration`.

For each (context, new tokens) point of a grid, with fresh random token ids every repetition:
  1. primer: `context + 1` tokens, one output token -- the server caches its first `context` tokens
     (the last prompt token is always computed, so a cache keyed on full pages stores exactly those);
  2. probe: the primer's first `context` tokens + `new` fresh tokens, `decode_tokens` output tokens.
The probe's TTFT is the latency of prefilling `L - cached` tokens on `cached` reused ones, where
`cached` is what the server reports (a server that reuses less than `context` is recorded as it is),
including everything a real request pays: HTTP, queueing (none: probes run one at a time), restore.
Its later tokens give the time per decode step. Primer and probe share a routing key
(backends.ROUTING_KEY_HEADER), so a router with session affinity sends both to one worker.

Output: `PrefillProfile`'s CSV (num_tokens, context_num_tokens, latency_s; histate/sim/costs.py) with
extra columns it ignores: decode_step_s, cached_tokens, prompt_tokens.
"""
from __future__ import annotations

import asyncio
import csv
import random
import statistics
from pathlib import Path
from typing import Sequence

import aiohttp

from .backends import BenchError
from .sessions import RetryPolicy

COLUMNS = ("num_tokens", "context_num_tokens", "latency_s", "decode_step_s", "cached_tokens", "prompt_tokens")
DEFAULT_CONTEXTS = (0, 2048, 4096, 8192)      # sized for histate serve on CPU and 1/16-scaled Weka
DEFAULT_LENGTHS = (64, 512, 2048, 8192)        # (contexts up to 8K tokens): cover what is replayed


async def measure(backend, http: aiohttp.ClientSession, vocab_size: int, contexts: Sequence[int],
                  lengths: Sequence[int], reps: int, decode_tokens: int, retry: RetryPolicy, seed: int = 0,
                  on_point=lambda: None) -> list:
    rng = random.Random(f"histate-calibrate/{seed}")
    rows = []
    for rep in range(reps):
        for context in contexts:
            for new in lengths:
                prefix = rng.choices(range(vocab_size), k=context + 1)
                key = f"calibrate/{rep}/{context}/{new}"  # primer and probe on one worker behind a router
                if context:
                    await retry.call(lambda: backend.generate(http, prefix, 1, key))
                prompt = prefix[:context] + rng.choices(range(vocab_size), k=new)
                done = await retry.call(lambda: backend.generate(http, prompt, decode_tokens, key))
                cached = done.cached_tokens or 0
                step_s = (done.latency_s - done.ttft_s) / (decode_tokens - 1) if decode_tokens > 1 else float("nan")
                rows.append((len(prompt) - cached, cached, done.ttft_s, step_s, done.cached_tokens, len(prompt)))
                on_point()
    return rows


def write_profile(rows: list, path: Path, source: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        f.write(f"# measured by histate bench --calibrate against {source}\n")
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for n, ctx, latency, step, cached, prompt in rows:
            w.writerow([n, ctx, f"{latency:.6f}", f"{step:.6f}", "" if cached is None else cached, prompt])


def decode_step_s(path: Path) -> float:
    """Median decode step of a profile written by `write_profile` (the replay engine's per-step cost
    for a server that decodes one request at a time)."""
    with open(path, newline="") as f:
        rows = csv.DictReader(line for line in f if not line.lstrip().startswith("#"))
        steps = [float(r["decode_step_s"]) for r in rows if r.get("decode_step_s") not in (None, "", "nan")]
    if not steps:
        raise BenchError(f"{path}: no decode_step_s column (not written by histate bench --calibrate?)")
    return statistics.median(steps)


def calibrate_server(options, contexts: Sequence[int], lengths: Sequence[int], reps: int, path: Path,
                     decode_tokens: int = 8) -> list:
    """Measure the grid against `options.base_url` (blocking) and write the profile CSV."""
    from .run import DEFAULT_VOCAB_SIZE, check_base_url, progress_bar
    from .backends import make_backend

    backend = make_backend(options.backend, check_base_url(options.base_url), options.model)

    async def main():
        timeout = aiohttp.ClientTimeout(total=options.request_timeout_s, sock_connect=options.connect_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            info = await options.retry.call(lambda: backend.server_info(http))
            if options.flush_cache:
                await backend.flush_cache(http)
            vocab = options.vocab_size or info.vocab_size or DEFAULT_VOCAB_SIZE
            bar = progress_bar(reps * len(contexts) * len(lengths), "calibrate", unit="probe") if options.progress else None
            try:
                return await measure(backend, http, vocab, contexts, lengths, reps, decode_tokens, options.retry,
                                     options.admission.seed, bar.update if bar else (lambda: None))
            finally:
                if bar:
                    bar.close()

    rows = asyncio.run(main())
    write_profile(rows, path, f"{backend.base_url} ({backend.name})")
    return rows

