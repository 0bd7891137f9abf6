"""Where the executor's bytes live: one store per (tier, kind), all keyed by prefix-chained page keys.

                 KV page (one per key)                   checkpoint (one per key, at the page's end)
  GPU   dict of tensors on the compute device      slots of a state pool  [layers, slots, ...]
  CPU   dict of tensors (pinned under CUDA)        packed uint8 buffers   (CheckpointLayout)
  SSD   one object per page in the SSD store       one packed object per checkpoint (one write)

Every store speaks one transfer form per kind -- a KV page tensor, or a packed checkpoint (uint8) --
so a core `move`/`copy` is `dst.write(key, src.read(key))`. The GPU checkpoint pool additionally
takes states straight from an in-prefill capture buffer (`gather_states`, the sgl-kernel-ext path)
and hands out slot views for restore without a copy. Missing or duplicate keys raise
`StoreMismatch`: the executor's bytes must mirror the core's decisions exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from histate_kernels import CheckpointLayout, gather_states, pack_slot, unpack_slot

from histate.reference.hybrid_cache import Checkpoint
from histate.reference.model import StateGeometry
from histate.reference.page_keys import PageKey, key_name
from histate.reference.ssd import SsdObjects


class ObjectLost(RuntimeError):
    """An SSD object the core counts on is missing or corrupt: a storage fault, which the executor
    reports to the core (`report_lost`) so that the request is served as a miss instead."""

    def __init__(self, message: str, key: PageKey, is_checkpoint: bool):
        super().__init__(message)
        self.key = key
        self.is_checkpoint = is_checkpoint
        self.also_in: tuple = ()  # tiers a failed copy or move was to fill: the core counts it there too


class StoreMismatch(RuntimeError):
    """The executor's stores disagree with an op or a match the core reported."""


class KvPageStore:
    """KV pages in memory (GPU or CPU tier)."""

    def __init__(self, tier_name: str, device: torch.device, pin: bool = False):
        self.tier_name = tier_name
        self.device = device
        self.pin = pin
        self.pages: dict[PageKey, torch.Tensor] = {}

    def __contains__(self, key: PageKey) -> bool:
        return key in self.pages

    def keys(self) -> Iterable[PageKey]:
        return self.pages.keys()

    def write(self, key: PageKey, page: torch.Tensor) -> None:
        if key in self.pages:
            raise StoreMismatch(f"{self.tier_name} KV already holds page {key_name(key)}")
        page = page.to(self.device, copy=True)
        self.pages[key] = page.pin_memory() if self.pin else page

    def read(self, key: PageKey) -> torch.Tensor:
        try:
            return self.pages[key]
        except KeyError:
            raise StoreMismatch(f"{self.tier_name} KV has no page {key_name(key)}") from None

    def delete(self, key: PageKey) -> None:
        if self.pages.pop(key, None) is None:
            raise StoreMismatch(f"{self.tier_name} KV cannot drop missing page {key_name(key)}")


class _SsdNamedObjects:
    """Items kept as named objects in the SSD object store; subclasses say how an item becomes bytes.
    A missing or corrupt object raises ObjectLost (a storage fault the executor turns into a miss);
    any other disagreement with the core raises StoreMismatch."""

    tier_name = "SSD"
    prefix = ""
    what = ""
    is_checkpoint = False

    def __init__(self, store: SsdObjects):
        self.store = store
        self.names: set[PageKey] = set()

    def __contains__(self, key: PageKey) -> bool:
        return key in self.names

    def keys(self) -> Iterable[PageKey]:
        return self.names

    def _name(self, key: PageKey) -> str:
        return f"{self.prefix}-{key_name(key)}"

    def write(self, key: PageKey, item: torch.Tensor) -> None:
        if key in self.names:
            raise StoreMismatch(f"SSD {self.what} store already holds {key_name(key)}")
        self.store.put(self._name(key), self._encode(item))
        self.names.add(key)

    def read(self, key: PageKey) -> torch.Tensor:
        if key not in self.names:
            raise StoreMismatch(f"SSD {self.what} store has no {key_name(key)}")
        raw = self.store.get(self._name(key))
        if raw is None:
            raise ObjectLost(f"SSD object for {self.what} {key_name(key)} is missing or corrupt", key,
                             self.is_checkpoint)
        return self._decode(raw)

    def delete(self, key: PageKey) -> None:
        if key not in self.names:
            raise StoreMismatch(f"SSD {self.what} store cannot drop missing {key_name(key)}")
        self.store.delete(self._name(key))
        self.names.discard(key)


class SsdKvPageStore(_SsdNamedObjects):
    """KV pages as raw bytes in the SSD object store (one object per page)."""

    prefix, what = "kv", "KV page"

    def __init__(self, store: SsdObjects, geometry: StateGeometry):
        super().__init__(store)
        self.geometry = geometry

    def _encode(self, page: torch.Tensor) -> torch.Tensor:
        return page.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)

    def _decode(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.view(self.geometry.kv_dtype).reshape(self.geometry.kv_page_shape)


def checkpoint_from_packed(packed: torch.Tensor, layout: CheckpointLayout, position: int) -> Checkpoint:
    return Checkpoint(position, layout.view(packed, "conv"), layout.view(packed, "ssm"))


class GpuCheckpointPool:
    """Checkpoints in the GPU tier: slots of a conv pool and an ssm pool (SGLang's mamba pool shape)."""

    tier_name = "GPU"

    def __init__(self, geometry: StateGeometry, num_slots: int, device: torch.device):
        n_lin = len(geometry.linear_layer_ids)
        self.pools = {
            "conv": torch.zeros((n_lin, num_slots, *geometry.conv_shape[1:]), dtype=geometry.conv_dtype, device=device),
            "ssm": torch.zeros((n_lin, num_slots, *geometry.ssm_shape[1:]), dtype=geometry.ssm_dtype, device=device),
        }
        self.layout = CheckpointLayout.for_pools(self.pools)
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.slot_of: dict[PageKey, int] = {}

    def __contains__(self, key: PageKey) -> bool:
        return key in self.slot_of

    def keys(self) -> Iterable[PageKey]:
        return self.slot_of.keys()

    def _allocate(self, key: PageKey) -> int:
        if key in self.slot_of:
            raise StoreMismatch(f"GPU checkpoint pool already holds {key_name(key)}")
        if not self.free_slots:
            raise StoreMismatch("GPU checkpoint pool is out of slots: the core placed more checkpoints than fit")
        slot = self.free_slots.pop()
        self.slot_of[key] = slot
        return slot

    def write_captured(self, keys: list[PageKey], conv: torch.Tensor, ssm: torch.Tensor, indices: list[int]) -> None:
        """Gather captured states `[layers, n, ...]` (rows `indices`) into fresh slots, one per key."""
        slots = [self._allocate(k) for k in keys]
        device = self.pools["ssm"].device
        src = torch.tensor(indices, dtype=torch.int64, device=device)
        dst = torch.tensor(slots, dtype=torch.int64, device=device)
        gather_states(conv.to(device), src, self.pools["conv"], dst)
        gather_states(ssm.to(device), src, self.pools["ssm"], dst)

    def write(self, key: PageKey, packed: torch.Tensor) -> None:
        slot = self._allocate(key)
        unpack_slot(packed.to(self.pools["ssm"].device), self.layout, self.pools, slot)

    def read(self, key: PageKey) -> torch.Tensor:
        return pack_slot(self.pools, self._slot(key), self.layout)

    def checkpoint(self, key: PageKey, position: int) -> Checkpoint:
        slot = self._slot(key)
        return Checkpoint(position, self.pools["conv"][:, slot], self.pools["ssm"][:, slot])

    def delete(self, key: PageKey) -> None:
        self.free_slots.append(self._slot(key))
        del self.slot_of[key]

    def _slot(self, key: PageKey) -> int:
        try:
            return self.slot_of[key]
        except KeyError:
            raise StoreMismatch(f"GPU checkpoint pool has no {key_name(key)}") from None


class PackedCheckpointStore:
    """Checkpoints in the CPU tier: packed uint8 buffers."""

    tier_name = "CPU"

    def __init__(self, layout: CheckpointLayout, pin: bool = False):
        self.layout = layout
        self.pin = pin
        self.buffers: dict[PageKey, torch.Tensor] = {}

    def __contains__(self, key: PageKey) -> bool:
        return key in self.buffers

    def keys(self) -> Iterable[PageKey]:
        return self.buffers.keys()

    def write(self, key: PageKey, packed: torch.Tensor) -> None:
        if key in self.buffers:
            raise StoreMismatch(f"CPU checkpoint store already holds {key_name(key)}")
        self.layout.check_buffer(packed)
        packed = packed.to("cpu", copy=True)
        self.buffers[key] = packed.pin_memory() if self.pin else packed

    def read(self, key: PageKey) -> torch.Tensor:
        try:
            return self.buffers[key]
        except KeyError:
            raise StoreMismatch(f"CPU checkpoint store has no {key_name(key)}") from None

    def checkpoint(self, key: PageKey, position: int) -> Checkpoint:
        return checkpoint_from_packed(self.read(key), self.layout, position)

    def delete(self, key: PageKey) -> None:
        if self.buffers.pop(key, None) is None:
            raise StoreMismatch(f"CPU checkpoint store cannot drop missing {key_name(key)}")


class SsdCheckpointStore(_SsdNamedObjects):
    """Checkpoints on SSD: one packed object each, written and read with one I/O."""

    prefix, what, is_checkpoint = "ckpt", "checkpoint", True

    def __init__(self, store: SsdObjects, layout: CheckpointLayout):
        super().__init__(store)
        self.layout = layout

    def _encode(self, packed: torch.Tensor) -> torch.Tensor:
        self.layout.check_buffer(packed)
        return packed.to("cpu")

    def _decode(self, raw: torch.Tensor) -> torch.Tensor:
        return raw

    def checkpoint(self, key: PageKey, position: int) -> Checkpoint:
        return checkpoint_from_packed(self.read(key), self.layout, position)
