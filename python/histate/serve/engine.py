"""The model side of `histate serve`: one worker thread that serves requests one at a time, FIFO.

Each request runs the reference executor's `serve` (histate/reference/executor.py): match and restore
from the tiers the cache policy chose, prefill the rest while capturing the planned checkpoints, then
decode. The executor decodes the tokens it is handed lazily, so greedy generation is a generator that
picks each token from the logits of the forward pass before it; `StreamingRunner` (a `ModelRunner`
whose passes report their logits) feeds it, and every token is handed to the request's `emit` as it
is produced -- the first one right after the prefill, which is what TTFT measures.

Policy "none" bypasses the cache entirely (a cold prefill every time), the no-reuse baseline.
With `l3_master` (`--l3-master HOST:PORT`), the executor also reads and writes a shared Mooncake
store beside its tiers (reference/l3_tier.py): another worker's turn can resume here. L3 puts are
synchronous, after the request's last token has been emitted and before the next request starts.
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
from ..core import DEFAULT_PIN_TTL_S, L3WriteConfig
from ..reference.executor import ReferenceExecutor
from ..reference.l3_tier import L3Tier
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
    l3_master: Optional[str] = None    # HOST:PORT of a Mooncake master: the shared L3 tier, or none
    l3_key_prefix: str = "histate"     # namespace of this deployment's objects in the store
    l3_pin_ttl_s: float = DEFAULT_PIN_TTL_S  # soft pin of each path's deepest state and its page

    def __post_init__(self) -> None:
        if self.policy not in servable_policies():
            raise ValueError(f"--policy {self.policy!r}: choose one of {', '.join(servable_policies())}")
        if self.l3_master is not None and self.policy == NO_CACHE:
            raise ValueError("--l3-master needs a cache policy: policy 'none' reuses nothing")
        L3WriteConfig(pin_ttl_s=self.l3_pin_ttl_s)  # raises ValueError on a negative TTL


@dataclass
class WorkerStats:
    """Per-worker counters (GET /get_server_info): how much of each prompt came from where."""

    requests: int = 0
    prompt_tokens: int = 0
    local_hit_tokens: int = 0          # resumed from this worker's own tiers
    l3_hit_tokens: int = 0             # resumed from the shared L3 store beyond the local hit
    l3_hit_requests: int = 0

    def add(self, prompt_tokens: int, local_hit_tokens: int, l3_hit_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.local_hit_tokens += local_hit_tokens
        self.l3_hit_tokens += l3_hit_tokens
        self.l3_hit_requests += l3_hit_tokens > 0


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
        self.l3 = _connect_l3(config)
        self.stats = WorkerStats()
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
                "max_context_num_tokens": c.max_context_num_tokens, "max_new_tokens": c.max_new_tokens,
                **({"l3_master": c.l3_master, "l3_key_prefix": c.l3_key_prefix} if self.l3 is not None else {})}

    def server_stats(self) -> dict:
        """Counters since start (a flush empties the local tiers, not these, nor L3)."""
        stats = dict(self.stats.__dict__)
        if self.l3 is not None:
            stats["l3"] = self.l3.stats_dict()
        return stats

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
        if self.l3 is not None:
            self.l3.client.close()
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
            by_tier, kv_hit, checkpoint_tier, planned, l3_pages = {}, 0, None, (), 0
        else:
            served = self.executor.serve(job.token_ids, started - self._t0,
                                         decode_token_ids=generation.tokens_to_feed())
            if self.config.check_mirror:
                self.executor.check_mirror()
            by_tier = {t: n * page for t, n in served.kv_pages_by_tier_at_match.items() if n}
            kv_hit, checkpoint_tier = served.num_kv_pages * page, served.checkpoint_tier
            planned, l3_pages = served.planned_checkpoint_pages, served.num_l3_pages
        l3_tokens = l3_pages * page
        self.stats.add(len(job.token_ids), generation.cached_tokens - l3_tokens, l3_tokens)
        return {"cached_tokens": generation.cached_tokens, "output_ids": list(generation.output_ids),
                "l3_cached_tokens": l3_tokens if self.l3 is not None else None,
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
        self.executor = ReferenceExecutor(self.runner, c.policy, c.capacity_bytes, self._ssd, l3=self.l3)

    def _close_ssd(self) -> None:
        if self._ssd is not None:
            self._ssd.close()
            self._ssd = None
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None


def _connect_l3(config: ServeConfig) -> Optional[L3Tier]:
    """This worker's L3 tier, or None without --l3-master. A master that cannot be reached at start
    is an error (ConnectionError, an OSError): a typo should not silently serve without L3. Faults
    after start are misses."""
    if config.l3_master is None:
        return None
    from ..l3.client import L3Client

    return L3Tier(L3Client(config.l3_master, key_prefix=config.l3_key_prefix),
                  L3WriteConfig(pin_ttl_s=config.l3_pin_ttl_s))
