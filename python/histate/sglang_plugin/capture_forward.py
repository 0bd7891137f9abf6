"""Several checkpoints inside one prefill forward pass: the model-runner side.

`capture.py` lists, per extend batch, the extra states to keep: (batch row, position relative to the
row's prefix, destination slot). The Gated-DeltaNet backend (`GDNAttnBackend`,
layers/attention/linear/gdn_backend.py) fills them from the same kernel call that computes the pass, the
way it fills SGLang's own track slot (hybrid_linear_attn_backend.py:445-535, 1019-1063):

  * conv window: the last `kernel - 1` pre-conv inputs before the position, copied from the layer's
    `mixed_qkv` before the causal conv runs (AROUND `_convolve_prefill`; SGLang's own conv tracking
    does the same copy in `forward_extend`, gdn_backend.py:1061-1068);
  * SSM state: a row of `h`, the extend kernel's per-sequence states, after the kernel ran (AROUND
    `_track_mamba_state_extend`, which reads SGLang's own row the same way, `h[track_ssm_h_src]`,
    hybrid_linear_attn_backend.py:1044-1051).

What `h` holds (SGLang 0.5.23; `HRows` describes it, `h_rows`/`h_index` compute it):

  * Triton (`TritonGDNKernel.extend` -> FLA's `chunk_gated_delta_rule_fwd_h`): the state ENTERING every
    64-token chunk of every sequence, sequence after sequence: ceil(len_i / 64) rows for sequence i, its
    row c the state after c * 64 tokens (kernels/ops/attention/fla/chunk_delta_h.py:23 CHUNK_SIZE = 64,
    :382-397 NT = number of chunks over all sequences, h = [B, NT, H, V, K]). It is returned on every
    extend and does NOT depend on the page size: SGLang indexes it for its own rows with the model's
    `mamba_chunk_size` (64), never with the cache grid (hybrid_linear_attn_backend.py:504-509,
    layers/attention/mamba/prefill_track_metadata.py:35-56).
  * FlashInfer (`FlashInferGDNKernel.extend`, gdn_flashinfer.py:481-596): the checkpoints a plan in
    the forward metadata asks for, and `h` is None without one (gdn_flashinfer.py:559-565, 595). A plan
    is (state_checkpoint_every_n_tokens N, state_checkpoint_cu_starts, num_state_checkpoints): sequence
    i has cu_starts[i+1] - cu_starts[i] = len_i // N rows, its row j the state AFTER (j + 1) * N tokens
    (FlashInfer's `chunk_gated_delta_rule` contract, flashinfer/gdn_prefill.py; N a multiple of 64).
    SGLang builds a plan only when its own tracked row needs `h` (`maybe_build_flashinfer_checkpoint_plan`,
    gdn_flashinfer.py:80-118, called from `GDNAttnBackend.init_forward_metadata`, gdn_backend.py:576-584,
    i.e. before this module's AFTER hook), and then N = `mamba_cache_chunk_size()` (gdn_flashinfer.py:92)
    = max(64, page) (arg_groups/overrides.py:1897-1925, runtime_context.py:1958-1963), and it rewrites
    its own `track_ssm_h_src` to that grid (gdn_flashinfer.py:99-111).

  Pages SGLang accepts with GDN and the extra-buffer cache: `max(64, page) % min(64, page) == 0`
  (overrides.py:1917-1921) and `mamba_track_interval % page == 0` (arg_groups/mamba_hook.py:134-135;
  default interval 256, arg_groups/fields/exec_.py:530-533): 1, 2, 4, 8, 16, 32, 64, 128, 256 by default,
  any multiple of 64 that divides a larger interval. So:

      page            Triton rows / spacing        FlashInfer, SGLang's plan    FlashInfer, no SGLang plan
      <= 64 (16, 32)  ceil(len/64), entering, 64   len // 64, after, N = 64     none: HiState builds one
      128             ceil(len/64), entering, 64   len // 128, after, N = 128   none: HiState builds one
      256             ceil(len/64), entering, 64   len // 256, after, N = 256   none: HiState builds one

  HiState's capture positions are multiples of lcm(64, mamba_cache_chunk_size()) from the pass start
  (`capture.capture_chunk_tokens`), hence always on SGLang's N grid. F1 (fixed here): the
  plugin used to assume FlashInfer rows every 64 tokens whatever plan was in the metadata; at page 128 or
  256, on the first pass whose deepest planned position was not its end (SGLang then tracks an interior
  position and builds its own N = page plan), `h` had len // page rows, not len // 64, and the forward
  raised, which takes SGLang's scheduler down.

This module therefore reads the rows from the plan actually in the metadata (`HRows.of_plan`), builds a
plan of its own only when SGLang did not (`ensure_checkpoint_plan`, on SGLang's grid), and replaces
SGLang's plan with a finer one only if a capture is off its grid (`refine_checkpoint_plan`, which also
moves SGLang's own `track_ssm_h_src` to the finer plan: SGLang reads its row of `h` through that index
and nothing else, hybrid_linear_attn_backend.py:1044-1051; `track_chunk_idx` only feeds snapshot kernels,
which no GDN kernel is, kernel_backend.py:24, gdn_backend.py:1167-1171).

Nothing here raises inside a forward (a raise there kills the server): a capture the pass cannot fill
is left out of the indices, before the kernel runs, with a warning. Each copy tells its `Capture` which
layer wrote it, and the cache inserts only captures every recurrent layer wrote (`Capture.filled`); a
capture left out is freed and counted 'unfilled' by `HiStateRadixCache.checkpoint`, never inserted.

The indices are built once per forward, in `init_forward_metadata` (AFTER hook), from CPU lists the
scheduler already has; the list reaches the backend on the ForwardBatch's declared field
(`capture.carrier_class`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Optional, Sequence

from .hooks import install_once

logger = logging.getLogger(__name__)

_GDN = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
_MAMBA_BASE = "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase"

TRITON, FLASHINFER = "triton", "flashinfer"
FLASHINFER_CHUNK = 64  # a FlashInfer plan's spacing must be a multiple of its 64-token chunk (gdn_prefill.py)


def h_rows(layout: str, extend_lens: Sequence[int], spacing: int) -> list:
    """Rows of `h` per sequence (module docstring): Triton keeps the state entering each `spacing`-token
    chunk (`spacing` = the kernel chunk, 64), FlashInfer the state after each whole `spacing` tokens
    (`spacing` = the plan's `state_checkpoint_every_n_tokens`)."""
    if layout == TRITON:
        return [(n + spacing - 1) // spacing for n in extend_lens]
    return [n // spacing for n in extend_lens]


def h_index(layout: str, offsets: Sequence[int], row: int, relative: int, spacing: int) -> int:
    """Row of `h` holding the state after `relative` tokens of sequence `row` (a multiple of `spacing`,
    0 < relative < its extend length); `offsets`: the running sum of `h_rows`."""
    return offsets[row] + relative // spacing - (1 if layout == FLASHINFER else 0)


@dataclass(frozen=True)
class HRows:
    """The rows of `h` one extend forward returns: sequence i's rows are offsets[i] .. offsets[i+1] - 1,
    one every `spacing` tokens (Triton: the first at 0 tokens; FlashInfer: the first after `spacing`)."""

    layout: str
    spacing: int
    offsets: tuple

    @property
    def num_rows(self) -> int:
        return self.offsets[-1]

    @classmethod
    def triton(cls, extend_lens: Sequence[int], chunk: int) -> "HRows":
        return cls(TRITON, chunk, tuple(accumulate(h_rows(TRITON, extend_lens, chunk), initial=0)))

    @classmethod
    def of_plan(cls, metadata: Any, extend_lens: Sequence[int]) -> Optional["HRows"]:
        """FlashInfer's rows under the checkpoint plan in `metadata` (SGLang's or HiState's); None without
        one. The per-sequence counts are FlashInfer's len // N, checked against num_state_checkpoints; a
        plan that does not follow it (no SGLang 0.5.23 code builds one) is read from its cu_starts (a
        device read, on that path only)."""
        total = int(getattr(metadata, "num_state_checkpoints", 0) or 0)
        spacing = int(getattr(metadata, "state_checkpoint_every_n_tokens", 0) or 0)
        if total <= 0 or spacing <= 0:
            return None
        offsets = tuple(accumulate(h_rows(FLASHINFER, extend_lens, spacing), initial=0))
        if offsets[-1] != total:
            cu_starts = getattr(metadata, "state_checkpoint_cu_starts", None)
            offsets = tuple(int(x) for x in cu_starts.tolist()) if cu_starts is not None else ()
            if len(offsets) != len(extend_lens) + 1 or offsets[-1] != total:
                return None
        return cls(FLASHINFER, spacing, offsets)

    def index(self, row: int, relative: int) -> Optional[int]:
        """Row of `h` with the state after `relative` tokens of sequence `row`; None if `h` has none."""
        if relative <= 0 or relative % self.spacing:
            return None
        index = h_index(self.layout, self.offsets, row, relative, self.spacing)
        return index if self.offsets[row] <= index < self.offsets[row + 1] else None


@dataclass
class CaptureIndices:
    """One forward's extra captures as index tensors on the backend's device."""

    h_src: Any  # [n] rows of h
    dst: Any  # [n] physical mamba slots
    conv_src: Any  # [n, kernel - 1] token rows of mixed_qkv
    num_h_rows: int  # rows h must have for this batch under the layout
    captures: tuple = ()  # the capture.Capture records, told which layers wrote them
    layer_id: Optional[int] = None  # the layer between its conv copy and its SSM copy (one forward_extend)


def build_indices(captures: Sequence[tuple], rows: HRows, extend_lens: Sequence[int], conv_len: int,
                  translate: Any, device: Any) -> CaptureIndices:
    """`captures`: (row, relative position, capture) per extra state, each one `rows` holds a row for
    (`select_captures`)."""
    import torch

    starts = list(accumulate(extend_lens, initial=0))
    h_src, conv_src, slots = [], [], []
    for row, relative, capture in captures:
        index = rows.index(row, relative)
        assert index is not None, (row, relative, rows)  # select_captures kept only these
        h_src.append(index)
        end = starts[row] + relative
        conv_src.append(list(range(end - conv_len, end)))
        slots.append(capture.slot.view(-1))
    dst = translate(torch.cat(slots).to(device=device, dtype=torch.int64))
    return CaptureIndices(torch.tensor(h_src, dtype=torch.int64, device=device), dst,
                          torch.tensor(conv_src, dtype=torch.int64, device=device), rows.num_rows,
                          tuple(capture for _, _, capture in captures))


def h_layout(backend: Any) -> str:
    """FlashInfer's checkpoint layout when the extend kernel uses state checkpoints, else Triton's."""
    return FLASHINFER if backend.kernel_dispatcher.extend_uses_state_checkpoints else TRITON


def _plan_fields(metadata: Any, extend_lens: Sequence[int], spacing: int, device: Any) -> list:
    import torch

    cu_starts = list(accumulate(h_rows(FLASHINFER, extend_lens, spacing), initial=0))
    metadata.state_checkpoint_cu_starts = torch.tensor(cu_starts, dtype=torch.int64, device=device)
    metadata.num_state_checkpoints = int(cu_starts[-1])
    metadata.state_checkpoint_every_n_tokens = spacing
    return cu_starts


def ensure_checkpoint_plan(metadata: Any, extend_lens: Sequence[int], spacing: int, device: Any) -> None:
    """Make a FlashInfer extend materialise its states every `spacing` tokens when no plan asks for any
    (SGLang builds one only for its own rows, gdn_flashinfer.py:80-118; same fields, same layout). A plan
    already there is left alone (`refine_checkpoint_plan` changes one); so is a plan of no rows, which
    FlashInfer refuses (a positive spacing needs a checkpoint buffer, and SGLang allocates none for zero
    rows, gdn_flashinfer.py:559-565)."""
    if getattr(metadata, "num_state_checkpoints", 0):
        return
    if sum(h_rows(FLASHINFER, extend_lens, spacing)) > 0:
        _plan_fields(metadata, extend_lens, spacing, device)


def refine_checkpoint_plan(metadata: Any, extend_lens: Sequence[int], spacing: int, device: Any) -> None:
    """Replace the plan in `metadata` (spacing N) by one every `spacing` tokens (N a multiple of it), moving
    SGLang's own `track_ssm_h_src` rows along: a row holding the state after k * N tokens of sequence i,
    cu_old[i] + k - 1, becomes cu_new[i] + k * (N / spacing) - 1 (gdn_flashinfer.py:103-106 builds the
    former). Computed on the device from the device tensors (no host sync)."""
    import torch

    old_spacing = int(metadata.state_checkpoint_every_n_tokens)
    if old_spacing == spacing:
        return
    assert old_spacing % spacing == 0, (old_spacing, spacing)
    old_cu = metadata.state_checkpoint_cu_starts
    src = getattr(metadata, "track_ssm_h_src", None)
    new_cu = _plan_fields(metadata, extend_lens, spacing, device)
    if src is not None and src.numel() > 0:
        old_cu = old_cu.to(device=src.device, dtype=torch.int64)
        new_cu = torch.tensor(new_cu, dtype=torch.int64, device=src.device)
        src = src.to(torch.int64)
        seq = torch.searchsorted(old_cu[1:].contiguous(), src, right=True)
        metadata.track_ssm_h_src = new_cu[seq] + (src - old_cu[seq] + 1) * (old_spacing // spacing) - 1


def _cache_grid(kernel_chunk: int) -> int:
    """SGLang's checkpoint spacing for its own FlashInfer plans, `mamba_cache_chunk_size()`."""
    try:
        from sglang.srt.runtime_context import mamba_cache_chunk_size

        return int(mamba_cache_chunk_size())
    except Exception:  # no published server args (a unit test of the backend alone)
        return kernel_chunk


def select_captures(backend: Any, metadata: Any, captures: Sequence[tuple], extend_lens: Sequence[int]) -> tuple:
    """(HRows, the captures `h` will hold a row for, the others with why). For FlashInfer, first makes
    the plan in `metadata` hold every capture on the kernel's chunk grid (module docstring)."""
    kernel_chunk = int(backend.mamba_chunk_size)
    layout = h_layout(backend)
    step = kernel_chunk if layout == TRITON else math.lcm(kernel_chunk, FLASHINFER_CHUNK)
    kept, dropped = [], []
    for row, relative, capture in captures:
        if 0 < relative < extend_lens[row] and relative % step == 0:
            kept.append((row, relative, capture))
        else:
            dropped.append((row, relative, capture, f"not an interior {step}-token boundary of a pass of "
                                                     f"{extend_lens[row]} tokens"))
    if layout == TRITON:
        rows = HRows.triton(extend_lens, kernel_chunk)
    else:
        relatives = [relative for _, relative, _ in kept]
        if kept and getattr(metadata, "num_state_checkpoints", 0):  # SGLang's own plan (its tracked row)
            existing = int(metadata.state_checkpoint_every_n_tokens)
            finer = math.gcd(existing, *relatives)
            if finer != existing and finer % FLASHINFER_CHUNK == 0 and HRows.of_plan(metadata, extend_lens):
                refine_checkpoint_plan(metadata, extend_lens, finer, backend.device)
        elif kept:
            ensure_checkpoint_plan(metadata, extend_lens, math.gcd(_cache_grid(kernel_chunk), *relatives),
                                   backend.device)
        rows = HRows.of_plan(metadata, extend_lens)
    held = []
    for row, relative, capture in kept:
        if rows is not None and rows.index(row, relative) is not None:
            held.append((row, relative, capture))
        else:
            dropped.append((row, relative, capture, f"the kernel's rows ({rows}) hold no state there"))
    return rows, held, dropped


def _drop(captures: Sequence[tuple], why: str) -> None:
    """Leave captures unfilled (the cache frees and counts them, `HiStateRadixCache.checkpoint`)."""
    if captures:
        logger.warning("HiState: %d in-pass capture(s) left out of this forward (%s): %s", len(captures), why,
                       [(row, relative) for row, relative, *_ in captures])


def init_forward_metadata_after(result: Any, backend: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from .capture import CARRIER_FIELD

    metadata = backend.forward_metadata
    captures = getattr(forward_batch, CARRIER_FIELD, None)
    metadata._hs_capture = None
    if not captures or backend.is_draft_worker:  # a draft model's pool is not the one the slots belong to
        return result
    # Cannot happen (capture.py lists captures on extend passes it tracks in); a raise here would take
    # the server down, so such captures are only left unfilled.
    if forward_batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED):
        _drop(captures, f"a {forward_batch.forward_mode.name} forward")
        return result
    if getattr(forward_batch, "tbo_parent_token_range", None) is not None:
        _drop(captures, "a two-batch-overlap split: rows are per parent batch")
        return result
    if not metadata.has_mamba_track_mask:  # SGLang then never calls `_track_mamba_state_extend`
        _drop(captures, "a pass SGLang tracks nothing in")
        return result
    if forward_batch.extend_seq_lens_cpu is None:
        _drop(captures, "no host extend lengths")
        return result
    extend_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    rows, held, dropped = select_captures(backend, metadata, captures, extend_lens)
    for reason in sorted({why for *_, why in dropped}):
        _drop([d for d in dropped if d[3] == reason], reason)
    if held:
        metadata._hs_capture = build_indices(held, rows, extend_lens, backend.conv_states_shape[-1],
                                             backend._translate_mamba_indices, backend.device)
    return result


CAPTURING_KERNELS = ("TritonGDNKernel", "FlashInferGDNKernel")  # extend kernels that return per-chunk states


def check_extend_kernel(result: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER `GDNAttnBackend.__init__`: refuse, at model load, an extend kernel that returns no per-chunk
    states (SGLang's CuTe DSL prefill on SM10x returns h = None, gdn_cutedsl.py): HiState could not fill
    its capture slots, and a pass must never insert a state it did not compute."""
    kernel = type(backend.kernel_dispatcher.extend_kernel).__name__
    if kernel not in CAPTURING_KERNELS:
        raise RuntimeError(f"--enable-histate: the GDN prefill kernel {kernel} returns no per-chunk states, which "
                           f"HiState's in-pass checkpoint capture reads; use --linear-attn-prefill-backend triton "
                           f"or flashinfer")
    return result


def convolve_prefill_around(original: Any, backend: Any, layer: Any, forward_batch: Any, mixed_qkv: Any,
                            *args: Any, **kwargs: Any) -> Any:
    indices: Optional[CaptureIndices] = getattr(backend.forward_metadata, "_hs_capture", None)
    if indices is not None:
        conv = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id).conv[0]
        conv[indices.dst] = mixed_qkv[indices.conv_src].transpose(1, 2).to(conv.dtype)
        for capture in indices.captures:
            capture.conv_layers.add(layer.layer_id)
        indices.layer_id = layer.layer_id
    return original(backend, layer, forward_batch, mixed_qkv, *args, **kwargs)


def track_extend_around(original: Any, backend: Any, forward_batch: Any, h: Any, ssm_states: Any,
                        forward_metadata: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(backend, forward_batch, h, ssm_states, forward_metadata, *args, **kwargs)
    indices: Optional[CaptureIndices] = getattr(forward_metadata, "_hs_capture", None)
    if indices is not None:
        rows = None if h is None else h.squeeze(0)
        if rows is None or rows.shape[0] != indices.num_h_rows:
            # A wrong state is worse than a lost one, and a raise here would take the server down: this
            # layer writes no SSM state, so the captures stay unfilled and are never inserted.
            logger.error("HiState: the extend kernel returned %s per-chunk states, not the %d the plan has; "
                         "this pass's %d in-pass capture(s) are dropped", None if rows is None else rows.shape[0],
                         indices.num_h_rows, len(indices.captures))
        else:
            ssm_states[indices.dst] = rows[indices.h_src].to(ssm_states.dtype, copy=False)
            if indices.layer_id is not None:  # the layer whose conv window this forward_extend copied
                for capture in indices.captures:
                    capture.ssm_layers.add(indices.layer_id)
        indices.layer_id = None
    return result


def install_forward_hooks() -> None:
    """Register the backend hooks (once per process; the scheduler's, which runs the model)."""
    install_once("capture_forward", [
        (f"{_GDN}.__init__", check_extend_kernel, "AFTER"),
        (f"{_GDN}.init_forward_metadata", init_forward_metadata_after, "AFTER"),
        (f"{_GDN}._convolve_prefill", convolve_prefill_around, "AROUND"),
        (f"{_MAMBA_BASE}._track_mamba_state_extend", track_extend_around, "AROUND"),
    ])
