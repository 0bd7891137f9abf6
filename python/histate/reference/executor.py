"""ReferenceExecutor: serves requests on the tiny Qwen3.5 with histate.core deciding what lives where.

Per request of L tokens (page keys cover tokens [0, L-1): the last input token is always computed,
as in SGLang, so there are always logits to compare):

    lease = cache.begin_request(keys)           m, c; may promote KV toward the GPU   -> apply ops
    restore KV pages [0, c) from the fastest tier holding each, and the checkpoint at c from
    match.checkpoint_tier                        (GPU pool slot / CPU packed buffer / SSD object)
    plan = cache.plan_checkpoints(lease)         page depths in (c, num_pages]
    prefill tokens [cP, L) on the restored cache, capturing the recurrent state at every planned
    depth inside that one forward              (histate.reference.gdr via gdn_kernels)
    cache.finish_request(lease, keys, plan)      inserts, evicts, demotes              -> apply ops

With an L3 tier (l3_tier.py; `histate serve --l3-master`), the shared store sits beside the core:
after the restore, L3 may extend the resume point from c to p (KV pages [c, p) and the state at p,
read from L3); the prefill starts at p, and the core is told of the state at p as if this pass had
captured it (plan depths in (c, p] cannot be captured from p and are dropped). The L3 KV pages enter
the core's tiers exactly as computed pages would. After finish_request, the request's terminal
bundle (core/l3_policy.py: the deepest state the core holds on its path, and the KV before it) goes to L3.

"Apply ops" replays the core's TierOps (put / move / copy / drop of KV segments and checkpoints)
on the executor's own stores (tier_stores.py); `check_mirror()` then proves the bytes held in each
tier are exactly what the core's tree and ledger say. Nothing is read from a tier the core did not
place it in, so a wrong placement decision shows up as a StoreMismatch or as wrong logits.

The "GPU" tier is the model's device (CPU in CI); see docs/exactness.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from histate_kernels import pack_slot

from histate.core import CacheConfig, ItemKind, Tier, TierOp, fastest_tier, make_cache
from histate.reference.hybrid_cache import Checkpoint, kv_pages_from_cache, restore_cache
from histate.reference.l3_tier import L3Codec, L3Hit, L3Tier
from histate.reference.page_keys import PageKey, page_keys
from histate.reference.runner import ModelRunner
from histate.reference.ssd import SsdObjects
from histate.reference.tier_stores import (
    GpuCheckpointPool,
    ObjectLost,
    KvPageStore,
    PackedCheckpointStore,
    SsdCheckpointStore,
    SsdKvPageStore,
    StoreMismatch,
)

CheckpointFault = Callable[[Sequence[int], Checkpoint], Checkpoint]


@dataclass(frozen=True, slots=True)
class ServedRequest:
    """What happened to one request, and its outputs (for comparison with a cold run)."""

    num_input_tokens: int
    num_pages: int  # page keys of the request (tokens [0, L-1))
    num_kv_pages: int  # m
    num_reused_pages: int  # c
    kv_pages_by_tier_at_match: dict  # Tier -> pages of [0, c) where the match found them
    kv_pages_read_by_tier: dict  # Tier -> pages of [0, c) actually read (after promotion)
    checkpoint_tier: Tier | None  # where the checkpoint at c was read from
    planned_checkpoint_pages: tuple[int, ...]  # depths handed to the core (captured inside this prefill, or L3's)
    last_logits: torch.Tensor  # float64 [vocab]
    decode_logits: tuple[torch.Tensor, ...]  # after each teacher-forced decode token
    num_l3_pages: int = 0  # pages [c, c + num_l3_pages) resumed from L3 (KV and the state at their end)


@dataclass
class _Staged:
    """Data produced by the current request that a `put` op may ask for."""

    kv: dict[PageKey, torch.Tensor] = field(default_factory=dict)
    capture_index: dict[PageKey, int] = field(default_factory=dict)
    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


class ReferenceExecutor:
    def __init__(self, runner: ModelRunner, policy: str, capacity_bytes: Mapping[Tier, int], ssd: SsdObjects,
                 *, checkpoint_fault: CheckpointFault | None = None, config_overrides: Mapping | None = None,
                 l3: L3Tier | None = None):
        geometry = runner.geometry
        self.runner = runner
        self.geometry = geometry
        config = CacheConfig(
            page_num_tokens=geometry.page_num_tokens,
            kv_bytes_per_token=geometry.kv_bytes_per_token,
            checkpoint_size_bytes=geometry.checkpoint_size_bytes,
            capacity_bytes=dict(capacity_bytes),
            record_ops=True,
            **dict(config_overrides or {}),
        )
        self.cache = make_cache(policy, config)
        if self.cache.policy.dense_checkpoints:
            raise ValueError(f"policy {policy!r} keeps implicit states at every page; the executor replays explicit "
                             "checkpoint ops only")
        device = next(runner.model.parameters()).device
        gpu_slots = capacity_bytes[Tier.GPU] // geometry.checkpoint_size_bytes + 1
        gpu_pool = GpuCheckpointPool(geometry, gpu_slots, device)
        pin = device.type == "cuda"
        self.kv_stores = {
            Tier.GPU: KvPageStore("GPU", device),
            Tier.CPU: KvPageStore("CPU", torch.device("cpu"), pin=pin),
            Tier.SSD: SsdKvPageStore(ssd, geometry),
        }
        self.checkpoint_stores = {
            Tier.GPU: gpu_pool,
            Tier.CPU: PackedCheckpointStore(gpu_pool.layout, pin=pin),
            Tier.SSD: SsdCheckpointStore(ssd, gpu_pool.layout),
        }
        self.layout = gpu_pool.layout
        self.checkpoint_fault = checkpoint_fault
        self.l3 = l3  # the shared store beside the core, or None (then serving is exactly as without it)
        self.l3_codec = L3Codec(geometry, self.layout) if l3 is not None else None
        self.op_counts: Counter = Counter()  # (action, kind, src, dst) -> ops applied
        self.num_lost_objects = 0  # SSD objects found missing or corrupt, each served as a miss
        self._unwritten: set = set()  # (tier, page key) a failed copy left empty until the core drops it
        self.num_copies_forgotten = 0  # copies the core forgot on the executor's reports (>= lost objects)

    # --- serving -----------------------------------------------------------------------------

    def serve(self, token_ids: Sequence[int], now_s: float, decode_token_ids: Sequence[int] = ()) -> ServedRequest:
        page_num_tokens = self.geometry.page_num_tokens
        token_ids = list(token_ids)
        if len(token_ids) < 1:
            raise ValueError("empty request")
        keys = page_keys(token_ids[:-1], page_num_tokens)
        for _ in range(len(keys) + 2):  # each lost object is reported once, so this terminates
            lease = self.cache.begin_request(keys, now_s)
            try:
                self._apply(self.cache.drain_ops(), _Staged())
                match = lease.match
                c = match.num_reused_pages
                kv_pages, kv_read, checkpoint = self._restore(keys, match, token_ids)
                break
            except ObjectLost as lost:  # a storage fault becomes a miss: forget the object, match again
                self.cache.abort_request(lease)
                self._report_lost(keys, lost, now_s)
            except BaseException:
                self.cache.abort_request(lease)
                raise
        else:
            raise StoreMismatch("lost objects kept reappearing in the match")
        try:
            l3_hit = self.l3.read(keys, c, self.l3_codec, now_s) if self.l3 is not None else None
            resume_pages = l3_hit.end_page if l3_hit is not None else c
            if l3_hit is not None:
                kv_pages, checkpoint = kv_pages + l3_hit.kv_pages, l3_hit.checkpoint
            cache = restore_cache(self.runner.model, self.geometry, kv_pages, checkpoint)
            plan = tuple(self.cache.plan_checkpoints(lease, num_pages=len(keys)))
            captured_pages = plan if l3_hit is None else tuple(d for d in plan if d > resume_pages)
            prefill = self.runner.prefill(cache, token_ids, resume_pages * page_num_tokens,
                                          [d * page_num_tokens for d in captured_pages])
            fresh = kv_pages_from_cache(cache, self.geometry, c, len(keys) - c)
            decode_logits = self.runner.decode(cache, decode_token_ids)
        except BaseException:
            self.cache.abort_request(lease)
            raise
        staged = _Staged(
            kv={keys[c + i]: page for i, page in enumerate(fresh)},
            capture_index={keys[p // page_num_tokens - 1]: j for j, p in enumerate(prefill.captured.positions)},
            conv=prefill.captured.conv,
            ssm=prefill.captured.ssm,
        )
        reported = plan
        if l3_hit is not None:
            _stage_l3_state(staged, keys, l3_hit)
            reported = tuple(sorted({*captured_pages, l3_hit.end_page}))
        self.cache.finish_request(lease, keys, now_s, checkpoint_pages=reported)
        self._apply(self.cache.drain_ops(), staged)
        if self.l3 is not None:
            self._write_l3(keys, cache, now_s)
        page_bytes = self.geometry.kv_page_size_bytes
        return ServedRequest(
            num_input_tokens=len(token_ids),
            num_pages=len(keys),
            num_kv_pages=match.num_kv_pages,
            num_reused_pages=c,
            kv_pages_by_tier_at_match={t: b // page_bytes for t, b in match.kv_bytes_by_tier.items()},
            kv_pages_read_by_tier=dict(kv_read),
            checkpoint_tier=match.checkpoint_tier,
            planned_checkpoint_pages=reported,
            last_logits=prefill.last_logits,
            decode_logits=tuple(decode_logits),
            num_l3_pages=l3_hit.num_pages if l3_hit is not None else 0,
        )

    def _restore(self, keys: list, match, token_ids: list):
        """KV pages of [0, c) and the checkpoint at c, from whichever tier holds them."""
        c = match.num_reused_pages
        kv_pages, kv_read = [], Counter()
        for key in keys[:c]:
            tier, page = self._read_kv(key)
            kv_pages.append(page)
            kv_read[tier] += 1
        checkpoint = None
        if c:
            position = c * self.geometry.page_num_tokens
            checkpoint = self.checkpoint_stores[match.checkpoint_tier].checkpoint(keys[c - 1], position)
            if self.checkpoint_fault is not None:
                checkpoint = self.checkpoint_fault(token_ids, checkpoint)
        return kv_pages, kv_read, checkpoint

    def _report_lost(self, keys: list, lost: ObjectLost, now_s: float) -> None:
        """Forget the lost SSD object, and the copies a failed copy or move was to make from it."""
        depth = keys.index(lost.key) + 1
        kind = ItemKind.CHECKPOINT if lost.is_checkpoint else ItemKind.KV
        self.num_lost_objects += 1
        reported = [self.cache.report_lost(keys, depth, kind, tier, now_s) for tier in (*lost.also_in, Tier.SSD)]
        self.num_copies_forgotten += sum(reported)
        if not any(reported):
            raise StoreMismatch(f"the core does not hold the lost {kind.value} at page {depth}") from lost
        self._apply(self.cache.drain_ops(), _Staged())

    def _read_kv(self, key: PageKey) -> tuple[Tier, torch.Tensor]:
        for tier in (Tier.GPU, Tier.CPU, Tier.SSD):
            store = self.kv_stores[tier]
            if key in store:
                return tier, store.read(key)
        raise StoreMismatch(f"matched KV page {key.hex()} is in no tier")

    # --- the L3 tier's write path ------------------------------------------------------------

    def _write_l3(self, keys: list, cache, now_s: float) -> None:
        """Put this request's terminal bundle (the deepest checkpoint the core now holds on its path, and
        the KV before it) to L3. KV comes from the request's own cache, which holds exactly
        the bytes the tiers got; the state from the tier the core placed it in."""
        path, _, _ = self.cache.tree.walk(keys)
        holders = {node.depth_pages: node for node in path if node.ckpt_mask}
        self.l3.write_bundle(keys, sorted(holders), _shared_pages(path),
                             lambda n: kv_pages_from_cache(cache, self.geometry, 0, n),
                             lambda depth: self._packed_state(keys[depth - 1], holders[depth]), self.l3_codec,
                             now_s)

    def _packed_state(self, key: PageKey, node) -> torch.Tensor | None:
        """The packed checkpoint the core holds at `node`, or None when its only copy is a lost SSD
        object (the next request that needs it reports the loss; L3 just skips this bundle)."""
        try:
            return self.checkpoint_stores[fastest_tier(node.ckpt_mask)].read(key)
        except ObjectLost:
            return None

    # --- replaying the core's data movements -------------------------------------------------

    def _apply(self, ops: list[TierOp], staged: _Staged) -> None:
        """Replay the core's ops. A copy or move whose SSD source is gone is skipped and the rest still
        applied (the core already counts them), then the loss is raised for `serve` to report."""
        pending_gpu_puts: list[PageKey] = []
        lost, also_in = None, []
        for op in ops:
            self.op_counts[(op.action, op.kind.value, op.src, op.dst)] += 1
            if op.action == "put" and op.kind is ItemKind.CHECKPOINT and op.dst is Tier.GPU:
                pending_gpu_puts.append(op.page_keys[0])  # batched into one gather below
                continue
            self._flush_gpu_puts(pending_gpu_puts, staged)
            if op.action in ("move", "copy") and any((op.src, key) in self._unwritten for key in op.page_keys):
                # a copy onward from a copy that already failed (an SSD hit brought back through the
                # host): its destination stays empty too, and is reported with the loss
                op = self._skip_unwritten(op)
                also_in.append(op.dst)
                if not op.page_keys:
                    continue
            try:
                self._apply_one(op, staged)
            except ObjectLost as err:
                also_in.append(op.dst)
                self._unwritten.update((op.dst, key) for key in op.page_keys)
                lost = lost or err
        self._flush_gpu_puts(pending_gpu_puts, staged)
        if lost is not None:
            lost.also_in = tuple(dict.fromkeys(also_in))
            raise lost

    def _skip_unwritten(self, op: TierOp) -> TierOp:
        """`op` without the pages whose source a failed copy left empty; those stay empty at `op.dst`."""
        skipped = [key for key in op.page_keys if (op.src, key) in self._unwritten]
        for key in skipped:
            self._unwritten.add((op.dst, key))
            if op.action == "move":
                self._unwritten.discard((op.src, key))
        return replace(op, page_keys=tuple(k for k in op.page_keys if k not in set(skipped)))

    def _flush_gpu_puts(self, keys: list[PageKey], staged: _Staged) -> None:
        if keys:
            indices = [self._capture_index(staged, k) for k in keys]
            self.checkpoint_stores[Tier.GPU].write_captured(list(keys), staged.conv, staged.ssm, indices)
            keys.clear()

    def _capture_index(self, staged: _Staged, key: PageKey) -> int:
        try:
            return staged.capture_index[key]
        except KeyError:
            raise StoreMismatch(f"core put a checkpoint at {key.hex()} that this request did not capture") from None

    def _apply_one(self, op: TierOp, staged: _Staged) -> None:
        stores = self.kv_stores if op.kind is ItemKind.KV else self.checkpoint_stores
        if op.action == "put":
            for key in op.page_keys:
                stores[op.dst].write(key, self._staged_payload(op.kind, key, staged))
        elif op.action in ("move", "copy"):
            for key in op.page_keys:
                stores[op.dst].write(key, stores[op.src].read(key))
                if op.action == "move":
                    stores[op.src].delete(key)
        elif op.action == "drop":
            for key in op.page_keys:
                if (op.src, key) in self._unwritten:  # the copy that was to put it there failed
                    self._unwritten.discard((op.src, key))
                    continue
                stores[op.src].delete(key)
        else:
            raise StoreMismatch(f"unknown op action {op.action!r}")

    def _staged_payload(self, kind: ItemKind, key: PageKey, staged: _Staged) -> torch.Tensor:
        if kind is ItemKind.KV:
            try:
                return staged.kv[key]
            except KeyError:
                raise StoreMismatch(f"core put KV page {key.hex()} that this request did not compute") from None
        index = self._capture_index(staged, key)
        return pack_slot({"conv": staged.conv, "ssm": staged.ssm}, index, self.layout)

    # --- consistency with the core -----------------------------------------------------------

    def check_mirror(self) -> None:
        """The keys each store holds are exactly the core's placement, and the bytes match its ledger."""
        expected_kv = {t: set() for t in Tier}
        expected_ckpt = {t: set() for t in Tier}
        for node in self.cache.tree.iter_nodes():
            for t in Tier:
                if node.kv_mask & (1 << t):
                    expected_kv[t].update(node.keys)
                if node.ckpt_mask & (1 << t):
                    expected_ckpt[t].add(node.keys[-1])
        for t in Tier:
            held_kv, held_ckpt = set(self.kv_stores[t].keys()), set(self.checkpoint_stores[t].keys())
            if held_kv != expected_kv[t]:
                raise StoreMismatch(f"{t.name} KV: {len(held_kv - expected_kv[t])} pages held that the core does not "
                                    f"place there, {len(expected_kv[t] - held_kv)} placed but missing")
            if held_ckpt != expected_ckpt[t]:
                raise StoreMismatch(f"{t.name} checkpoints: {len(held_ckpt - expected_ckpt[t])} extra, "
                                    f"{len(expected_ckpt[t] - held_ckpt)} missing")
            used = sum(self.cache.ledger.used_bytes[p] for p in self.cache.ledger.pools_of_tier(t)
                       if p in self.cache.ledger.used_bytes)
            held = len(held_kv) * self.geometry.kv_page_size_bytes + len(held_ckpt) * self.geometry.checkpoint_size_bytes
            if used != held:
                raise StoreMismatch(f"{t.name}: ledger says {used} B, stores hold {held} B")

    def close(self) -> None:
        """Stop the SSD store's workers and release its directory."""
        self.kv_stores[Tier.SSD].store.close()


def _stage_l3_state(staged: _Staged, keys: list, hit: L3Hit) -> None:
    """Add the state L3 gave at `hit.end_page` to the request's captured states, as one more row of
    the capture buffers: a `put` of that checkpoint reads it like any state captured in the pass."""
    conv, ssm = hit.checkpoint.conv.unsqueeze(1), hit.checkpoint.ssm.unsqueeze(1)
    if staged.conv is not None and staged.conv.numel():
        conv = torch.cat([staged.conv, conv.to(staged.conv.device, staged.conv.dtype)], dim=1)
        ssm = torch.cat([staged.ssm, ssm.to(staged.ssm.device, staged.ssm.dtype)], dim=1)
    staged.capture_index[keys[hit.end_page - 1]] = conv.shape[1] - 1
    staged.conv, staged.ssm = conv, ssm


def _shared_pages(path: list) -> int:
    """Leading pages of the path that another branch of this worker's tree also goes through (the
    deepest fork on it): the prefix reached by more than one session, as far as this worker saw."""
    forks = [node.depth_pages for node in path if len(node.children) > 1]
    return max(forks, default=0)
