"""Why a prompt token was not served from cache: one reason per uncached token (issue 31, item 1).

Users of hybrid models cannot tell today why a request missed (vLLM #45238, SGLang #38018): the KV can
be held while no recurrent state sits at or near its end, which a plain KV hit rate hides. HiState
gives every uncached prompt token of a request exactly one reason, so the reasons add up to the
request's uncached tokens (`input - reused`, DESIGN.md hit accounting: only the deepest usable
checkpoint c counts as reuse):

  page_boundary  past the last whole page the request could resume at: the partial last page, the last
                 prompt token an engine always prefills (it needs that token's logits), and KV held past
                 the last block boundary of an engine that matches whole blocks only (vLLM);
  no_prefix      no earlier request had this prefix in its context (prompt and output), and this cache
                 never held its KV (the history is bounded: forgotten pages read as this);
  never_cached   an earlier request had this prefix in its context, but this cache never held its KV (an
                 engine that keeps no KV there, an insert that failed);
  kv_evicted     the page's KV was cached and evicted (the last copy left the cache by a policy
                 decision) before this request matched;
  not_restored   a copy was on a slower tier (host, SSD, a shared store) but did not come back in time,
                 or was lost to a fault on the way (a failed restore is a miss, never a wrong state);
  state_evicted  the KV is held, and a checkpoint deeper than the resume point had existed and was
                 evicted: without it the request resumes further up;
  no_checkpoint  the KV is held, and no checkpoint was ever kept between the resume point and the KV
                 hit end (placement: the request branched off inside a segment).

Pages are attributed from the end backwards, as the hit accounting defines them (c = pages reused,
m = KV pages matched in any tier, n = pages the request could match at all):
  [n, L)     tokens -> page_boundary;
  [m, h)     pages  -> page_boundary (h = KV pages held before the match was floored to a block);
  [h, n)     pages  -> by the departure of each page's KV (none: never_cached if an earlier request's
                       context had the page, else no_prefix);
  [c, m)     pages  -> the deepest checkpoint position d in (c, m] with a recorded departure splits it:
                       (c, d] by that departure (state_evicted, or not_restored when it was lost), the
                       rest (d, m] no_checkpoint; with no departure all of it is no_checkpoint.
A checkpoint alive in (c, m] would have been the resume point (c is the deepest one), so only departed
ones can lie there; an executor whose resume point is lower than its match (a restore that failed after
the match) records the loss first, and the failed position reads not_restored.

`MissHistory` is the record both executors keep (the simulator through a `CacheObserver`, the SGLang
plugin from its eviction hooks); keys are whatever names a prefix in that executor (the simulator's
prefix-chained page keys, the plugin's prefix hashes). Pure: no clock, no I/O.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence

from .observer import CacheObserver
from .types import ConfigError, ItemKind, Tier, UnitKind

REASONS = ("no_prefix", "never_cached", "kv_evicted", "state_evicted", "no_checkpoint", "not_restored",
           "page_boundary")
"""Every reason, in the order reports and plots list them."""

DEFAULT_MAX_KEYS = 1 << 18
"""Departures (and, separately, seen context pages) the server remembers: past that, the oldest are
forgotten (read as no_prefix). Measured with the server's (depth, hash) keys: 81 MB of departures and
56 MB of seen pages at the bound."""


@dataclass(frozen=True, slots=True)
class Departure:
    """How the last copy of a page's KV, or of a checkpoint, left the cache.

    `tier`: the tier it left from (None when unknown); `score`: eq. 7's H when the evictor chose it
    (None for a fault); `lost`: a fault took it (a failed or corrupt read), not a policy decision;
    `below`: a slower tier outside the tree still holds a copy (the plugin: SSD objects of a node
    SGLang deleted, which its storage prefetch can read back), so a request that did not get it back
    missed it in time, not by eviction."""

    time_s: float
    tier: Optional[Tier] = None
    score: Optional[float] = None
    lost: bool = False
    below: bool = False

    @property
    def reason(self) -> str:
        return "not_restored" if self.lost or self.below else "evicted"


class MissHistory:
    """Departures of KV pages and checkpoints by key, the oldest forgotten first past `max_keys`.

    A key that is cached again keeps its record until it leaves again (the record is then replaced):
    attribution only reads keys the request did not find, so a stale record is never read while the
    key is held. A checkpoint placed again clears its record, since a live one at that key would be the
    resume point."""

    def __init__(self, max_keys: Optional[int] = DEFAULT_MAX_KEYS):
        if max_keys is not None and max_keys < 1:
            raise ConfigError(f"MissHistory max_keys must be >= 1 or None, got {max_keys}")
        self.max_keys = max_keys
        self._kv: OrderedDict = OrderedDict()
        self._ckpt: OrderedDict = OrderedDict()
        self._seen: OrderedDict = OrderedDict()  # keys earlier prompts had (values unused)
        self.forgotten = 0  # records dropped by the bound

    def __len__(self) -> int:
        return len(self._kv) + len(self._ckpt)

    def saw_context(self, keys: Sequence[Hashable]) -> None:
        """A finished request's context pages (prompt and output): later requests sharing them had a shared
        prefix. Keys are prefix-chained, so the walk stops at the deepest key already seen (every key
        before it was seen with it): amortized one insert per new page. Bounded by `max_keys` on its own,
        the oldest first."""
        seen = self._seen
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in seen:
                break
            seen[keys[i]] = None
        if self.max_keys is not None:
            while len(seen) > self.max_keys:
                seen.popitem(last=False)

    def was_seen(self, key: Hashable) -> bool:
        return key in self._seen

    def kv_gone(self, key: Hashable, departure: Departure) -> None:
        self._put(self._kv, key, departure)

    def checkpoint_gone(self, key: Hashable, departure: Departure) -> None:
        self._put(self._ckpt, key, departure)

    def checkpoint_placed(self, key: Hashable) -> None:
        self._ckpt.pop(key, None)

    def kv_departure(self, key: Hashable) -> Optional[Departure]:
        return self._kv.get(key)

    def checkpoint_departure(self, key: Hashable) -> Optional[Departure]:
        return self._ckpt.get(key)

    def _put(self, table: OrderedDict, key: Hashable, departure: Departure) -> None:
        table.pop(key, None)
        table[key] = departure
        if self.max_keys is not None:
            while len(self._kv) + len(self._ckpt) > self.max_keys:
                older = self._kv if self._older(self._kv, self._ckpt) else self._ckpt
                older.popitem(last=False)
                self.forgotten += 1

    @staticmethod
    def _older(a: OrderedDict, b: OrderedDict) -> bool:
        """Whether `a`'s oldest record left before `b`'s (an empty table is never older)."""
        if not a:
            return False
        if not b:
            return True
        return next(iter(a.values())).time_s <= next(iter(b.values())).time_s


@dataclass(frozen=True, slots=True)
class MissAttribution:
    """One request's uncached prompt tokens by reason (every reason present, zeros included).

    `state_gap_tokens`: tokens from the resume point to the KV hit end (how far the nearest usable
    checkpoint is from where the held KV ends); `kv_departure` / `state_departure`: the departure behind
    the first missing page's KV and behind the deepest departed checkpoint, when there is one."""

    tokens_by_reason: Mapping[str, int]
    state_gap_tokens: int = 0
    kv_departure: Optional[Departure] = None
    state_departure: Optional[Departure] = None

    @property
    def uncached_tokens(self) -> int:
        return sum(self.tokens_by_reason.values())


def attribute_misses(keys: Sequence[Hashable], input_tokens: int, page_tokens: int, kv_pages: int,
                     reused_pages: int, history: MissHistory, held_kv_pages: Optional[int] = None) -> MissAttribution:
    """Reasons for the `input_tokens - reused_pages * page_tokens` uncached tokens of one request.

    `keys`: one key per page the request could match (n = len(keys); key i names the prefix through the
    end of page i); `kv_pages` (m) and `reused_pages` (c) are its match, m <= n and c <= m;
    `held_kv_pages` (h, m <= h <= n): KV pages held before the match was floored to a block (None: m)."""
    n = len(keys)
    held = kv_pages if held_kv_pages is None else held_kv_pages
    if not 0 <= reused_pages <= kv_pages <= held <= n or n * page_tokens > input_tokens:
        raise ValueError(f"inconsistent match: c={reused_pages} m={kv_pages} h={held} n={n} pages of "
                         f"{page_tokens} tokens for a {input_tokens}-token prompt")
    tokens = dict.fromkeys(REASONS, 0)
    tokens["page_boundary"] = input_tokens - n * page_tokens + (held - kv_pages) * page_tokens
    kv_first: Optional[Departure] = None
    for i in range(held, n):
        departure = history.kv_departure(keys[i])
        if i == held:
            kv_first = departure
        if departure is None:
            tokens["never_cached" if history.was_seen(keys[i]) else "no_prefix"] += page_tokens
        else:
            tokens["kv_evicted" if departure.reason == "evicted" else "not_restored"] += page_tokens
    state_departure: Optional[Departure] = None
    for depth in range(kv_pages, reused_pages, -1):
        state_departure = history.checkpoint_departure(keys[depth - 1])
        if state_departure is not None:
            reason = "state_evicted" if state_departure.reason == "evicted" else "not_restored"
            tokens[reason] += (depth - reused_pages) * page_tokens
            tokens["no_checkpoint"] += (kv_pages - depth) * page_tokens
            break
    else:
        tokens["no_checkpoint"] += (kv_pages - reused_pages) * page_tokens
    return MissAttribution(tokens, (kv_pages - reused_pages) * page_tokens, kv_first, state_departure)


class LatestDecision:
    """The latest eviction decision (node, tier, eq. 7 score), to stamp the departures it causes: the
    items a decision removes are reported right after it (a bundle's KV and checkpoint both), before any
    other decision; a unit moved down a tier reports nothing, and the next decision replaces it. An item
    that leaves without one (a policy drop outside the evictor, a fault) gets no tier and no score."""

    __slots__ = ("node", "tier", "score")

    def __init__(self) -> None:
        self.node = self.tier = self.score = None

    def chose(self, node, tier: Tier, score: Optional[float]) -> None:
        self.node, self.tier, self.score = node, tier, score

    def departure(self, node, now_s: float, lost: bool = False, below: bool = False) -> Departure:
        if node is self.node:
            return Departure(now_s, self.tier, self.score, lost=lost, below=below)
        return Departure(now_s, lost=lost, below=below)


class MissRecorder(CacheObserver):
    """Feeds a `MissHistory` from a `HybridPrefixCache`'s events (the simulator's executor; the SGLang
    plugin records from its own hooks). Keys are the cache's page keys: a node's KV departs page by
    page, a checkpoint under the key of the page it ends."""

    def __init__(self, history: MissHistory):
        self.history = history
        self._decision = LatestDecision()
        self._faulting = False

    def on_unit_evicted(self, node, unit: UnitKind, tier: Tier, now_s: float, terms: tuple) -> None:
        self._decision.chose(node, tier, terms[3])

    def on_item_gone(self, node, kind: ItemKind, now_s: float) -> None:
        departure = self._decision.departure(node, now_s, lost=self._faulting)
        if kind is ItemKind.KV:
            for key in node.keys:
                self.history.kv_gone(key, departure)
        else:
            self.history.checkpoint_gone(node.keys[-1], departure)

    def on_checkpoint_put(self, node, tier: Tier, now_s: float) -> None:
        self.history.checkpoint_placed(node.keys[-1])

    def on_fault(self, active: bool) -> None:
        self._faulting = active
