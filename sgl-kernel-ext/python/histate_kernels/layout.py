"""Byte layout of one packed checkpoint.

A recurrent checkpoint lives in the state pools as one slot of several per-layer tensors (SGLang's
mamba pool: conv `[L, N_slots, conv_dim, kernel-1]` and temporal/ssm `[L, N_slots, H, d_k, d_v]`).
For one SSD write it is laid out contiguously: region after region, each region the slot's rows of
all layers in layer order, in the pool's own dtype (so a pack/unpack round trip is byte-exact).
Regions start at multiples of `REGION_ALIGN_BYTES`, which keeps every region's typed view aligned
for vector loads; padding bytes are zero so equal checkpoints pack to equal bytes (checksums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REGION_ALIGN_BYTES = 64


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    num_layers: int
    row_shape: tuple[int, ...]  # shape of one layer's slot (pool shape without the first two dims)
    dtype: torch.dtype
    offset_bytes: int

    @property
    def row_numel(self) -> int:
        n = 1
        for d in self.row_shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def size_bytes(self) -> int:
        return self.num_layers * self.row_numel * self.itemsize


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    regions: tuple[Region, ...]
    size_bytes: int

    @classmethod
    def for_pools(cls, pools: dict[str, torch.Tensor]) -> "CheckpointLayout":
        """Layout of one slot of each pool `[num_layers, num_slots, *row_shape]`, in dict order."""
        regions, offset = [], 0
        for name, pool in pools.items():
            if pool.dim() < 3:
                raise ValueError(f"pool {name!r} has shape {tuple(pool.shape)}; expected [num_layers, num_slots, ...]")
            region = Region(name, pool.shape[0], tuple(pool.shape[2:]), pool.dtype, offset)
            regions.append(region)
            offset = _round_up(offset + region.size_bytes, REGION_ALIGN_BYTES)
        return cls(tuple(regions), offset)

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no region {name!r} in checkpoint layout ({[r.name for r in self.regions]})")

    def view(self, packed: torch.Tensor, name: str) -> torch.Tensor:
        """Typed `[num_layers, *row_shape]` view of one region of a packed uint8 buffer (no copy)."""
        self.check_buffer(packed)
        r = self.region(name)
        flat = packed[r.offset_bytes : r.offset_bytes + r.size_bytes]
        return flat.view(r.dtype).view(r.num_layers, *r.row_shape)

    def check_buffer(self, packed: torch.Tensor) -> None:
        if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != self.size_bytes:
            raise ValueError(
                f"packed checkpoint must be a 1-D uint8 tensor of {self.size_bytes} bytes; "
                f"got {packed.dtype} {tuple(packed.shape)}"
            )
        if not packed.is_contiguous():
            raise ValueError("packed checkpoint buffer must be contiguous")


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
