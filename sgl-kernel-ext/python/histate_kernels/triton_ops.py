"""Triton implementations of the state-capture kernels (CUDA only).

This module imports triton at the top and is itself imported only by `histate_kernels` dispatch when a
CUDA tensor arrives and triton is importable; a CPU-only install never loads it. Semantics are those of
`histate_kernels.reference`, which the GPU tests compare against (bit-exact: the kernels only move and
convert elements, with round-to-nearest-even like torch's `.to()`).

Status: written without a GPU in reach (the project's CPU CI cannot run them); `make test-gpu` runs
`test/reference/test_kernels.py -m gpu` on a CUDA machine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from histate_kernels.layout import CheckpointLayout
from histate_kernels.reference import check_gather_args, pool_for_region

_GATHER_BLOCK = 1024
_COPY_BLOCK = 1024
_MAX_GRID_YZ = 65535


@triton.jit
def _gather_state_rows_kernel(
    src_ptr,
    dst_ptr,
    src_index_ptr,
    dst_index_ptr,
    row_numel,
    src_layer_stride,
    src_row_stride,
    dst_layer_stride,
    dst_row_stride,
    BLOCK: tl.constexpr,
):
    # One program copies BLOCK elements of one (pair, layer) row: grid = (pairs, layers, row blocks).
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    block = tl.program_id(2)
    src_row = tl.load(src_index_ptr + pair).to(tl.int64)
    dst_row = tl.load(dst_index_ptr + pair).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    values = tl.load(src_ptr + layer * src_layer_stride + src_row * src_row_stride + offs, mask=mask)
    tl.store(
        dst_ptr + layer * dst_layer_stride + dst_row * dst_row_stride + offs,
        values.to(dst_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _copy_slot_rows_kernel(
    slot_ptr,
    packed_ptr,
    row_words,
    slot_layer_stride,
    UNPACK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # slot_ptr: one slot of a pool viewed as words, rows `slot_layer_stride` words apart;
    # packed_ptr: the region of the packed buffer, rows back to back. grid = (layers, row blocks).
    layer = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_words
    pool_p = slot_ptr + layer * slot_layer_stride + offs
    packed_p = packed_ptr + layer * row_words + offs
    if UNPACK:
        tl.store(pool_p, tl.load(packed_p, mask=mask), mask=mask)
    else:
        tl.store(packed_p, tl.load(pool_p, mask=mask), mask=mask)


def _rows_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def gather_states(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor) -> None:
    check_gather_args(src, src_index, dst, dst_index)
    if not (src.is_cuda and dst.is_cuda and src.device == dst.device):
        raise ValueError(f"triton gather needs src and dst on one CUDA device (got {src.device}, {dst.device})")
    if not _rows_contiguous(dst):
        raise ValueError("dst rows must be contiguous (a state pool slot); got strides " + str(dst.stride()))
    if not _rows_contiguous(src):
        src = src.contiguous()
    num_pairs = src_index.numel()
    if num_pairs == 0:
        return
    row_numel = 1
    for d in src.shape[2:]:
        row_numel *= d
    grid = (num_pairs, src.shape[0], triton.cdiv(row_numel, _GATHER_BLOCK))
    if grid[1] > _MAX_GRID_YZ or grid[2] > _MAX_GRID_YZ:
        raise ValueError(f"gather grid {grid} exceeds CUDA's y/z limit of {_MAX_GRID_YZ}")
    _gather_state_rows_kernel[grid](
        src, dst,
        src_index.to(device=dst.device, dtype=torch.int64).contiguous(),
        dst_index.to(device=dst.device, dtype=torch.int64).contiguous(),
        row_numel,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        BLOCK=_GATHER_BLOCK,
    )


def _word_dtype(*byte_counts: int) -> torch.dtype:
    # Copy in the widest word that divides every row size, stride and offset involved.
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if all(n % size == 0 for n in byte_counts):
            return dtype
    return torch.uint8


def _copy_slot(pools: dict[str, torch.Tensor], slot: int, layout: CheckpointLayout, packed: torch.Tensor,
               unpack: bool) -> None:
    layout.check_buffer(packed)
    for region in layout.regions:
        pool = pool_for_region(pools, region, slot)
        if not (pool.is_cuda and pool.device == packed.device):
            raise ValueError(f"pool {region.name!r} on {pool.device} and packed buffer on {packed.device}")
        if not _rows_contiguous(pool):
            raise ValueError(f"pool {region.name!r} rows must be contiguous; strides {pool.stride()}")
        itemsize = region.itemsize
        row_bytes = region.row_numel * itemsize
        word = _word_dtype(row_bytes, pool.stride(0) * itemsize, pool.stride(1) * itemsize,
                           pool.storage_offset() * itemsize, region.offset_bytes)
        word_size = torch.empty((), dtype=word).element_size()
        pool_words = pool.view(pool.shape[0], pool.shape[1], -1).view(word)
        slot_words = pool_words[:, slot]
        region_words = packed[region.offset_bytes : region.offset_bytes + region.size_bytes].view(word)
        row_words = row_bytes // word_size
        grid = (region.num_layers, triton.cdiv(row_words, _COPY_BLOCK))
        if grid[1] > _MAX_GRID_YZ:
            raise ValueError(f"pack grid {grid} exceeds CUDA's y limit of {_MAX_GRID_YZ}")
        _copy_slot_rows_kernel[grid](
            slot_words, region_words, row_words, slot_words.stride(0), UNPACK=unpack, BLOCK=_COPY_BLOCK
        )


def pack_slot(pools: dict[str, torch.Tensor], slot: int, layout: CheckpointLayout,
              out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.zeros(layout.size_bytes, dtype=torch.uint8, device=next(iter(pools.values())).device)
    _copy_slot(pools, slot, layout, out, unpack=False)
    return out


def unpack_slot(packed: torch.Tensor, layout: CheckpointLayout, pools: dict[str, torch.Tensor], slot: int) -> None:
    _copy_slot(pools, slot, layout, packed, unpack=True)
