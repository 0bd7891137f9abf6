"""HiState's SSD tier inside SGLang: what is on it, which objects leave it, and checkpoint restores.

The bytes live in `HiStateStorageBackend` (storage_backend.py); SGLang writes them there through its
own L2 -> L3 write-through (`write_backup_storage` after each host backup, unified_radix_cache.py:
1990-2020). This module keeps the tree's view of that tier, in a way every TP/PP rank shares:

What is written (docs/policies.md "Tiering"): a node's state, through SGLang's write-through; its KV
only when `demote` chose it. The SSD is the host's victim tier for KV: once the host KV pool is more
than 1 - DEMOTE_MARGIN full, or its state slots more than 1 - STATE_DEMOTE_MARGIN (their walk takes
whole host leaves too), the host bundles those walks take next (and the host-only ancestors the same
walk can delete right after them) are written ahead of their eviction; the backend's `admits_kv`
filter skips every other KV page SGLang's write-through hands it.

The shared L3 under the SSD (`--histate-l3 mooncake`) takes the terminal bundle alone
(`histate.core.l3_policy`): before SGLang queues a node's backup, `mark_l3_state` checks whether the
node's state is the deepest checkpoint on its path (`holds_deepest_checkpoint`: no node below it holds
one, in any tier) and, if so, the backend's `l3_admits_state` admits that state's page hash until the
backup is acknowledged (a frozenset the scheduler thread swaps; the backup thread never reads the
tree). Intermediate checkpoints go to the SSD only. The inputs are agreed, so every rank writes alike.
With a fleet L3 budget (`--histate-l3-budget-gb`, `--histate-l3-servers`) the tier also keeps this
server's ledger of its L3 bundles (`histate.core.l3_ledger`, eq. 7) from agreed events only, at the
agreed clock: a confirmed backup that carried a terminal state records its path, an L3 prefetch that
L3 served records (or refreshes) the path it read. The ledger's victims go to the L3 tier's
`remove_bundles`, which removes each rank's own objects off this thread.

SSD bits (`CoreNode.ssd_kv` / `ssd_state`) are set when a storage backup is confirmed (`confirm_backups`:
after SGLang drained its acknowledgement, whose count SGLang MIN-all-reduces, unified_radix_cache.py:
3298-3330, each object the backup was to write counts only if every rank's store holds it; SGLang's ack
itself says nothing of what was stored) or when SGLang inserts host nodes its L3 prefetch read from SSD,
and cleared when an agreed SSD eviction or an agreed failed restore removes them (docs/invariants.md S1-S3). A node SGLang deletes while its objects are on SSD leaves
them as orphans (orphans.py): SGLang's own L3 prefetch can still find them by page hash, and they keep
the eq. 7 score their node had.

SSD victims are chosen on the scheduler thread once per step (`trim`): when the largest SSD usage of
any rank (agreed through the per-step all-reduce, clock.py) passes `HIGH_WATERMARK` of the budget, the
lowest scores go first, over the live SSD units (the core's eq. 7 over the SSD bits, `TierVictims`
tier SSD) and the orphans together (objects from before a restart first), down to `LOW_WATERMARK`,
counted in nominal sizes every rank computes alike. The store's own `on_capacity_needed` (SGLang's
backup thread, between two steps) gets `pick_ssd_victims`: orphan keys only (read under the orphans'
own lock, orphans.py), so it never reads the tree off its thread.

Asymmetric tiering (paper §3.1): a historical checkpoint (its node has a child: a later position of
the trajectory holds state) lives on SSD alone. Once its SSD copy is acknowledged and nothing uses
its device or host copy, `home_historical` (once per step) tombstones both with SGLang's own eviction
primitives, as the MAMBA walk does for an internal state; a terminal checkpoint keeps its device copy
until it becomes historical. Candidates are the states that reached SSD or came back to the device.
A state a live session references (`--enable-session-radix-cache`: its resume point) is homed only once
the reference goes, as SGLang evicts referenced states last.

Restarts and flushes: objects already in the store when the tier is attached (a restart), and every
object of a tree SGLang flushed (`flush_cache`), become orphans, so the trim can reclaim them; restores
in flight at a flush are waited for and forgotten (their host slots belong to the flushed host pool).

Restores: an SSD-only checkpoint is not a hit of SGLang's match (its validators see device and host).
A request's match notes the deepest SSD checkpoint on its matched KV path (`note_match`); when the
scheduler is about to admit the request it asks `check_prefetch_progress` (scheduler.py:4240-4246, the
hook SGLang's own L3 prefetch uses to hold a request until its data is on the host), and HiState then
starts reading that checkpoint into a host state slot on an I/O thread and holds the request. Once every
rank's read finished (MIN of each restore's done / ok, riding on SGLang's per-step all-reduce with the
clock, tree_cache.py: one collective per step for all restores, as SGLang's `wait_complete` prefetch
commits through its per-step ack drain, unified_radix_cache.py:2298-2301), the state
is attached as the node's host copy, exactly where SGLang's PREFETCH commit puts one (components/
mamba.py:974-1010), and the request's next match is an ordinary host hit that SGLang's load-back
brings to the device (schedule_policy.py:1517, layer by layer on its load stream). A restore any rank
failed is a miss on every rank, and the SSD bit goes.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.mem_cache.hicache_storage import PoolName

from histate.core import SSD_BIT, L3Ledger, L3LedgerConfig, Tier, UnitKind, fleet_share_bytes

from .core_nodes import FULL, MAMBA, CoreNode, core_of
from .eviction import is_bundle
from .orphans import UNKNOWN_SCORE, OrphanObjects
from .state_writes import StateWriter

logger = logging.getLogger(__name__)

HIGH_WATERMARK = 0.95  # agreed SSD usage (share of the per-rank budget) that starts a trim
LOW_WATERMARK = 0.90  # ... and where it stops
DEMOTE_MARGIN = 0.10  # share of the host KV pool, lowest-ranked first, kept SSD-backed once the host is this full
STATE_DEMOTE_MARGIN = 0.25  # the same for the host's state slots (few: a pass can fill several at once)
DEMOTE_RETRY_STEPS = 64  # scheduler steps before `demote` writes again a node whose KV some rank did not store


def _covering(amount: float, size) -> Any:
    """An `enough` for `peek`: true once the units seen so far add up to `amount` (`size` per node)."""
    covered = [0]

    def enough(node: CoreNode, unit: UnitKind) -> bool:
        covered[0] += size(node)
        return covered[0] >= amount

    return enough


@dataclass
class _Backup:
    node: CoreNode
    page_hashes: tuple
    with_state: bool
    with_kv: bool  # a demotion (`demote`): the KV pages go to SSD too; else only the state does
    l3_state: Optional[str] = None  # page hash of the state L3 admits (the terminal bundle's), if any
    l3_path: tuple = ()  # with l3_state: the page hashes root .. the node (the bundle's KV), for the ledger


@dataclass
class _Restore:
    node: CoreNode
    host_slot: Any
    unlock: Any  # DecLockRefParams of the lock held while the read runs
    read: Future
    agreed: Optional[tuple] = None  # (done, ok) on every rank, from the last step's all-reduce


def _host_chain(leaf: CoreNode) -> list:
    """`leaf` and the ancestors SGLang's host walk can delete right after it, in the same walk: each
    holds KV on the host only and has no other child, so it becomes a host leaf once the one below goes."""
    chain, sg = [leaf], leaf.sg.parent
    while (sg is not None and sg.parent is not None and len(sg.children) == 1
           and sg.component_data[FULL].value is None and sg.component_data[FULL].host_value is not None):
        chain.append(core_of(sg))
        sg = sg.parent
    return chain


def holds_deepest_checkpoint(node: CoreNode) -> bool:
    """Whether the checkpoint at `node`'s end is the deepest one HiState holds on its path: no node
    below it holds a checkpoint in any tier (device, host or SSD). Its state then ends a terminal
    bundle (the core's unit: a leaf's KV with its checkpoint, `histate.core.units_of`; a KV-only tail
    below it has no state and does not count); otherwise it is an intermediate checkpoint, whose eq. 7
    value is local. The walk stops at the first checkpoint it meets (checkpoint-less nodes sit only at
    branch points and KV tails)."""
    stack = list(node.sg.children.values())
    while stack:
        sg = stack.pop()
        if core_of(sg).ckpt_mask:
            return False
        stack.extend(sg.children.values())
    return True


def path_page_hashes(sg: Any) -> tuple:
    """Page hashes of `sg`'s path, root to its end: the KV pages of the bundle its state ends. SGLang
    keys a page by a hash chained over its prefix, the ledger's prefix-chained keys."""
    parts = []
    while sg is not None and sg.parent is not None:
        parts.append(tuple(sg.hash_value or ()))
        sg = sg.parent
    return tuple(h for part in reversed(parts) for h in part)


class SsdTier:
    def __init__(self, cache: Any, backend: Any):
        self.cache = cache
        self.runtime = cache.histate
        self.backend = backend
        config = self.runtime.core_config
        self.kv_bytes_per_token = config.kv_bytes_per_token
        self.checkpoint_bytes = config.checkpoint_size_bytes
        self.orphans = OrphanObjects()
        self.admitted: frozenset = frozenset()  # page hashes whose KV the backend writes (`demote`)
        self.demoting: dict = {}  # id -> CoreNode whose KV backup to SSD is in flight
        self._demote_steps = 0  # `demote` calls (one per scheduler step, on every rank)
        self._demote_retry_at: dict = {}  # id -> step from which a node whose demotion failed is tried again
        # What the last `demote` walk saw (the host heap's change count after it, the pools' free room,
        # the demotions running): while all of it stays the same, the next walk would choose the same
        # bundles, all already demoting or backed up, so it is skipped (issue 29: no O(n) per step).
        self._demote_seen: Optional[tuple] = None
        self.backups: dict = {}  # SGLang storage-backup operation id -> _Backup
        self.candidates: dict = {}  # request handle -> CoreNode of its deepest SSD-only checkpoint
        self.restores: dict = {}  # request handle -> _Restore
        self._abandoned: list = []  # restores of aborted requests whose read still runs
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="histate-ssd-restore")
        self.agreed_used_bytes = 0
        self.homing: dict = {}  # id -> CoreNode whose faster state copies may go once it is historical
        # The candidates `home_historical` looks at next step: new ones, those a tree event touched
        # (`on_tree_change`) and those held last step. A terminal checkpoint waits for the event that
        # gives its node a child instead of being looked at every step.
        self._homing_due: dict = {}
        # Page hashes of the states whose queued backups L3 admits (`l3_admits_state`): the scheduler
        # thread counts them in `_l3_marks` and publishes the keys as a frozenset the backup thread reads.
        self._l3_marks: dict = {}
        self.l3_terminal: frozenset = frozenset()
        self.l3_ledger = self._l3_ledger()
        self.capacity_bytes = self._agreed_capacity_bytes()
        self.unconfirmed_deleted = 0  # objects some rank's write did not store, deleted where one was
        self._adopt_restart_objects()
        # write_back: each new device checkpoint is written to the SSD at creation (state_writes.py)
        self.state_writes: Optional[StateWriter] = StateWriter(cache, self) \
            if self.runtime.write_back and cache.host_pool_group.get_pool(PoolName.MAMBA) is not None else None
        backend.pick_victims = self.pick_ssd_victims
        backend.admits_kv = self.admits_kv
        backend.l3_admits_state = self.l3_admits_state
        self.runtime.victims.enable_tier(Tier.SSD)

    # --- keys and sizes ----------------------------------------------------------------------------

    def _state_key(self, page_hashes) -> str:
        return self.state_key(page_hashes[-1])

    def state_key(self, page_hash: str) -> str:
        """The store key of the state SGLang keys by `page_hash`, the last page hash of its node."""
        return self.backend.store_key(PoolName.MAMBA, page_hash)

    def _kv_keys(self, page_hashes) -> list:
        from .storage_backend import KV_POOL

        return [self.backend.store_key(KV_POOL, h) for h in page_hashes]

    def kv_copy_key(self, node: CoreNode, end_tokens: int) -> Optional[str]:
        """The store key of `node`'s KV page that ends at `end_tokens` (miss attribution asks whether the
        copy of a deleted node is still on the SSD); None when SGLang has no hash for it."""
        hashes = node.sg.hash_value or ()
        index = (end_tokens - (node.depth_pages - len(node.keys))) // self.cache.page_size - 1
        return self._kv_keys((hashes[index],))[0] if 0 <= index < len(hashes) else None

    def has_copy(self, key: str) -> bool:
        return self.backend.store.exists(key)

    def _kv_bytes(self, node: CoreNode) -> int:
        return len(node.keys) * self.kv_bytes_per_token

    def _nominal_bytes(self, key: str) -> int:
        """What every rank counts for one object: a KV page or a checkpoint at the agreed sizes."""
        from .storage_backend import KV_POOL

        return self.kv_bytes_per_token * self.cache.page_size if key.startswith(f"{KV_POOL}/") \
            else self.checkpoint_bytes

    # --- agreement over the ranks (SGLang's TP/PP all-reduce, scheduler thread) -----------------------

    def _all_reduce(self, values: list, op: Any) -> list:
        import torch

        tensor = torch.tensor(values, dtype=torch.int64)
        self.cache._all_reduce(tensor, op)
        return [int(v) for v in tensor.tolist()]

    def _agreed_capacity_bytes(self) -> int:
        """The SSD budget the trim's watermarks use: the smallest of the ranks' (a 0 --histate-ssd-size
        gives each rank its share of the free space it saw, which may differ), so every rank trims at
        the same agreed usage and none is pushed past its own budget."""
        import torch

        (capacity,) = self._all_reduce([self.backend.store.config.capacity_bytes], torch.distributed.ReduceOp.MIN)
        return capacity

    def _adopt_restart_objects(self) -> None:
        """Objects already in the store (written before this process: a restart) are orphans, but only
        those every rank holds (`agree_common_ids` over the rank-independent part of their keys): an
        object some rank lacks can serve no L3 prefetch (its hits are MIN-agreed) and, tracked on one
        rank alone, would make the trims of the ranks delete different units. The rest are deleted
        here. Orphans go in the agreed id order with nominal sizes, so every rank ranks them alike."""
        import torch

        from .orphans import agree_common_ids, rank_free_id

        store, suffix = self.backend.store, self.backend.key_suffix
        local = {}
        for key in store.keys():
            local[rank_free_id(key[:-len(suffix)] if suffix and key.endswith(suffix) else "\0" + key)] = key

        def reduce(values: list, minimum: bool) -> list:
            return self._all_reduce(values, torch.distributed.ReduceOp.MIN if minimum else torch.distributed.ReduceOp.MAX)

        common = agree_common_ids(set(local), reduce)
        for ident in sorted(common):
            key = local[ident]
            self.orphans.add((key,), self._nominal_bytes(key), UNKNOWN_SCORE)
        strays = [key for ident, key in local.items() if ident not in common]
        if strays:
            logger.info("HiState SSD: %d objects found at attach are not on every rank; deleted", len(strays))
            store.delete_many(strays)

    # --- agreed events: storage backups ------------------------------------------------------------

    def wants_backup(self, sg: Any) -> bool:
        """Whether SGLang's write-through to storage of `sg` has anything to write: its host state
        (checkpoints are written through to SSD), or its KV when `demote` chose it (the SSD is the
        host's victim tier for KV). Agreed inputs only (host values, `demote`'s choices)."""
        return sg.component_data[MAMBA].host_value is not None or id(core_of(sg)) in self.demoting

    def admits_kv(self, page_hash: str) -> bool:
        """The backend's filter on KV pages (SGLang's backup thread): only pages `demote` chose are
        written; the others stay on the host alone (reads a frozenset the scheduler thread swaps)."""
        return page_hash in self.admitted

    # --- the shared L3 takes the terminal bundle (histate.core.l3_policy) ---------------------------

    def l3_admits_state(self, page_hash: str) -> bool:
        """The backend's filter on the states it writes to L3 (SGLang's backup thread): only a state
        marked terminal when its backup was queued (`mark_l3_state`). Reads a frozenset the scheduler
        thread swaps, never the tree."""
        return page_hash in self.l3_terminal

    def mark_l3_state(self, sg: Any) -> Optional[str]:
        """Before SGLang queues `sg`'s backup (its backup thread may run it at once): if `sg`'s host
        state is the deepest checkpoint on its path (`holds_deepest_checkpoint`), L3 admits it until
        the backup is acknowledged. Returns the marked page hash (None: L3 does not get this state).
        Agreed inputs only (the tree, host values, SSD bits), so every rank writes the same states."""
        if getattr(self.backend, "l3", None) is None or sg.component_data[MAMBA].host_value is None \
                or not sg.hash_value:
            return None  # no L3 (nothing to decide), or no state in this backup
        if not holds_deepest_checkpoint(core_of(sg)):
            return None
        page_hash = sg.hash_value[-1]
        self._l3_marks[page_hash] = self._l3_marks.get(page_hash, 0) + 1
        self.l3_terminal = frozenset(self._l3_marks)
        return page_hash

    def unmark_l3_state(self, page_hash: Optional[str]) -> None:
        """The backup that `mark_l3_state` marked for was acknowledged, or never queued."""
        if page_hash is None or page_hash not in self._l3_marks:
            return
        self._l3_marks[page_hash] -= 1
        if self._l3_marks[page_hash] <= 0:
            del self._l3_marks[page_hash]
        self.l3_terminal = frozenset(self._l3_marks)

    def _l3_ledger(self) -> Optional[L3Ledger]:
        """This server's eq. 7 ledger of its L3 bundles, when the L3 tier has a fleet budget
        (`--histate-l3-budget-gb`, `--histate-l3-servers`); None: no deletes, the master's LRU alone.
        Sizes are the agreed per-rank ones times the ranks writing this server's objects, the unit the
        fleet budget is in (every rank's share of a page, core/l3_ledger.py `kv_page_bytes`)."""
        l3 = getattr(self.backend, "l3", None)
        fleet_bytes, servers = getattr(l3, "fleet_budget_bytes", 0), getattr(l3, "num_servers", 0)
        if l3 is None or not fleet_bytes or not servers:
            return None
        ranks = getattr(self.backend, "num_ranks", 1)
        page_tokens = self.cache.page_size
        return L3Ledger(L3LedgerConfig(
            budget_bytes=fleet_share_bytes(fleet_bytes, servers), page_num_tokens=page_tokens,
            kv_page_bytes=max(1, self.kv_bytes_per_token * page_tokens * ranks),
            state_bytes=self.checkpoint_bytes * ranks, tau_s=self.runtime.core_config.tau_s))

    def _l3_record(self, path: tuple) -> None:
        """An agreed L3 event (a terminal bundle's backup confirmed, an L3 read): record the bundle at
        the agreed clock and remove the ledger's victims (every rank picks the same ones)."""
        if self.l3_ledger is None or not path:
            return
        self.l3_ledger.record(path, self.runtime.now())
        deletes = self.l3_ledger.plan_deletes(protect=path[-1])
        if deletes:
            self.backend.l3.remove_bundles(list(deletes.kv_keys), list(deletes.state_keys))

    def on_backup_started(self, operation_id: Any, sg: Any, l3_state: Optional[str] = None) -> None:
        """SGLang queued `sg`'s pages (and its host state, if any) for the SSD (`write_backup_storage`);
        `l3_state`: the page hash `mark_l3_state` marked for this backup, unmarked on its ack."""
        hashes = tuple(sg.hash_value or ())
        self.backups[operation_id] = _Backup(core_of(sg), hashes, sg.component_data[MAMBA].host_value is not None,
                                             bool(hashes) and set(hashes) <= self.admitted, l3_state,
                                             path_page_hashes(sg) if l3_state is not None else ())

    def confirm_backups(self, operation_ids: list, agreed: bool = True) -> None:
        """SGLang drained these storage backups' acknowledgements (the same operations, in the same
        order, on every rank). SGLang acks every backup, failed or not (cache_controller.py:1416-1458:
        a failed `page_set` only stops `completed_tokens`, which it never all-reduces), so the ack says
        nothing of what was stored. HiState asks its store, per object, whether it holds each KV page
        the backup was to write and its state, and takes the MIN over the ranks in one collective: an
        object counts as on SSD only where every rank holds it (`agreed=False`, a local drain at detach:
        nothing is confirmed). What the store holds is the truth the write left, whatever it reported,
        including an orphan the store evicted under the backup."""
        import torch

        jobs = [(op, self.backups.pop(op)) for op in operation_ids if op in self.backups]
        if not jobs:
            return
        keys_per_job = [self._object_keys(backup) for _, backup in jobs]
        store = self.backend.store
        flags = [int(store.exists(key)) for keys in keys_per_job for key in keys]
        if agreed:
            flags = self._all_reduce(flags, torch.distributed.ReduceOp.MIN)
        else:
            flags = [0] * len(flags)
        at = 0
        for (_, backup), keys in zip(jobs, keys_per_job):
            self._on_backup_confirmed(backup, [bool(f) for f in flags[at:at + len(keys)]])
            at += len(keys)
            if agreed and backup.l3_state is not None and backup.l3_path[-1:] == (backup.l3_state,):
                # The backup that carried this terminal bundle's state to L3 is done: an agreed event
                # (each rank's L3 put results are its own; a bundle recorded but not whole in L3 only
                # costs a remove of what is missing, and reads as a miss as before).
                self._l3_record(backup.l3_path)

    def on_backup_acked(self, operation_id: Any) -> None:
        """One acknowledgement (tests, single rank): `confirm_backups` of it."""
        self.confirm_backups([operation_id])

    def _object_keys(self, backup: _Backup) -> list:
        """The store keys a backup was to write: its KV pages (a demotion) and its state. Agreed inputs
        (the page hashes, `with_kv`, `with_state`), so the list has the same length on every rank."""
        keys = self._kv_keys(backup.page_hashes) if backup.with_kv and backup.page_hashes else []
        if backup.with_state and backup.page_hashes:
            keys.append(self._state_key(backup.page_hashes))
        return keys

    def _on_backup_confirmed(self, backup: _Backup, stored: list) -> None:
        """Set SSD bits, claims and SSD bytes from what every rank stored (`stored`, per object key of
        `_object_keys`): a node's KV is SSD-backed only if all its pages are, its state only if the state
        object is. A checkpoint not confirmed keeps its device and host copies (`home_historical` only
        takes confirmed ones); a KV page not confirmed leaves its node as it was, so `demote` writes it
        again before the host evicts it. Objects of the backup that no bit and no orphan accounts for
        are deleted where a rank holds them: only agreed objects stay on SSD."""
        self.unmark_l3_state(backup.l3_state)
        if not backup.page_hashes:
            return
        node = backup.node
        if backup.with_kv:
            self.demoting.pop(id(node), None)
            self.admitted = self.admitted - set(backup.page_hashes)
            if not all(stored[:len(backup.page_hashes)]):  # not again at once: a failing disk would take a write per step
                self._demote_retry_at[id(node)] = self._demote_steps + DEMOTE_RETRY_STEPS
        kv_stored = stored[:len(stored) - 1] if backup.with_state else stored
        state_stored = bool(backup.with_state and stored[-1])
        written = {h for h, ok in zip(backup.page_hashes, kv_stored) if ok}
        state_key = self._state_key(backup.page_hashes)
        if not node.is_alive:
            self._orphan_group(tuple(h for h in backup.page_hashes if h in written),
                               backup.page_hashes if state_stored else (), UNKNOWN_SCORE)
            self._drop_unaccounted(backup, written, state_stored, kept=set())
            return
        kept = set()  # keys a bit already holds (a node backed up again keeps its earlier copy)
        had_checkpoint, had_ssd_state = bool(node.ckpt_mask), node.ssd_state
        if had_ssd_state:
            kept.add(state_key)
        if state_stored:
            if node.sg.hash_value and node.sg.hash_value[-1] == backup.page_hashes[-1]:
                self._state_on_ssd(node, state_key)
            elif state_key not in self.orphans:
                self._orphan_group((), backup.page_hashes, UNKNOWN_SCORE)
        victims = self.runtime.victims
        marked, new_kv_tokens = [], 0
        head = node
        while head.sg.parent is not None and head.sg.hash_value and set(head.sg.hash_value) <= set(backup.page_hashes):
            if head.ssd_kv:
                kept |= set(self._kv_keys(head.sg.hash_value))
            elif set(head.sg.hash_value) <= written:
                new_kv_tokens += len(head.keys)
                head.ssd_kv = True  # the node, and the heads split off it since the backup started
                marked.append(head)
            else:
                break  # a page of this node is not on every rank: neither it nor what is above is backed
            head = head.parent
        claimed = [key for head in marked for key in self._kv_keys(head.sg.hash_value)]
        if claimed:
            self.orphans.claim(claimed)
        kept |= set(claimed)
        loose = tuple(h for h in backup.page_hashes if h in written and self._kv_keys((h,))[0] not in kept
                      and self._kv_keys((h,))[0] not in self.orphans)
        if loose:  # stored on every rank, but its node is not whole on SSD: the trim may reclaim it
            self._orphan_group(loose, (), UNKNOWN_SCORE)
            kept |= set(self._kv_keys(loose))
        self._drop_unaccounted(backup, written, state_stored, kept)
        if node.ckpt_mask and not had_checkpoint:
            victims.touch_checkpoint_neighbourhood(node)
        self.runtime.bytes_in(Tier.SSD, new_kv_tokens * self.kv_bytes_per_token
                              + (self.checkpoint_bytes if node.ssd_state and not had_ssd_state else 0))
        for changed in marked + ([head] if head.sg.parent is not None else []):
            victims.touch(changed)  # new SSD units; `head` is no longer an SSD tier-leaf

    def _drop_unaccounted(self, backup: _Backup, written: set, state_stored: bool, kept: set) -> None:
        """Delete, on this rank, the backup's objects no rank-agreed record holds: not stored on every
        rank, not kept by a bit, not an orphan. They are the leftovers of a write some rank did not
        finish; tracked on no rank, they would only fill this rank's budget."""
        keys = [k for h, k in zip(backup.page_hashes, self._kv_keys(backup.page_hashes)) if h not in written] \
            if backup.with_kv else []
        if backup.with_state and not state_stored:
            keys.append(self._state_key(backup.page_hashes))
        store = self.backend.store
        for key in keys:
            if key not in kept and key not in self.orphans and store.exists(key):
                store.delete(key)
                self.unconfirmed_deleted += 1

    def _state_on_ssd(self, node: CoreNode, key: str) -> None:
        """`node`'s state object `key` is on every rank's store: its SSD bit, its claim on an orphan under the
        key, the write's Little's-law sample, and its device and host copies retired once it is historical."""
        node.ssd_state = True
        self.orphans.claim((key,))
        self.runtime.state.on_state_written(self.runtime.now())
        self.note_state_copy(node)

    def on_state_written(self, node: CoreNode, page_hash: str, key: str) -> None:
        """A state-only write (state_writes.py) stored `node`'s state on every rank: the same bookkeeping
        as a confirmed backup's state (`_on_backup_confirmed`). A node that went, or now ends elsewhere
        (it cannot: a split keeps the state's end), leaves the object as an orphan the trim reclaims."""
        if not node.is_alive or not node.sg.hash_value or node.sg.hash_value[-1] != page_hash:
            if key not in self.orphans:
                self._orphan_group((), (page_hash,), UNKNOWN_SCORE)
            return
        if node.ssd_state:
            return
        had_checkpoint = bool(node.ckpt_mask)
        self._state_on_ssd(node, key)
        if not had_checkpoint:
            self.runtime.victims.touch_checkpoint_neighbourhood(node)
        self.runtime.bytes_in(Tier.SSD, self.checkpoint_bytes)
        self.runtime.victims.touch(node)
        self.runtime.victims.touch(node.parent)  # it may no longer be an SSD tier-leaf

    def on_prefetched(self, anchor: Any, page_hashes: tuple) -> None:
        """SGLang's L3 prefetch inserted host nodes below `anchor` from these SSD pages (an agreed
        event: every rank inserts the MIN-agreed length): their KV is on SSD, and no longer orphaned.
        Only pages the tree now holds below `anchor` count: a prefetch SGLang discarded (a hybrid
        all-or-nothing shortfall) or dropped inserted none, and its objects stay orphans (stock 0.5.23
        reports every prefetch; upstream/series 0008 only committed ones)."""
        fetched = set(page_hashes)
        found = set()
        stack = list(anchor.children.values())
        while stack:
            sg = stack.pop()
            if not sg.hash_value or not set(sg.hash_value) <= fetched:
                continue
            found.update(sg.hash_value)
            node = core_of(sg)
            if not node.ssd_kv:
                node.ssd_kv = True
                self.runtime.victims.touch(node)
                self.runtime.victims.touch(node.parent)
            stack.extend(sg.children.values())
        held = tuple(page for page in page_hashes if page in found)
        if not held:
            return
        if self.l3_ledger is not None:
            # Pages that were no agreed SSD orphan came from L3 (the SSD objects a prefetch can read are
            # orphans, agreed on every rank): the bundle read is this server's now, as in sim/cluster.py.
            # A read from the SSD alone only refreshes a bundle the ledger already holds.
            path = path_page_hashes(anchor) + held
            if path[-1] in self.l3_ledger or any(key not in self.orphans for key in self._kv_keys(held)):
                self._l3_record(path)
        self.orphans.claim(self._kv_keys(held))

    def on_node_removed(self, node: CoreNode) -> None:
        """SGLang deleted `node`: its SSD objects become orphans, ranked by the score they had."""
        hashes = tuple(node.sg.hash_value or ())
        self.homing.pop(id(node), None)
        self._homing_due.pop(id(node), None)
        self.demoting.pop(id(node), None)
        self._demote_retry_at.pop(id(node), None)
        if self.state_writes is not None:
            self.state_writes.forget(node)
        if node.ssd_kv or node.ssd_state:
            unit = UnitKind.BUNDLE if node.ssd_kv else UnitKind.CHECKPOINT
            score = self.runtime.state.score(node, unit, SSD_BIT)
            self._orphan_group(hashes if node.ssd_kv else (), hashes if node.ssd_state else (), score)
            node.ssd_kv = node.ssd_state = False

    def on_tree_reset(self, nodes) -> None:
        """SGLang is about to drop its whole tree (`flush_cache`): every object on SSD becomes an
        orphan; restores in flight are waited for (their reads write into host slots the flush hands
        back) and forgotten, so no request waits on a node that is gone."""
        for job in list(self.restores.values()) + self._abandoned:
            try:
                job.read.result()
            except Exception:  # a failed read is a miss; nothing of it is used
                pass
        self.restores.clear()
        self._abandoned = []
        if self.state_writes is not None:
            self.state_writes.close(reopen=True)  # its staging slots belong to the flushed host pool
        self.candidates.clear()
        self.homing.clear()
        self._homing_due.clear()
        self.demoting.clear()
        self._demote_retry_at.clear()
        self._demote_seen = None
        for node in nodes:
            self.on_node_removed(node)

    def _orphan_group(self, kv_hashes: tuple, state_hashes: tuple, score: float) -> None:
        page_bytes = self.kv_bytes_per_token * self.cache.page_size
        self.orphans.add(self._kv_keys(kv_hashes), page_bytes, score)
        if state_hashes:
            self.orphans.add((self._state_key(state_hashes),), self.checkpoint_bytes, score)

    # --- the SSD as the host's victim tier for KV ---------------------------------------------------

    def demote(self) -> int:
        """Write host KV ahead of its eviction, so what the host evicts is on SSD already (its objects
        stay cache as orphans). Two walks evict host bundles, so two triggers, each once the pool its
        walk frees is full past 1 - its margin:
          * the KV pool (FULL's walk): the lowest-ranked host bundles covering DEMOTE_MARGIN of the pool;
          * the state slots (MAMBA's walk, a small staging pool that runs short long before the KV pool
            when prompts are short of the host's room): of the units that walk takes next, lowest first,
            covering STATE_DEMOTE_MARGIN of the slots, the bundles (a host leaf goes whole: SGLang keeps
            no KV tail without its state). Without this trigger those bundles' KV left the host and
            never reached the SSD (issue 27, R2).
        Each chosen bundle, with the host-only ancestors the same walk can delete after it
        (`_host_chain`), is made SSD-backed through SGLang's own `write_backup_storage` with its pages
        admitted. Scheduler thread, once per step; every input is agreed (pool usage follows tree
        events, eq. 7 on the agreed clock). Returns backups started."""
        from .eviction import takes_host_state

        group = self.cache.host_pool_group
        if group is None:
            return 0
        self._demote_steps += 1
        retry_at = self._demote_retry_at
        kv_pool, state_pool = group.get_pool(PoolName.KV), group.get_pool(PoolName.MAMBA)
        host_heap = self.runtime.victims.heaps[Tier.CPU]

        def observed() -> tuple:
            return (host_heap.changes, kv_pool.available_size() if kv_pool is not None else None,
                    state_pool.available_size() if state_pool is not None else None, len(self.demoting))

        # (a failed demotion becoming due again changes the choice too, at the step it becomes due)
        if self._demote_seen == observed() and self._demote_steps not in retry_at.values():
            return 0
        leaves = []
        if kv_pool is not None and kv_pool.available_size() <= DEMOTE_MARGIN * kv_pool.size:
            leaves += [leaf for leaf, _ in self.runtime.victims.peek(
                Tier.CPU, is_bundle, _covering(DEMOTE_MARGIN * kv_pool.size, lambda node: len(node.keys)))]
        if state_pool is not None and state_pool.available_size() <= STATE_DEMOTE_MARGIN * state_pool.size:
            leaves += [node for node, unit in self.runtime.victims.peek(
                Tier.CPU, takes_host_state, _covering(STATE_DEMOTE_MARGIN * state_pool.size, lambda node: 1))
                if is_bundle(node, unit)]
        chosen, seen = [], set()
        for leaf in leaves:
            for node in _host_chain(leaf):
                if id(node) not in seen and not node.ssd_kv and id(node) not in self.demoting and node.sg.hash_value \
                        and retry_at.get(id(node), 0) <= self._demote_steps:
                    retry_at.pop(id(node), None)
                    chosen.append(node)
                seen.add(id(node))
        started = 0
        for node in chosen:
            hashes = set(node.sg.hash_value)
            self.admitted = self.admitted | hashes
            self.demoting[id(node)] = node
            before = len(self.cache.ongoing_backup)
            self.cache.write_backup_storage(node.sg.id)
            if len(self.cache.ongoing_backup) > before:
                started += 1
                self.runtime.metrics.record_demoted(len(node.keys))
            else:  # SGLang queued nothing (storage disabled, or not backed up to the host after all)
                self.demoting.pop(id(node), None)
                self.admitted = self.admitted - hashes
        self._demote_seen = observed()
        return started

    # --- asymmetric tiering: historical checkpoints live on SSD -----------------------------------

    def note_state_copy(self, node: CoreNode) -> None:
        """`node`'s state is on SSD and may have a device or host copy: retire those once it is
        historical (`home_historical`)."""
        if node.ssd_state:
            self.homing[id(node)] = node
            self._homing_due[id(node)] = node

    def on_tree_change(self, node: CoreNode) -> None:
        """SGLang's tree core updated `node`'s leaf status (an insert gave it a child, a lock went, a
        split, a removal below): a waiting homing candidate is looked at again next step."""
        if id(node) in self.homing:
            self._homing_due[id(node)] = node

    def home_historical(self) -> int:
        """Tombstone the device and host copies of historical checkpoints whose SSD copy is
        acknowledged and that nothing holds (locks, DMA in flight). Scheduler thread, once per step;
        every input is agreed (SSD acks, the tree). Returns how many copies went.

        Only the candidates due this step are looked at (`_homing_due`): a terminal checkpoint stays
        a candidate without being looked at until a tree event on its node; one held by a lock, a DMA
        or a live session is looked at again every step, as before (those are the requests and sessions
        in flight, not every terminal checkpoint on SSD)."""
        due, self._homing_due = self._homing_due, {}
        dropped = 0
        for key, node in due.items():
            if not node.is_alive or not node.ssd_state:
                self.homing.pop(key, None)
                continue
            if not node.sg.children:
                continue  # still a terminal checkpoint: its device copy serves the next turn
            if node.sg.component_data[MAMBA].session_ref > 0:
                self._homing_due[key] = node  # a live session resumes here: kept while referenced
                continue
            result = self.cache.retire_state_copies(node.sg)
            if result is None:
                self._homing_due[key] = node  # held; try again next step
                continue
            dropped += result
            self.homing.pop(key, None)
            self.runtime.victims.touch(node)
        if dropped:
            self.runtime.metrics.record_homed(dropped)
        return dropped

    # --- SSD victims --------------------------------------------------------------------------------

    def local_used_bytes(self) -> int:
        return self.backend.store.used_bytes

    def adopt_agreed_usage(self, used_bytes: int) -> None:
        self.agreed_used_bytes = used_bytes

    def trim(self) -> int:
        """Delete SSD objects down to LOW_WATERMARK once the agreed usage passed HIGH_WATERMARK, lowest
        eq. 7 score first over the live SSD units and the orphans (frozen at the score their node had
        when SGLang deleted it; objects from before a restart first). Returns the nominal bytes freed.
        Scheduler thread."""
        capacity = self.capacity_bytes
        if self.agreed_used_bytes <= HIGH_WATERMARK * capacity:
            return 0
        need = self.agreed_used_bytes - LOW_WATERMARK * capacity
        freed = 0
        store, victims, state = self.backend.store, self.runtime.victims, self.runtime.state
        victims.begin_walk()
        try:
            while freed < need:
                victim = victims.next_victim(Tier.SSD)
                orphan_score = self.orphans.lowest_score()
                if victim is not None and (orphan_score is None
                                           or state.score(victim[0], victim[1], SSD_BIT) <= orphan_score):
                    node, unit = victim
                    self.runtime.on_evicted(node, unit, Tier.SSD, self.runtime.now())
                    freed += self.evict_unit(node, unit)
                    continue
                if victim is not None:
                    victims.touch(victim[0])  # an orphan ranks lower: the unit stays
                group = self.orphans.pop_lowest()
                if group is None:
                    break
                keys, size_bytes = group
                for key in keys:
                    store.delete(key)
                freed += size_bytes * len(keys)
        finally:
            victims.end_walk()
        return freed

    def evict_unit(self, node: CoreNode, unit: UnitKind) -> int:
        """Delete one SSD unit's objects; returns its nominal bytes."""
        store, hashes = self.backend.store, tuple(node.sg.hash_value or ())
        freed = 0
        if unit is UnitKind.BUNDLE:
            for key in self._kv_keys(hashes):
                store.delete(key)
            node.ssd_kv = False
            freed += self._kv_bytes(node)
        if node.ssd_state and (unit is UnitKind.CHECKPOINT or not node.sg.children):
            store.delete(self._state_key(hashes))
            node.ssd_state = False
            freed += self.checkpoint_bytes
        self.runtime.victims.touch(node)
        self.runtime.victims.touch(node.parent)  # it may be an SSD tier-leaf now
        return freed

    def pick_ssd_victims(self, bytes_needed: int) -> list:
        """The store's `on_capacity_needed` (docs/storage.md): orphans lowest score first, never a
        live unit (ranking reads the tree, which only the scheduler thread may). Runs in SGLang's
        backup thread, on the orphans as they are now (their lock). An orphan the store no longer
        holds (this callback's earlier round removed it, and the trim has not yet dropped its group)
        frees nothing, so it is skipped (before, a put whose victims were all gone failed
        `no_capacity` with orphans left to reclaim)."""
        return self.orphans.lowest_keys(bytes_needed, self.backend.store.exists)

    # --- restores ----------------------------------------------------------------------------------

    def note_match(self, handle: Any, ckpt_node: Optional[CoreNode]) -> None:
        """A request matched; remember the checkpoint to restore when it is next up for admission. SGLang
        asks for that (`check_prefetch_progress`) before the admission's own match (scheduler.py:4240-4258):
        a checkpoint only that match finds on the SSD makes the request wait one more round
        (restore_recheck.py)."""
        if ckpt_node is not None and ckpt_node.ckpt_mask == SSD_BIT:
            self.candidates[handle] = ckpt_node
        else:
            self.candidates.pop(handle, None)

    def restore_pending(self, handle: Any) -> bool:
        """Whether the request's latest match left a checkpoint on the SSD alone to restore, and no restore
        of it runs yet (restore_recheck.py)."""
        return handle not in self.restores and self._restorable(handle, self.candidates.get(handle))

    def _restorable(self, handle: Any, node: Optional[CoreNode]) -> bool:
        if node is None or not node.is_alive or node.ckpt_mask != SSD_BIT:
            return False
        # SGLang's own L3 prefetch for this request (whose hold ended just before this) may have brought KV
        # and a state from past the matched path, deeper than this checkpoint, noted at the earlier match:
        # the restore would only take a host slot, evicting what the prefetch just landed
        # (unified_radix_cache.py:2391-2420, 2518; the counts are rank-agreed).
        return not self.cache.prefetch_loaded_tokens_by_reqid.get(handle, 0)

    def forget_request(self, handle: Any) -> None:
        """The request was admitted (its first pass is built): nothing of it is left to restore (an
        admission match that noted a checkpoint, past `restore_recheck.MAX_RECHECKS`, would stay here)."""
        self.candidates.pop(handle, None)

    def restore_ready(self, handle: Any) -> bool:
        """False while the request waits for its checkpoint (scheduler thread, admission loop)."""
        job = self.restores.get(handle)
        if job is None:
            node = self.candidates.pop(handle, None)
            if not self._restorable(handle, node):
                return True  # nothing (left) to restore: these inputs are the same on every rank
            job = self._start(node)
            if job is None:
                return True
            self.restores[handle] = job
            return False
        if job.agreed is None or not job.agreed[0]:
            return False  # not yet read on every rank, as of the last step
        del self.restores[handle]
        self._finish(job, job.agreed[1])
        return True

    def io_flags(self) -> list:
        """This rank's (done, ok) of every restore in flight, in start order, then of the abandoned ones
        (their slots are freed on the agreed done, `reap`), then those of the state-only writes
        (state_writes.py): the same on every rank (both start and end on agreed inputs), for the
        per-step MIN all-reduce (storage_policy.py)."""
        flags = []
        for job in [*self.restores.values(), *self._abandoned]:
            done = job.read.done()
            flags += [int(done), int(done and job.read.exception() is None and bool(job.read.result()))]
        return flags + (self.state_writes.flags() if self.state_writes is not None else [])

    def adopt_io_flags(self, flags: list) -> None:
        """The MIN over the ranks of `io_flags`: a restore completes (`restore_ready`) once every rank read
        it, ok only if every rank's read was; a state write likewise (`StateWriter.finish`). One collective
        per step for all of them, like SGLang's own prefetch acknowledgements (its `wait_complete` prefetch
        commits through the per-step ack drain: unified_radix_cache.py:2298-2301), instead of one per poll
        per request."""
        jobs = [*self.restores.values(), *self._abandoned]
        num_restore_flags = 2 * len(jobs)
        for job, done, ok in zip(jobs, flags[0:num_restore_flags:2], flags[1:num_restore_flags:2]):
            job.agreed = (bool(done), bool(ok))
        if self.state_writes is not None:
            self.state_writes.adopt_flags(flags[num_restore_flags:])

    def _start(self, node: CoreNode) -> Optional[_Restore]:
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        cache, sg = self.cache, node.sg
        host_pool = cache.host_pool_group.get_pool(PoolName.MAMBA) if cache.host_pool_group else None
        if host_pool is None or not sg.hash_value:
            return None
        unlock = cache.inc_lock_ref(sg.id).to_dec_params()  # the node stays while its state is read
        slot = host_pool.alloc(1)
        if slot is None:
            cache.evict_host(1, ComponentType.MAMBA)
            slot = host_pool.alloc(1)
        if slot is None:
            cache.dec_lock_ref(sg.id, unlock)
            return None
        page_hash = sg.hash_value[-1]
        read = self._reader.submit(self.backend.read_state, page_hash, host_pool, int(slot[0]))
        return _Restore(node, slot, unlock, read)

    def _finish(self, job: _Restore, ok: bool) -> None:
        cache, node = self.cache, job.node
        sg = node.sg
        if ok and node.is_alive and sg.component_data[MAMBA].host_value is None:
            cache.tree_core.set_component_host_value(sg.id, MAMBA, job.host_slot.clone())
            node.ckpt_access_s = self.runtime.now()
            self.runtime.metrics.record_restore(ok=True)
        else:
            self._free_slot(job.host_slot)
            if not ok and node.is_alive:  # a fault on some rank: a miss everywhere, and no SSD copy
                node.ssd_state = False
                self.runtime.victims.touch(node)
                self.runtime.metrics.record_restore(ok=False)
                self.runtime.on_state_lost(node)
        if node.is_alive:
            cache.dec_lock_ref(sg.id, job.unlock)

    def _free_slot(self, slot: Any) -> None:
        self.cache.host_pool_group.get_pool(PoolName.MAMBA).free(slot)

    def cancel(self, handle: Any) -> None:
        """The request left (aborted): unlock its node; the slot is freed once every rank's read ended (`reap`)."""
        self.candidates.pop(handle, None)
        job = self.restores.pop(handle, None)
        if job is None:
            return
        if job.node.is_alive:
            self.cache.dec_lock_ref(job.node.sg.id, job.unlock)
        self._abandoned.append(job)
        self.reap()

    def step(self) -> None:
        """The tier's work once per scheduler step, after the step's agreed all-reduce: end the state
        writes every rank finished, home historical checkpoints, demote host KV, trim, start queued state
        writes, free the slots of abandoned restores."""
        if self.state_writes is not None:
            self.state_writes.finish()
        self.home_historical()
        self.demote()
        self.trim()
        if self.state_writes is not None:
            self.state_writes.start()
        self.reap()

    def reap(self) -> None:
        """Free the host slots of abandoned restores whose read ended on every rank (agreed at the step's
        all-reduce, `io_flags`): a slot freed at each rank's own moment would make the host pools' free room
        differ between ranks, and the next allocation that depends on it (a restore's, a state write's)
        would go one way on one rank and the other way on another."""
        running = []
        for job in self._abandoned:
            if job.agreed is not None and job.agreed[0]:
                self._free_slot(job.host_slot)
            else:
                running.append(job)
        self._abandoned = running

    def check_invariants(self) -> None:
        """S1 on this rank (docs/invariants.md): the store holds every object an SSD bit claims (tests;
        a read that found an object damaged drops it before the agreed restore clears the bit, so call
        this where no restore failed)."""
        store = self.backend.store
        for sg in self.cache.tree_core._node_arena.values():
            node = getattr(sg, "_hs_core", None)
            if node is None or sg.parent is None:
                continue
            if node.ssd_kv:
                missing = [k for k in self._kv_keys(sg.hash_value) if not store.exists(k)]
                assert not missing, f"S1: node {sg.id} is marked SSD-backed; {len(missing)} pages are not stored"
            if node.ssd_state:
                assert store.exists(self._state_key(sg.hash_value)), f"S1: node {sg.id}'s state is not stored"
        if self.state_writes is not None:
            self.state_writes.check_invariants()

    def close(self) -> None:
        """Detach: finish or drop every restore and forget the SSD bits (every rank detaches)."""
        for handle in list(self.restores):
            self.cancel(handle)
        if self.state_writes is not None:
            self.state_writes.close()
        self._reader.shutdown(wait=True)
        for job in self._abandoned:  # every read has ended, and every rank detaches here
            self._free_slot(job.host_slot)
        self._abandoned = []
        self.backend.pick_victims = None
        self.backend.admits_kv = None
        self.backend.l3_admits_state = None
        self._l3_marks.clear()
        self.l3_terminal = frozenset()
        self.candidates.clear()
        self.orphans.clear()
        self.admitted = frozenset()
        self.demoting.clear()
        self.backups.clear()
        for sg in self.cache.tree_core._node_arena.values():
            node = getattr(sg, "_hs_core", None)
            if node is not None and (node.ssd_kv or node.ssd_state):
                node.ssd_kv = node.ssd_state = False
                self.runtime.victims.touch(node)
