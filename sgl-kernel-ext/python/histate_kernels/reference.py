"""Torch reference of the state-capture kernels; runs on any device and defines their semantics.

gather_states:  dst[l, dst_index[i]] = src[l, src_index[i]].to(dst.dtype)   for every layer l, pair i
pack_slot:      packed <- slot `slot` of every pool, laid out by `CheckpointLayout`
unpack_slot:    slot `slot` of every pool <- packed (the restore path; inverse of pack_slot)
"""

from __future__ import annotations

import torch

from histate_kernels.layout import CheckpointLayout, Region


def check_gather_args(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor) -> None:
    """Shared argument validation (the Triton path uses it too): bad indices must raise, never scribble."""
    if src.dim() < 3 or dst.dim() < 3:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be [num_layers, num_rows, ...]")
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ outside the row dimension")
    if src_index.dim() != 1 or src_index.shape != dst_index.shape:
        raise ValueError(f"src_index {tuple(src_index.shape)} and dst_index {tuple(dst_index.shape)} must be equal 1-D")
    if src_index.dtype not in (torch.int32, torch.int64) or dst_index.dtype not in (torch.int32, torch.int64):
        raise ValueError("indices must be int32 or int64")
    if src_index.numel() == 0:
        return
    if int(src_index.min()) < 0 or int(src_index.max()) >= src.shape[1]:
        raise IndexError(f"src_index out of range [0, {src.shape[1]})")
    if int(dst_index.min()) < 0 or int(dst_index.max()) >= dst.shape[1]:
        raise IndexError(f"dst_index out of range [0, {dst.shape[1]})")
    if torch.unique(dst_index).numel() != dst_index.numel():
        raise ValueError("dst_index has duplicates: two sources would race for one slot")


def gather_states(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor) -> None:
    check_gather_args(src, src_index, dst, dst_index)
    if src_index.numel():
        dst[:, dst_index.long()] = src[:, src_index.long()].to(dst.dtype)


def pack_slot(pools: dict[str, torch.Tensor], slot: int, layout: CheckpointLayout, out: torch.Tensor | None = None) -> torch.Tensor:
    out = _packed_buffer(layout, out, next(iter(pools.values())).device)
    for region in layout.regions:
        pool = pool_for_region(pools, region, slot)
        layout.view(out, region.name).copy_(pool[:, slot])
    return out


def unpack_slot(packed: torch.Tensor, layout: CheckpointLayout, pools: dict[str, torch.Tensor], slot: int) -> None:
    layout.check_buffer(packed)
    for region in layout.regions:
        pool = pool_for_region(pools, region, slot)
        pool[:, slot].copy_(layout.view(packed, region.name))


def _packed_buffer(layout: CheckpointLayout, out: torch.Tensor | None, device) -> torch.Tensor:
    if out is None:
        return torch.zeros(layout.size_bytes, dtype=torch.uint8, device=device)
    layout.check_buffer(out)
    return out


def pool_for_region(pools: dict[str, torch.Tensor], region: Region, slot: int) -> torch.Tensor:
    """The pool a layout region describes, checked against it (shared with the Triton path)."""
    if region.name not in pools:
        raise KeyError(f"layout region {region.name!r} has no pool (pools: {sorted(pools)})")
    pool = pools[region.name]
    if pool.dtype != region.dtype or pool.shape[0] != region.num_layers or tuple(pool.shape[2:]) != region.row_shape:
        raise ValueError(
            f"pool {region.name!r} is {pool.dtype} {tuple(pool.shape)}; the layout expects {region.dtype} "
            f"[{region.num_layers}, *, {', '.join(map(str, region.row_shape))}]"
        )
    if not 0 <= slot < pool.shape[1]:
        raise IndexError(f"slot {slot} out of range [0, {pool.shape[1]}) for pool {region.name!r}")
    return pool
