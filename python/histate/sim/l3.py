"""The shared L3 object store of cluster mode: a model of Mooncake Store's master (capacity, leases,
soft pins, watermark eviction), below every server's private SSD.

Objects are a KV page (`("kv", page_key)`) or the recurrent state at a page's end (`("state",
page_key)`), keyed by the simulator's prefix-chained page keys (request.py), so two servers that
computed the same prefix write the same keys. What a server writes is `histate.core.l3_policy`'s
business (and stock HiCache's write-through, sim/cluster.py); what it may read back is the read
rule `core.l3_policy.restorable_pages` (SGLang's `PoolHitPolicy.TRAILING_PAGES`).

Master behaviour modelled (defaults from the installed `mooncake_master --help`, Mooncake v0.3.x):
* Eviction. When a put leaves the used bytes above `eviction_high_watermark_ratio` (0.90) of the
  capacity, the master evicts `eviction_ratio` (0.05) of the objects, least recently used first
  (LRU by last put or get); objects that do not fit even after that evict further, one at a time.
  A put that cannot fit after evicting every evictable object is rejected (Mooncake's put returns
  NO_AVAILABLE_HANDLE; the writer's cache is unaffected). The real master evicts *because* a put was
  refused and HiState's writers retry such a put (l3/client.py, sglang_plugin/l3_tier.py), so the
  net effect of refusal + eviction + retry is this model's single put.
* Leases (`default_kv_lease_ttl` 10000 ms): a get grants a lease; a leased object is not evicted
  until the lease expires (the reader is still copying it).
* Soft pins (`default_kv_soft_pin_ttl` 1800000 ms, `allow_evict_soft_pinned_objects` true): a pinned
  object is evicted only after every unpinned candidate, and only while the flag allows it.
* Groups. A page's KV and its state carry one group id (core/l3_policy.py placement hints) and leave
  together: a state whose KV is gone is useless to the read rule.
* Replicas multiply an object's bytes (every replica takes space in some segment).
Not modelled: segments and their failures, the master's periodic (not per-put) eviction thread,
disk offload. Pure model: no I/O, simulated seconds in, numbers out.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

from ..core import restorable_pages

DEFAULT_EVICTION_HIGH_WATERMARK_RATIO = 0.90
"""`mooncake_master --help`: eviction_high_watermark_ratio, default 0.90000000000000002."""
DEFAULT_EVICTION_RATIO = 0.05
"""`mooncake_master --help`: eviction_ratio, default 0.050000000000000003."""
DEFAULT_LEASE_TTL_S = 10.0
"""`mooncake_master --help`: default_kv_lease_ttl, default "10000" (ms)."""
DEFAULT_SOFT_PIN_TTL_S = 1800.0
"""`mooncake_master --help`: default_kv_soft_pin_ttl, default "1800000" (ms)."""

KV, STATE = "kv", "state"


@dataclass(frozen=True)
class L3StoreConfig:
    capacity_bytes: int
    eviction_high_watermark_ratio: float = DEFAULT_EVICTION_HIGH_WATERMARK_RATIO
    eviction_ratio: float = DEFAULT_EVICTION_RATIO
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    soft_pin_ttl_s: float = DEFAULT_SOFT_PIN_TTL_S
    allow_evict_soft_pinned_objects: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ValueError(f"L3 capacity must be >= 0 bytes, got {self.capacity_bytes}")
        if not 0 < self.eviction_high_watermark_ratio <= 1:
            raise ValueError(f"eviction_high_watermark_ratio must be in (0, 1], got "
                             f"{self.eviction_high_watermark_ratio}")
        if not 0 < self.eviction_ratio <= 1:
            raise ValueError(f"eviction_ratio must be in (0, 1], got {self.eviction_ratio}")


@dataclass(slots=True)
class L3Stats:
    bytes_written: int = 0          # accepted puts, replicas included
    bytes_read: int = 0             # gets (restores)
    puts: int = 0
    puts_rejected: int = 0          # no room even after evicting everything evictable
    gets: int = 0
    deleted_objects: int = 0        # removed by a writer's own ranking (core/l3_ledger.py), not the master
    evicted_objects: int = 0
    evicted_bytes: int = 0
    eviction_rounds: int = 0        # high-watermark triggers
    peak_used_bytes: int = 0


@dataclass(slots=True)
class _Object:
    size_bytes: int
    group: Hashable
    lease_until_s: float = -math.inf
    pin_until_s: float = -math.inf


class L3Store:
    """Objects in LRU order (module docstring). Calls must come in non-decreasing simulated time."""

    def __init__(self, config: L3StoreConfig) -> None:
        self.config = config
        self.objects: "OrderedDict[tuple, _Object]" = OrderedDict()  # least recently used first
        self.groups: dict = {}   # group -> set of object keys
        self.used_bytes = 0
        self.stats = L3Stats()

    # --- writes ----------------------------------------------------------------------------------
    def put(self, key: tuple, size_bytes: int, now_s: float, *, group: Hashable = None, soft_pin: bool = False,
            replicas: int = 1) -> bool:
        """Store `key` (`(KV|STATE, page_key)`); True if it is in the store afterwards. A re-put
        refreshes recency (and the pin); its bytes are not charged twice."""
        obj = self.objects.get(key)
        if obj is not None:
            self.objects.move_to_end(key)
            if soft_pin:
                obj.pin_until_s = max(obj.pin_until_s, now_s + self.config.soft_pin_ttl_s)
            self._touch_group(obj.group, key)
            return True
        group = key[1] if group is None else group
        total = size_bytes * replicas
        cap = self.config.capacity_bytes
        if total > cap or not self._make_room(total, now_s, protect=group):
            self.stats.puts_rejected += 1
            return False
        obj = _Object(total, group, pin_until_s=now_s + self.config.soft_pin_ttl_s if soft_pin else -math.inf)
        self.objects[key] = obj
        self.groups.setdefault(group, set()).add(key)
        self.used_bytes += total
        self.stats.puts += 1
        self.stats.bytes_written += total
        self.stats.peak_used_bytes = max(self.stats.peak_used_bytes, self.used_bytes)
        if self.used_bytes > self.config.eviction_high_watermark_ratio * cap:
            self.stats.eviction_rounds += 1
            self._evict(max(1, math.ceil(self.config.eviction_ratio * len(self.objects))), now_s, protect=group)
        return True

    def remove(self, key: tuple, now_s: float) -> bool:
        """A writer deletes `key` (Mooncake `remove(key, force=False)`: one object, not its group).
        False if the store does not hold it, or holds it under a reader's lease (Mooncake refuses to
        remove a leased object unless forced; the object then stays for the master to evict)."""
        obj = self.objects.get(key)
        if obj is None or obj.lease_until_s > now_s:
            return False
        del self.objects[key]
        members = self.groups.get(obj.group)
        if members is not None:
            members.discard(key)
            if not members:
                del self.groups[obj.group]
        self.used_bytes -= obj.size_bytes
        self.stats.deleted_objects += 1
        return True

    # --- reads -----------------------------------------------------------------------------------
    def contains(self, key: tuple) -> bool:
        return key in self.objects

    def restorable_pages(self, page_keys: Sequence, held_pages: int = 0) -> int:
        """Longest prefix of `page_keys` the read rule allows (KV [0, p) and the state at p - 1), where
        the reader already holds pages [0, held_pages) itself: a server asks L3 only for what lies
        beyond its local match (SGLang's prefetch asks storage for `fill_ids[matched_len:]` only,
        managers/scheduler.py:3372-3386 in the 0.5.23 wheel; the reference worker past its resume
        point, reference/l3_tier.py), so a leading page L3 has evicted costs nothing to a reader
        that holds it."""
        kv_present = [True] * min(held_pages, len(page_keys))
        for k in page_keys[len(kv_present):]:  # the KV run ends at the first missing page
            if (KV, k) not in self.objects:
                break
            kv_present.append(True)
        state_present = [(STATE, k) in self.objects for k in page_keys[:len(kv_present)]]
        return restorable_pages(kv_present, state_present)

    def get(self, page_keys: Sequence, num_pages: int, now_s: float, first_page: int = 0) -> int:
        """Read KV pages [first_page, num_pages) and the state at num_pages - 1 (the reader holds the
        pages before `first_page` itself): each object read becomes most recently used and leased.
        Returns the bytes read."""
        keys = [(KV, k) for k in page_keys[first_page:num_pages]] + [(STATE, page_keys[num_pages - 1])]
        read = 0
        for key in keys:
            obj = self.objects[key]
            self.objects.move_to_end(key)
            obj.lease_until_s = now_s + self.config.lease_ttl_s
            read += obj.size_bytes
        self.stats.gets += 1
        self.stats.bytes_read += read
        return read

    # --- eviction --------------------------------------------------------------------------------
    def _touch_group(self, group: Hashable, key: tuple) -> None:
        for other in self.groups.get(group, ()):
            if other != key:
                self.objects.move_to_end(other)

    def _candidates(self, now_s: float, protect: Hashable) -> list:
        """Evictable object keys in eviction order: unpinned LRU first, then pinned LRU if allowed."""
        unpinned, pinned = [], []
        for key, obj in self.objects.items():
            if obj.lease_until_s > now_s or obj.group == protect:
                continue
            (pinned if obj.pin_until_s > now_s else unpinned).append(key)
        return unpinned + pinned if self.config.allow_evict_soft_pinned_objects else unpinned

    def _evict(self, num_objects: int, now_s: float, protect: Hashable = None) -> None:
        evicted = 0
        for key in self._candidates(now_s, protect):
            if evicted >= num_objects:
                break
            if key in self.objects:
                evicted += self._drop_group(self.objects[key].group)

    def _make_room(self, size_bytes: int, now_s: float, protect: Hashable) -> bool:
        cap = self.config.capacity_bytes
        if self.used_bytes + size_bytes <= cap:
            return True
        for key in self._candidates(now_s, protect):
            if key in self.objects:
                self._drop_group(self.objects[key].group)
            if self.used_bytes + size_bytes <= cap:
                return True
        return False

    def _drop_group(self, group: Hashable) -> int:
        keys = self.groups.pop(group, ())
        for key in keys:
            obj = self.objects.pop(key)
            self.used_bytes -= obj.size_bytes
            self.stats.evicted_objects += 1
            self.stats.evicted_bytes += obj.size_bytes
        return len(keys)
