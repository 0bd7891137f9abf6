"""Several checkpoints inside one prefill forward pass: the scheduler side.

SGLang 0.5.23 keeps one recurrent state per request per forward pass: `ScheduleBatch.
_mamba_radix_cache_v2_req_prepare_for_extend` (managers/schedule_batch.py:3137-3240) picks one
position, the backend copies the kernel's state there into the request's ping-pong track slot, and
`checkpoint_kv_cache` / `release_kv_cache` insert that slot into the tree after the pass. The chunked
GDN kernel computes the state at every 64-token chunk boundary of the pass anyway (research §2.4).
HiState keeps every position it planned (eq. 5 intervals, the branch point, the terminal) that the
pass computes, with no extra pass and no chunk cut (`histate.core.capture`):

  * the deepest planned position of the pass takes SGLang's own track slot: the hook below points
    SGLang's one tracked position there (or tracks nothing when the pass holds no planned position);
  * every other planned position in the pass gets a state slot of its own from the mamba pool
    (`Capture`), listed on the batch; `capture_forward.py` fills those slots (SSM state and conv
    window) from the same kernel call, and the cache inserts them in order before SGLang's own insert
    (`HiStateRadixCache.checkpoint`).

A request's positions are planned once, when its first pass is built (`plan_of`): the request was just
admitted, so the plan sees the prefix it reuses and the clock of that scheduler step.

Slots: taken after SGLang allocated the batch (`alloc_for_extend` runs first), with the eviction every
allocation may do; a pass that cannot get one drops that capture (counted), never a pass. A slot is the
request's until its state is inserted (then the tree owns it) or the request is released without
inserting it (`release_captures`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from histate.core import split_pass

from .checkpoint_hints import hints_of
from .hooks import install_once

logger = logging.getLogger(__name__)

_SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_CAPTURES = "_histate_captures"  # ScheduleBatch attribute: [(row, relative position, Capture)] of the pass
CARRIER_FIELD = "histate_captures"  # the same list on the ForwardBatch (a declared field: `carrier_class`)


@dataclass
class Capture:
    """A planned checkpoint a pass is capturing for a request, in a slot the request holds.

    The forward records which recurrent layers wrote the slot (`capture_forward.py`); the cache
    inserts the slot only if every layer wrote both its conv window and its SSM state (`filled`).
    A slot the forward did not fill holds whatever an earlier state left there, and serving it would
    be a wrong answer, so an unfilled capture is freed and counted, never inserted."""

    position: int  # tokens from the start of the sequence (the state after them)
    slot: Any  # 1-D int tensor holding one mamba slot id (what the tree stores as a MAMBA value)
    conv_layers: set = field(default_factory=set)  # layer ids whose conv window the forward wrote
    ssm_layers: set = field(default_factory=set)  # layer ids whose SSM state the forward wrote

    def filled(self, layer_ids: Any) -> bool:
        expected = set(layer_ids)
        return bool(expected) and self.conv_layers == expected and self.ssm_layers == expected


def histate_cache(tree_cache: Any) -> Optional[Any]:
    return tree_cache if getattr(tree_cache, "histate", None) is not None else None


def plan_of(req: Any, cache: Any, reused_tokens: int) -> list:
    """The request's planned checkpoint positions (tokens), made once, when its first pass is built."""
    plan = getattr(req, "_hs_plan", None)
    if plan is None:
        # SGLang's own branch point (the grid position at the KV match end) is HiState's too.
        branch = getattr(req, "mamba_branching_seqlen", None)
        plan = cache.plan_checkpoints(reused_tokens, len(req.full_untruncated_fill_ids), branch, hints_of(req))
        req._hs_plan = plan
    return plan


def capture_chunk_tokens(batch: Any) -> int:
    """Where a pass's states can be taken: the kernel's chunk (the model's `mamba_chunk_size`, 64 for
    Gated-DeltaNet) and SGLang's own tracking grid (`mamba_cache_chunk_size()`, which a page wider than
    the chunk widens), both measured from the pass's first token."""
    from sglang.srt.runtime_context import mamba_cache_chunk_size

    kernel_chunk = getattr(batch.model_config.hf_text_config, "mamba_chunk_size", 64) or 64
    return math.lcm(int(kernel_chunk), int(mamba_cache_chunk_size()))


def pending(req: Any) -> list:
    """The captures `req` holds that are not in the tree yet, ascending."""
    captures = getattr(req, "_hs_captures", None)
    if captures is None:
        captures = req._hs_captures = []
    return captures


def prepare_for_extend_around(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """Start the batch's capture list (filled per request by `track_entry_around`). Once SGLang built the
    batch, each request's prefix is the one it runs from: its hit and miss reasons are settled there
    (`HiStateRuntime.settle`; the only hook SGLang offers at that point is this one)."""
    setattr(batch, _CAPTURES, [])
    result = original(batch, *args, **kwargs)
    cache = histate_cache(batch.tree_cache)
    if cache is not None:
        runtime = cache.histate
        now_s = runtime.now()
        for req in batch.reqs:
            runtime.settle(req, now_s)
    return result


def track_entry_around(original: Any, batch: Any, req: Any) -> Any:
    """SGLang's per-request track choice, pointed at HiState's plan (module docstring)."""
    cache = histate_cache(batch.tree_cache)
    captures = getattr(batch, _CAPTURES, None)
    if cache is None or captures is None or req.skip_radix_cache_insert or batch.is_dllm():
        return original(batch, req)
    kv = req.kv
    saved = (kv.mamba_next_track_idx, kv.mamba_last_track_idx, kv.mamba_last_track_seqlen)
    entry = original(batch, req)
    split = split_pass(plan_of(req, cache, req.prefix_len), req.prefix_len, req.extend_end,
                       capture_chunk_tokens(batch))
    metrics = cache.histate.metrics
    metrics.record_captures("off_grid", len(split.off_grid))
    if split.tracked is None:
        if entry.track_mask:  # SGLang would have tracked an unplanned position: undo its flip
            kv.mamba_next_track_idx, kv.mamba_last_track_idx, kv.mamba_last_track_seqlen = saved
            entry = entry._replace(track_mask=False, track_seqlen=-1)
        return entry
    if not entry.track_mask:  # not expected: a planned position is at least one grid past the prefix
        # Raising here would take the scheduler down; keeping SGLang's choice (nothing tracked, no extra
        # slot) only costs this pass its checkpoints.
        logger.error("HiState: SGLang tracks nothing in a pass of %s holding planned position %d (prefix %d, "
                     "end %d); its checkpoints are dropped", req.rid, split.tracked, req.prefix_len, req.extend_end)
        metrics.record_captures("no_track", 1 + len(split.extra))
        return entry
    # SGLang's encoding (schedule_batch.py:3157-3170): the pass end selects the final state, any other
    # position p is passed as p + 1 so that the backend reads the per-chunk state h at p.
    kv.mamba_last_track_seqlen = split.tracked
    entry = entry._replace(track_seqlen=req.extend_end if split.tracked == req.extend_end else split.tracked + 1)
    metrics.record_captures("tracked", 1)
    row = batch.reqs.index(req)
    for position in split.extra:
        slot = cache.alloc_capture_slot()
        if slot is None:
            metrics.record_captures("no_slot", 1)
            continue
        capture = Capture(position, slot)
        pending(req).append(capture)
        captures.append((row, position - req.prefix_len, capture))
        metrics.record_captures("extra", 1)
    return entry


_carriers: dict = {}


def carrier_class(base: type) -> type:
    """`base` (SGLang's ForwardBatch dataclass) with one more declared field, `histate_captures`.

    The model runner does not run the ForwardBatch the scheduler built: its eager runner copies the
    batch into static buffers and runs `dataclasses.replace` of it (model_executor/runner/
    eager_runner.py:180-208, cuda_graph_buffer_registry.py:540-573), and `replace` carries declared
    fields only. An attribute set on the instance is dropped there, and the backend then captures
    nothing into slots the scheduler inserts (the wrong answers of issue 27, R0). A declared field
    rides through `replace` like SGLang's own; `Capture.filled` catches any path that still drops it."""
    import dataclasses

    if getattr(base, "_histate_carrier", False):
        return base
    carrier = _carriers.get(base)
    if carrier is None:
        carrier = dataclasses.make_dataclass(
            "HiStateForwardBatch", [(CARRIER_FIELD, Optional[list], dataclasses.field(default=None))],
            bases=(base,), namespace={"__doc__": "SGLang's ForwardBatch carrying HiState's in-pass captures.",
                                 "_histate_carrier": True})
        carrier.__module__ = __name__
        _carriers[base] = carrier
    return carrier


def forward_batch_init_after(result: Any, cls: Any, *args: Any, **kwargs: Any) -> Any:
    """Move the batch's capture list onto the ForwardBatch the backend sees (`init_new` is a
    classmethod: the hook sees `cls`, then SGLang's arguments, the ScheduleBatch first). The list is
    taken, not copied: it belongs to this one extend pass, and a later forward of the same
    ScheduleBatch (a decode) must not carry it."""
    batch = kwargs["batch"] if "batch" in kwargs else args[0]
    captures = getattr(batch, _CAPTURES, None)
    if captures:
        setattr(batch, _CAPTURES, None)
        result.__class__ = carrier_class(type(result))
        setattr(result, CARRIER_FIELD, captures)
    return result


def release_captures(cache: Any, req: Any) -> None:
    """Give back the slots of captures the request never inserted (aborted, barred from the tree)."""
    for capture in pending(req):
        cache.req_to_token_pool.mamba_allocator.free(capture.slot)
    req._hs_captures = []


def install_scheduler_hooks() -> None:
    """Register the scheduler-side hooks (once per process; the scheduler's)."""
    install_once("capture", [
        (f"{_SCHEDULE_BATCH}.prepare_for_extend", prepare_for_extend_around, "AROUND"),
        (f"{_SCHEDULE_BATCH}._mamba_radix_cache_v2_req_prepare_for_extend", track_entry_around, "AROUND"),
        (f"{_FORWARD_BATCH}.init_new", forward_batch_init_after, "AFTER"),
    ])
