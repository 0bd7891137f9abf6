"""Checkpoints inside a long prefill: chunk ends placed on the positions HiState planned.

SGLang 0.5.23 keeps one recurrent state per request per forward pass: with the extra (ping-pong)
buffer, a chunk of a chunked prefill tracks the state at `prefix + floor(extend / grid) * grid`
and `Scheduler.stash_chunked_request` inserts it into the tree (research §2.2). So a checkpoint
lands wherever a chunk ends. HiState plans positions per segment with the adaptive interval
controller (`HiStateRadixCache.plan_checkpoints`, eq. 5) and moves chunk ends onto them:

  floor  a chunk that SGLang cuts anyway ends at the last planned position inside it. Chunks get
         at most one interval shorter, so the pass count rarely changes (see
         `count_prefill_passes`); planned positions strictly inside a chunk are captured only by
         the multi-position kernel path (GPU, sgl-kernel-ext), not here.
  split  additionally every planned position ends a chunk (the first admission of a prompt that
         would fit in one pass is cut at its first planned position): every planned checkpoint
         exists, at one extra forward pass per checkpoint that would otherwise fall inside a chunk.
  off    SGLang's chunking is left alone.

Two HookRegistry hooks on `PrefillAdder` apply it: AROUND `_commit_prefill_admission` (a new
request: its plan is made here, from the reused prefix) and AROUND `floor_chunked_tokens` (a
continuing chunk; `add_chunked_req` is wrapped to say which request is being cut). Only cuts
are moved: a final chunk is never shortened, so a request's prefill always completes.

A cut request ends the batch's admission. The scheduler tracks one chunked request
(`scheduler.py:4324-4327`: `assert self.chunked_req is None` before it takes
`adder.new_chunked_req`), and stock keeps a batch to one truncated request only through the
budget: a truncated admission takes the whole remaining chunk (`extend_len =
chunk_tokens_limit`, schedule_policy.py:1646-1674; a continuing chunk takes `_rem_tokens`,
:1140-1222), so `budget_state()` (:874-893) stops the loop at scheduler.py:4207 or :4279.
A chunk HiState shortened leaves budget behind; without ending the budget, a second request
could be truncated in the same batch (and decode from a cut prompt, not being the one
`chunked_req`) or a new request chunked next to a continuing one (the assert). So after a cut
the chunk budget is spent: `rem_chunk_tokens` <= 0.
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Optional, Sequence

_MODULE = "sglang.srt.managers.schedule_policy.PrefillAdder"
_installed = False


@dataclasses.dataclass
class _ContinuingChunk:
    """The request `add_chunked_req` is sizing, and whether HiState cut its chunk."""

    req: Any
    cut: bool = False


_continuing: contextvars.ContextVar[Optional[_ContinuingChunk]] = contextvars.ContextVar(
    "histate_continuing_chunk", default=None)


def align_chunk_end(prefix_len: int, extend_len: int, total_len: int, plan: Sequence[int], mode: str) -> int:
    """New extend length for a chunk over (prefix, prefix + extend] of a prompt of `total_len`.

    `plan` holds absolute token positions. Never longer than `extend_len`, never empty.
    """
    end = prefix_len + extend_len
    inside = [p for p in plan if prefix_len < p <= end]
    if mode == "off" or not inside:
        return extend_len
    if mode == "split":
        return min(inside) - prefix_len
    if end < total_len:  # floor: only a real cut moves
        return max(inside) - prefix_len
    return extend_len


def count_prefill_passes(prefix_len: int, total_len: int, chunk_tokens: int, plan: Sequence[int],
                         mode: str) -> tuple[int, list[int]]:
    """Forward passes and chunk ends for one prompt under `mode` (the cost model in docs)."""
    ends, pos = [], prefix_len
    while pos < total_len:
        extend = min(chunk_tokens, total_len - pos)
        extend = align_chunk_end(pos, extend, total_len, plan, mode)
        pos += extend
        ends.append(pos)
    return len(ends), ends


def _histate_cache(adder: Any) -> Any:
    cache = getattr(adder, "tree_cache", None)
    return cache if getattr(cache, "histate", None) is not None else None


def plan_of(req: Any, cache: Any, reused_tokens: int) -> list[int]:
    """The request's planned checkpoint positions, made once at its first admission."""
    plan = getattr(req, "_hs_plan", None)
    if plan is None:
        # SGLang's own branch point (the grid position at the KV match end) is HiState's too.
        branch = getattr(req, "mamba_branching_seqlen", None)
        plan = cache.plan_checkpoints(reused_tokens, len(req.full_untruncated_fill_ids), branch)
        req._hs_plan = plan
    return plan


def end_chunk_budget(adder: Any) -> None:
    """Spend the batch's chunk budget, so `budget_state()` ends admission (module docstring)."""
    adder.rem_chunk_tokens = min(adder.rem_chunk_tokens, 0)


def commit_admission_around(original: Any, adder: Any, req: Any, admission: Any, *args: Any, **kwargs: Any) -> Any:
    cache = _histate_cache(adder)
    cut = False
    if cache is not None and adder.rem_chunk_tokens is not None:  # chunked prefill is on
        mode = cache.histate.config.chunk_align
        total = len(req.full_untruncated_fill_ids)
        plan = plan_of(req, cache, admission.prefix_len)
        can_cut = admission.is_chunked or (mode == "split" and adder.new_chunked_req is None)
        if can_cut:
            extend = align_chunk_end(admission.prefix_len, admission.extend_len, total, plan, mode)
            if extend != admission.extend_len:
                admission = dataclasses.replace(admission, extend_len=extend, is_chunked=True, max_new_tokens=0)
                cache.histate.metrics.record_chunk_cut("floor" if mode == "floor" else "split")
                cut = True
    result = original(adder, req, admission, *args, **kwargs)
    if cut:
        end_chunk_budget(adder)
    return result


def add_chunked_req_around(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    chunk = _ContinuingChunk(req)
    token = _continuing.set(chunk)
    try:
        result = original(adder, req, *args, **kwargs)
    finally:
        _continuing.reset(token)
    if chunk.cut:
        end_chunk_budget(adder)
    return result


def floor_chunked_tokens_around(original: Any, adder: Any, trunc_len: int, remaining: int) -> int:
    new_len = original(adder, trunc_len, remaining)
    chunk, cache = _continuing.get(), _histate_cache(adder)
    if chunk is None or cache is None or new_len >= remaining:
        return new_len  # not a continuing chunk of ours, or the final chunk: never shortened
    req, mode = chunk.req, cache.histate.config.chunk_align
    aligned = align_chunk_end(req.prefix_len, new_len, req.prefix_len + remaining,
                              plan_of(req, cache, req.prefix_len), mode)
    if aligned != new_len:
        cache.histate.metrics.record_chunk_cut("floor" if mode == "floor" else "split")
        chunk.cut = True
    return aligned


def install_chunk_planning() -> None:
    """Register the three PrefillAdder hooks (once per process; the scheduler's)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_MODULE}._commit_prefill_admission", commit_admission_around, HookType.AROUND)
    HookRegistry.register(f"{_MODULE}.add_chunked_req", add_chunked_req_around, HookType.AROUND)
    HookRegistry.register(f"{_MODULE}.floor_chunked_tokens", floor_chunked_tokens_around, HookType.AROUND)
    HookRegistry.apply_hooks()
    _installed = True
