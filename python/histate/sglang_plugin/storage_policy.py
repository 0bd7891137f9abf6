"""What HiState's SSD tier and agreed clock need from SGLang's HiCache storage path, as one policy object.

The methods are those of SGLang's `StorageTierPolicy` (upstream/series 0008,
`UnifiedRadixCache.set_storage_tier_policy`):
  * `begin_backup` / `end_backup`: a host backup is written to storage only when the SSD tier wants it
    (a node's state always; its KV only when `SsdTier.demote` chose it: the SSD is the host's victim tier
    for KV), and what the write will carry to L3 is marked before SGLang queues it (its backup thread may
    write at once);
  * `on_backups_acked`: the SSD tier confirms, per object, what the drained backups stored;
  * `on_prefetch_committed`: nodes SGLang's L3 prefetch brought back are SSD-backed;
  * `step_sync_values` / `adopt_step_sync`: the clock, the SSD usage and each SSD restore's and state-only
    write's (done, ok) ride on SGLang's per-step MIN all-reduce of the HiCache ready counts (one collective,
    the same on every rank);
  * `on_step`: the SSD tier's per-step work (`SsdTier.step`);
  * `admission_ready` / `on_request_released` (upstream/series 0010): a request is held while its SSD
    checkpoint is restored, and an aborted request's restore is cancelled.
On a SGLang with the patch the cache installs this object; on stock 0.5.23 the cache overrides the six
methods that make those calls (tree_cache.py) and calls the same object.
"""
from __future__ import annotations

import importlib
from typing import Any, Optional, Sequence

from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

STORAGE_POLICY_BY_SGLANG = hasattr(UnifiedRadixCache, "set_storage_tier_policy")
"""upstream/series 0008 applied: SGLang calls a `StorageTierPolicy` itself (no HiCache override here)."""

RESTORE_HOLD_BY_SGLANG = STORAGE_POLICY_BY_SGLANG and hasattr(
    importlib.import_module("sglang.srt.mem_cache.storage_tier_policy").StorageTierPolicy, "admission_ready")
"""upstream/series 0010 applied: SGLang asks the policy before admitting a request and tells it of an abort."""


class HiStateStoragePolicy:
    """SGLang's `StorageTierPolicy` for one HiState cache (see the module docstring)."""

    def __init__(self, cache: Any):
        self.cache = cache  # the HiStateRadixCache

    @property
    def _tier(self) -> Any:
        return self.cache.histate.ssd_tier

    def begin_backup(self, node_id: Any) -> Optional[tuple]:
        tier = self._tier
        if tier is None:
            return (None, None)  # no SSD tier: SGLang's own write-through
        node = self.cache.tree_core.node_by_id(node_id)
        if not tier.wants_backup(node):
            return None
        return (node, tier.mark_l3_state(node))

    def end_backup(self, token: tuple, operation_id: Optional[int]) -> None:
        node, l3_state = token
        tier = self._tier
        if tier is None or node is None:
            return
        if operation_id is None:  # nothing queued (storage off, nothing backed up to the host), or it raised
            tier.unmark_l3_state(l3_state)
        else:
            tier.on_backup_started(operation_id, node, l3_state)

    def on_backups_acked(self, operation_ids: Sequence[int], agreed: bool) -> None:
        """The drained count is MIN-agreed (unified_radix_cache.py:3298-3330), so every rank confirms the
        same operations, with one collective; a local drain (detach, shutdown) confirms nothing new."""
        tier = self._tier
        if tier is not None:
            tier.confirm_backups(sorted(operation_ids), agreed=agreed)

    def on_prefetch_committed(self, anchor_node_id: Any, page_hashes: Sequence[str]) -> None:
        tier = self._tier
        if tier is not None:
            tier.on_prefetched(self.cache.tree_core.node_by_id(anchor_node_id), tuple(page_hashes))

    def step_sync_values(self) -> list:
        """[clock ms, -SSD bytes used (MIN of negatives: the largest usage of any rank, which SSD trimming
        decides on), each SSD restore's and each state write's done and ok flags]; those in flight are the
        same on every rank, in the same order, so the list has the same length on every rank."""
        clock, tier = self.cache.agreed_clock, self._tier
        samples = [clock.sample_ms() if clock is not None else 0, -(tier.local_used_bytes() if tier is not None else 0)]
        return samples + (tier.io_flags() if tier is not None else [])

    def adopt_step_sync(self, values: Sequence[int]) -> None:
        clock, tier = self.cache.agreed_clock, self._tier
        if clock is not None:
            clock.adopt(int(values[0]))
        if tier is not None:
            tier.adopt_agreed_usage(-int(values[1]))
            tier.adopt_io_flags([int(x) for x in values[2:]])

    def on_step(self) -> None:
        tier = self._tier
        if tier is not None:
            tier.step()

    def admission_ready(self, request: Any) -> bool:
        """False while the request waits for its SSD checkpoint's restore (`SsdTier.restore_ready`)."""
        tier = self._tier
        return tier is None or tier.restore_ready(request)

    def on_request_released(self, request: Any) -> None:
        """An aborted request's restore is cancelled (its slot freed once the read returns)."""
        tier = self._tier
        if tier is not None:
            tier.cancel(request)
