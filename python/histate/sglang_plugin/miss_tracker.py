"""`--histate-miss-reasons`: why each request's uncached prompt tokens missed, in the server.

The same attribution the simulator reports (`histate.core.attribute_misses`, docs/misses.md), over
SGLang's tree: the plugin feeds a `histate.core.MissHistory` from the events its hooks already see, in
the core's terms, and asks it once per match:
  * an eviction decision (`HiStateRuntime.on_evicted`: unit, tier and eq. 7 score) names the tier and
    score of what it removes next;
  * a checkpoint's last copy gone (the runtime's `on_state_gone` condition) departs the key of the
    prefix through its node's end; a failed SSD restore departs it as lost (a fault: not_restored);
  * a node SGLang deletes departs the KV of every state-grid page that ends inside its edge; if its KV
    still had an SSD copy (an orphan SGLang's storage prefetch can read back), the departure says so
    and a request that did not get it back reads not_restored, unless the copy is gone by then (checked
    in the store when the request misses the page: the SSD trimmed it, so it was evicted from storage);
  * a new checkpoint clears its key's departure.
Keys are prefix_keys.py's (depth, hash) per state-grid page end, so a request finds the records of
exactly the prefixes it shares. Pages are the state grid (lcm of SGLang's page size and the model's
state chunk), the unit c is measured in; the KV match is floored to it.

Counted once per request, at its last match before it ran (`commit`): the scheduler matches a request
again when it retries admission, and each match replaces the attribution it carries. Every TP rank
keeps the same history from the same agreed events (the one local read, whether an orphan's SSD copy is
still in this rank's store, can only relabel not_restored as kv_evicted); nothing here feeds a cache
decision, only the numbers a response and /metrics carry.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

from histate.core import (SGLANG_TIER_NAMES, Departure, LatestDecision, MissAttribution, MissHistory, Tier,
                          attribute_misses)

from .core_nodes import CoreNode
from .prefix_keys import PrefixHasher, key_seed

MISS_ATTR = "_hs_misses"
"""Underscore attribute on SGLang's `Req`: the `MissAttribution` of its latest match."""

KEYS_ATTR = "_hs_miss_keys"
"""Underscore attribute on SGLang's `Req`: (match key tokens, namespace seed, page keys), memoized."""

META_INFO_KEY = "histate_miss"
"""The response's meta_info key (request-level customized info, one dict per request)."""


class MissTracker:
    """The plugin's `MissHistory` and what it takes to feed it from SGLang's tree (module docstring)."""

    def __init__(self, grid_tokens: int, max_keys: Optional[int]):
        self.grid_tokens = grid_tokens
        self.history = MissHistory(max_keys)
        self.hasher = PrefixHasher()
        self._decision = LatestDecision()
        self._copies: OrderedDict = OrderedDict()  # key -> (store key, SsdTier) of a deleted node's SSD copy

    # --- departures ---------------------------------------------------------------------------------

    def on_evicted(self, node: CoreNode, tier: Tier, score: Optional[float]) -> None:
        self._decision.chose(node, tier, score)

    def on_state_gone(self, node: CoreNode, now_s: float, lost: bool = False) -> None:
        """The last copy of the checkpoint at `node`'s end left (eviction, or a fault when `lost`)."""
        if node.depth_pages % self.grid_tokens == 0:
            self.history.checkpoint_gone(self.hasher.key_at_end(node), self._decision.departure(node, now_s, lost=lost))

    def on_node_removed(self, node: CoreNode, now_s: float, ssd: Any = None) -> None:
        """SGLang deleted `node`: the KV of its edge left the tree. If the SSD tier (`ssd`) holds its pages
        (an orphan SGLang's storage prefetch can read back), the departure says a copy stays below, and
        the store key of each page is kept to check, when a request misses it, whether the copy is still
        there (the SSD may have trimmed it since: then it was evicted from storage)."""
        below = bool(node.ssd_kv and ssd is not None)
        departure = self._decision.departure(node, now_s, below=below)
        for key in self.hasher.node_page_keys(node, self.grid_tokens):
            self.history.kv_gone(key, departure)
            if below:
                copy = ssd.kv_copy_key(node, key[0])
                if copy is not None:
                    self._copies[key] = (copy, ssd)
                    self._copies.move_to_end(key)
        while len(self._copies) > (self.history.max_keys or len(self._copies)):
            self._copies.popitem(last=False)

    def _gap_pages(self, keys: list) -> int:
        """Of a request's missed pages (in order), how many read not_restored only because a copy of a
        deleted node stays on the SSD, yet lie past a page that is not coming back (no copy, or one the
        SSD trimmed since: SGLang's storage prefetch reads contiguously from the end of the host match,
        so nothing past a gap can return). A trimmed copy is recorded as evicted from storage (the one
        fact this request learned about the page); the gap itself is this request's, not the pages'."""
        broken, moved = False, 0
        for key in keys:
            departure = self.history.kv_departure(key)
            if departure is None or not departure.below:
                broken = True
                continue
            copy, ssd = self._copies.get(key, (None, None))
            if copy is None or not ssd.has_copy(copy):
                self._copies.pop(key, None)
                self.history.kv_gone(key, Departure(departure.time_s, Tier.SSD, None))
                broken = True
            elif broken:
                moved += 1
        return moved

    def on_checkpoint_placed(self, node: CoreNode) -> None:
        if node.depth_pages % self.grid_tokens == 0:
            self.history.checkpoint_placed(self.hasher.key_at_end(node))

    # --- attribution --------------------------------------------------------------------------------

    def page_keys(self, req: Any, key: Any, num_key_tokens: int) -> list:
        """The request's page keys over its match key's first `num_key_tokens` tokens, memoized on the
        request (SGLang matches a waiting request again every round it is not admitted)."""
        seed = key_seed(key)
        memo = getattr(req, KEYS_ATTR, None)
        if memo is not None and memo[0] == num_key_tokens and memo[1] == seed:
            return memo[2]
        grid = self.grid_tokens
        keys = self.hasher.page_keys(key.token_ids[:num_key_tokens], grid, num_key_tokens // grid, seed)
        try:
            setattr(req, KEYS_ATTR, (num_key_tokens, seed, keys))
        except AttributeError:  # a stand-in without attributes: no memo
            pass
        return keys

    def attribute(self, keys: list, prompt_tokens: int, kv_tokens: int, reused_tokens: int) -> MissAttribution:
        """Reasons for the `prompt_tokens - reused_tokens` uncached tokens of a request with page keys
        `keys` (over at most its first L-1 tokens: SGLang always prefills the last one)."""
        grid = self.grid_tokens
        kv_pages = min(kv_tokens // grid, len(keys))
        moved = self._gap_pages(keys[kv_pages:]) if self._copies else 0
        attribution = attribute_misses(keys, prompt_tokens, grid, kv_pages, min(reused_tokens // grid, kv_pages),
                                       self.history)
        if not moved:
            return attribution
        tokens = dict(attribution.tokens_by_reason)
        tokens["not_restored"] -= moved * grid
        tokens["kv_evicted"] += moved * grid
        return dataclasses.replace(attribution, tokens_by_reason=tokens)

    def saw_context(self, req: Any, output: Any = ()) -> None:
        """A request left: later ones sharing its prompt and output had a shared prefix (never_cached,
        not no_prefix, where this cache did not keep them). Extends its memoized prompt keys over the
        rest of its context, so the prompt is not hashed again."""
        memo = getattr(req, KEYS_ATTR, None)
        origin = getattr(req, "origin_input_ids", None)
        if memo is None or origin is None:
            return
        _, seed, keys = memo
        grid = self.grid_tokens
        start_pages = len(keys)
        start_hash = keys[-1][1] if keys else seed
        tail = np.concatenate([np.asarray(origin[start_pages * grid:], dtype=np.int64),
                               np.asarray(output, dtype=np.int64)])
        total_pages = start_pages + len(tail) // grid
        more = self.hasher.page_keys(tail, grid, total_pages, start_hash, start_pages)
        self.history.saw_context(keys + more)


def as_meta_info(attribution: MissAttribution, now_s: float) -> dict:
    """The response's `meta_info["histate_miss"]`: tokens by reason, the gap from the resume point to
    the KV hit end, and what the evicted pieces were (tier, seconds since, eq. 7 score)."""
    out: dict = {"tokens": dict(attribution.tokens_by_reason), "state_gap_tokens": attribution.state_gap_tokens}
    for name, departure in (("kv_departure", attribution.kv_departure), ("state_departure", attribution.state_departure)):
        if departure is not None:
            out[name] = {"tier": None if departure.tier is None else SGLANG_TIER_NAMES[Tier(departure.tier)],
                         "seconds_ago": round(now_s - departure.time_s, 3),
                         "score": None if departure.score is None else round(departure.score, 3),
                         "lost": departure.lost, "copy_below": departure.below}
    return out


_STREAMER_KEY = ("sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer."
                 "is_request_level_customized_info_key")


def _request_level_around(original: Any, streamer: Any, key: str) -> bool:
    return key == META_INFO_KEY or original(streamer, key)


def install_meta_info_hook() -> None:
    """SGLang's customized info is sliced per output token unless its streamer calls the key request-level
    (`SchedulerOutputStreamer.is_request_level_customized_info_key`, output_streamer.py:252): HiState's
    key is, so the response carries one attribution, sent with the first chunk of a stream. Declared with
    `register_request_level_info_key` on a SGLang with upstream/series 0013, else an AROUND hook."""
    from sglang.srt.managers.scheduler_components import output_streamer

    register = getattr(output_streamer, "register_request_level_info_key", None)
    if register is not None:
        register(META_INFO_KEY)  # a set: registering twice is once
        return
    from .hooks import install_once

    install_once("miss_reasons", [(_STREAMER_KEY, _request_level_around, "AROUND")])
