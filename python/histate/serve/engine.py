"""The model side of `histate serve`: one worker thread that serves requests one at a time, FIFO.

Each request runs the reference executor's `serve` (histate/reference/executor.py): match and restore
from the tiers the cache policy chose, prefill the rest while capturing the planned checkpoints, then
decode. The executor decodes the tokens it is handed lazily, so greedy generation is a generator that
picks each token from the logits of the forward pass before it; `StreamingRunner` (a `ModelRunner`
whose passes report their logits) feeds it, and every token is handed to the request's `emit` as it
is produced -- the first one right after the prefill, which is what TTFT measures.

Policy "none" bypasses the cache entirely (a cold prefill every time), the no-reuse baseline.
One request at a time, no batching: a request's TTFT is its queueing behind earlier requests (their
whole prefill and decode) plus its own restore and prefill. `histate replay` models this server with
`EngineConfig(max_running_requests=1)` (benchmark/sim_vs_live.py).
"""
from __future__ import annotations

import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..core import Tier, available_policies, make_policy
from ..reference.executor import ReferenceExecutor
from ..reference.runner import ModelRunner
from ..reference.ssd import open_ssd
from ..reference.tokenizer import CharTokenizer

NO_CACHE = "none"
MiB = 2**20


def servable_policies() -> list:
    """Every policy the executor can mirror (explicit checkpoints), plus "none"."""
    return [p for p in available_policies() if not make_policy(p).dense_checkpoints] + [NO_CACHE]


@dataclass(frozen=True)
class ServeConfig:
    policy: str = "histate"
    capacity_bytes: dict = field(default_factory=lambda: {Tier.GPU: 64 * MiB, Tier.CPU: 256 * MiB,
                                                          Tier.SSD: 1024 * MiB})
    ssd_dir: Optional[Path] = None     # parent of the store's directory (default: the system temp dir)
    ssd_backend: str = "auto"          # histate.storage backend: auto | nixl | file
    max_context_num_tokens: int = 16384
    max_new_tokens: int = 4096
    check_mirror: bool = False         # after each request, prove the stores hold what the core says
    num_threads: int = 1               # torch threads of the worker

    def __post_init__(self) -> None:
        if self.policy not in servable_policies():
            raise ValueError(f"--policy {self.policy!r}: choose one of {', '.join(servable_policies())}")


class Generation:
    """Greedy output of one request, produced inside the executor's decode loop."""

    def __init__(self, max_new_tokens: int, emit: Callable) -> None:
        self.max_new_tokens = max_new_tokens
        self.emit = emit                  # emit(("token", token_id, cached_tokens))
        self.cached_tokens = 0
        self.output_ids: list = []
        self.cancelled = False
        self._logits = None

    def on_forward(self, logits, cached_tokens: Optional[int] = None) -> None:
        self._logits = logits
        if cached_tokens is not None:
            self.cached_tokens = cached_tokens

    def tokens_to_feed(self):
        """Yields the tokens the decode loop must feed: all output tokens but the last."""
        for k in range(self.max_new_tokens):
            token = int(self._logits.argmax())
            self.output_ids.append(token)
            self.emit(("token", token, self.cached_tokens))
            if k + 1 == self.max_new_tokens or self.cancelled:
                return
            yield token


class StreamingRunner(ModelRunner):
    """A ModelRunner whose forward passes report their logits to the current `Generation`."""

    generation: Optional[Generation] = None

    def prefill(self, cache, token_ids, start_position, capture_positions=()):
        result = super().prefill(cache, token_ids, start_position, capture_positions)
        self.generation.on_forward(result.last_logits, cached_tokens=start_position)
        return result

    def decode(self, cache, token_ids):
        out = []
        for token in token_ids:  # pulled one at a time: each token depends on the logits before it
            logits = super().decode(cache, [token])[0]
            self.generation.on_forward(logits)
            out.append(logits)
        return out


@dataclass
class Job:
    token_ids: list
    max_new_tokens: int
    emit: Callable                     # called from the worker thread; must be thread-safe
    enqueued_s: float = 0.0
    generation: Optional[Generation] = None
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.generation is not None:
            self.generation.cancelled = True


class ServingEngine:
    """Owns the model, the executor and the worker thread. `submit` from any thread."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.runner = StreamingRunner("fp32")
        self.geometry = self.runner.geometry
        self.tokenizer = CharTokenizer(self.runner.model.config.vocab_size)
        # Hugging Face files of the tokenizer, for clients that tokenize themselves (sglang.bench_serving
        # reads `tokenizer_path` from /model_info); ours, removed on close.
        self.tokenizer_dir = self.tokenizer.write_hf_tokenizer(
            Path(tempfile.mkdtemp(prefix="histate-serve-tokenizer-")), config.max_context_num_tokens)
        self._temp_dir = None
        self.executor: Optional[ReferenceExecutor] = None
        self._ssd = None
        self._jobs: queue.Queue = queue.Queue()
        self._t0 = time.monotonic()
        self._reset_cache()
        self._thread = threading.Thread(target=self._work, name="histate-serve-worker", daemon=True)
        self._thread.start()

    # --- API -----------------------------------------------------------------------------------
    def info(self) -> dict:
        c = self.config
        return {"model_path": "histate-reference/tiny-qwen3.5 (random weights)", "is_generation": True,
                "vocab_size": self.runner.model.config.vocab_size, "histate_policy": c.policy,
                "page_num_tokens": self.geometry.page_num_tokens,
                "kv_bytes_per_token": self.geometry.kv_bytes_per_token,
                "checkpoint_size_bytes": self.geometry.checkpoint_size_bytes,
                "capacity_bytes": {t.name.lower(): v for t, v in c.capacity_bytes.items()},
                "tokenizer_path": str(self.tokenizer_dir),
                "max_context_num_tokens": c.max_context_num_tokens, "max_new_tokens": c.max_new_tokens}

    def submit(self, job: Job) -> None:
        job.enqueued_s = time.monotonic()
        self._jobs.put(job)

    def flush(self, emit: Callable) -> None:
        """Empty every tier once the requests queued before it are served."""
        self._jobs.put(("flush", emit))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)
        self._close_ssd()
        shutil.rmtree(self.tokenizer_dir, ignore_errors=True)

    # --- worker --------------------------------------------------------------------------------
    def _work(self) -> None:
        import torch

        torch.set_num_threads(self.config.num_threads)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, tuple):  # flush
                self._reset_cache()
                job[1](("done", {}))
                continue
            if job.cancelled:
                continue
            try:
                job.emit(("done", self._serve(job)))
            except Exception as err:  # one request failed: tell its client, keep serving the others
                traceback.print_exc(file=sys.stderr)
                job.emit(("error", f"{type(err).__name__}: {err}"))

    def _serve(self, job: Job) -> dict:
        started = time.monotonic()
        generation = job.generation = Generation(job.max_new_tokens, job.emit)
        if job.cancelled:
            generation.cancelled = True
        self.runner.generation = generation
        page = self.geometry.page_num_tokens
        if self.executor is None:
            cache = self.runner.new_cache()
            self.runner.prefill(cache, job.token_ids, 0)
            self.runner.decode(cache, generation.tokens_to_feed())
            by_tier, kv_hit, checkpoint_tier, planned = {}, 0, None, ()
        else:
            served = self.executor.serve(job.token_ids, started - self._t0,
                                         decode_token_ids=generation.tokens_to_feed())
            if self.config.check_mirror:
                self.executor.check_mirror()
            by_tier = {t: n * page for t, n in served.kv_pages_by_tier_at_match.items() if n}
            kv_hit, checkpoint_tier = served.num_kv_pages * page, served.checkpoint_tier
            planned = served.planned_checkpoint_pages
        return {"cached_tokens": generation.cached_tokens, "output_ids": list(generation.output_ids),
                "cached_tokens_by_tier": by_tier, "kv_hit_tokens": kv_hit,
                "checkpoint_tier": checkpoint_tier.name.lower() if checkpoint_tier is not None else None,
                "planned_checkpoint_pages": list(planned), "queue_s": started - job.enqueued_s,
                "serve_s": time.monotonic() - started}

    def _reset_cache(self) -> None:
        """A fresh executor (empty tiers) over the same model; "none" has no executor."""
        self._close_ssd()
        c = self.config
        if c.policy == NO_CACHE:
            self.executor = None
            return
        # A fresh directory of our own every time (inside --ssd-dir when given): never reuse or delete
        # anything we did not create.
        if c.ssd_dir is not None:
            Path(c.ssd_dir).mkdir(parents=True, exist_ok=True)
        self._temp_dir = Path(tempfile.mkdtemp(prefix="histate-serve-ssd-", dir=c.ssd_dir))
        self._ssd = open_ssd(str(self._temp_dir), c.capacity_bytes[Tier.SSD], backend=c.ssd_backend)
        self.executor = ReferenceExecutor(self.runner, c.policy, c.capacity_bytes, self._ssd)

    def _close_ssd(self) -> None:
        if self._ssd is not None:
            self._ssd.close()
            self._ssd = None
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
