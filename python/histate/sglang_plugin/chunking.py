"""Chunked-prefill cuts on the state grid, so every pass of a long prompt can capture its checkpoints.

The kernel materialises a pass's states every 64 tokens *from the pass's first token*
(`histate.core.capture`). A pass that starts on the state grid therefore reaches every planned
position inside it; one that starts off the grid reaches none. SGLang cuts a chunk wherever the chunk
budget ends (`mamba_prefill_chunk_grid()` is 1 without DCP, schedule_policy.py:586-601), so the pass
after a cut would start anywhere. HiState floors each cut to the state grid, as SGLang itself does
under DCP (`floor_chunked_tokens`, schedule_policy.py:863-872). The chunk shrinks by less than one
grid; no pass is added, and a final chunk is never touched.

Three AROUND hooks on `PrefillAdder` (`--histate-chunk-align grid`, the default; `off` leaves SGLang's
cuts, and captures past an off-grid cut are dropped and counted); with upstream/series 0002 applied,
SGLang's `PrefillAdder` does the same from `HiStateRadixCache.prefill_cut_grid()` and no hook is installed:
  * `_select_prefill_admission` (a new request, schedule_policy.py:1592-1683): a cut chunk ends at the
    last grid position inside it. When that leaves nothing, the request waits for the next round
    (`AddReqResult.OTHER`, SGLang's own answer when page flooring leaves nothing, :1672-1673), and a
    new request is never cut next to a continuing chunked one (stock keeps this rule under
    shortest-prefill-first, :1647-1652; with HiState's floor a few tokens of budget can be left behind
    a continuing chunk, so it holds in every mode: the scheduler tracks one chunked request,
    scheduler.py:4324-4327);
  * `floor_chunked_tokens` (a continuing chunk, via `add_chunked_req`, :1140-1222): floored the same
    way, except that an empty chunk is never returned (SGLang's rule: progress first).
The rest of the budget stays where SGLang put it, including the room shortest-prefill-first keeps for
short requests behind a continuing chunk (`shortest_prefill_chunk_limit`, :418-437, or HiState's bounded
version with `--histate-short-prefill-first`, short_prefill.py, which never caps a chunk below one grid).
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Optional

from histate.core import floor_cut

from .capture import histate_cache
from .hooks import install_once

_MODULE = "sglang.srt.managers.schedule_policy.PrefillAdder"

_continuing: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("histate_continuing_chunk",
                                                                            default=None)


def _grid_cache(adder: Any) -> Optional[Any]:
    """The adder's HiState cache when it floors cuts (`--histate-chunk-align grid`), else None."""
    cache = histate_cache(getattr(adder, "tree_cache", None))
    if cache is None or cache.histate.config.chunk_align != "grid":
        return None
    return cache


def select_admission_around(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.managers.schedule_policy import AddReqResult

    admission = original(adder, req, *args, **kwargs)
    cache = _grid_cache(adder)
    if cache is None or isinstance(admission, AddReqResult) or not admission.is_chunked:
        return admission
    if kwargs.get("has_chunked_req") or adder.new_chunked_req is not None:
        return AddReqResult.OTHER  # one chunked request per batch (module docstring)
    start, cut_end = admission.prefix_len, admission.prefix_len + admission.extend_len
    end = cut_end // cache.histate.grid_tokens * cache.histate.grid_tokens
    if end <= start:
        return AddReqResult.OTHER
    if end != cut_end:
        cache.histate.metrics.record_chunk_cut("grid")
        admission = dataclasses.replace(admission, extend_len=end - start)
    return admission


def add_chunked_req_around(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    token = _continuing.set(req)
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        _continuing.reset(token)


def floor_chunked_tokens_around(original: Any, adder: Any, trunc_len: int, remaining: int) -> int:
    new_len = original(adder, trunc_len, remaining)
    req, cache = _continuing.get(), _grid_cache(adder)
    if req is None or cache is None or new_len >= remaining:
        return new_len  # not a continuing chunk of ours, or the final chunk: never shortened
    end = floor_cut(req.prefix_len, req.prefix_len + new_len, cache.histate.grid_tokens)
    if end != req.prefix_len + new_len:
        cache.histate.metrics.record_chunk_cut("grid")
    return end - req.prefix_len


def upstream_cut_grid() -> bool:
    """Whether this SGLang floors cuts to the cache's grid itself (upstream/series 0002:
    `BasePrefixCache.prefill_cut_grid`, read by `PrefillAdder`); then the hooks below are not needed and
    `HiStateRadixCache.prefill_cut_grid` / `on_prefill_cut_floored` carry the same rule."""
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

    return hasattr(BasePrefixCache, "prefill_cut_grid")


def install_chunk_planning() -> None:
    """Register the PrefillAdder hooks (once per process; the scheduler's), unless SGLang has the cut
    grid of upstream/series 0002."""
    if upstream_cut_grid():
        return
    install_once("chunking", [
        (f"{_MODULE}._select_prefill_admission", select_admission_around, "AROUND"),
        (f"{_MODULE}.add_chunked_req", add_chunked_req_around, "AROUND"),
        (f"{_MODULE}.floor_chunked_tokens", floor_chunked_tokens_around, "AROUND"),
    ])
