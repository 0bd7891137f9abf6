"""Several checkpoints inside one prefill forward pass: the model-runner side.

`capture.py` lists, per extend batch, the extra states to keep: (batch row, position relative to the
row's prefix, destination slot). The Gated-DeltaNet backend (`GDNAttnBackend`,
layers/attention/linear/gdn_backend.py) fills them from the same kernel call that computes the pass, the
way it fills SGLang's own track slot (hybrid_linear_attn_backend.py:413-530, 1019-1063):

  * conv window: the last `kernel - 1` pre-conv inputs before the position, copied from the layer's
    `mixed_qkv` before the causal conv runs (AROUND `_convolve_prefill`; SGLang's own conv tracking
    does the same copy in `forward_extend`);
  * SSM state: row `h[src]` of the kernel's per-chunk states, after the kernel ran (AROUND
    `_track_mamba_state_extend`). The rows of `h` depend on the kernel (`h_layout`): Triton keeps the
    state at the start of every 64-token chunk of every sequence (ceil(len / 64) rows each), FlashInfer
    the state after every whole chunk (floor(len / 64) rows each) and only when a checkpoint plan asks
    for them (`maybe_build_flashinfer_checkpoint_plan`), which `init_forward_metadata_after` builds
    when SGLang's own rows did not.

The indices are built once per forward, in `init_forward_metadata` (AFTER hook), from CPU lists the
scheduler already has; the list reaches the backend on the ForwardBatch's declared field
(`capture.carrier_class`). Each copy tells its `Capture` which layer wrote it, and the cache inserts
only captures every recurrent layer wrote (`Capture.filled`). A kernel whose `h` does not have the rows the layout promises is an error, never
a silent wrong state: the pass is refused with a RuntimeError before any slot is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Optional, Sequence

from .hooks import install_once

_GDN = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
_MAMBA_BASE = "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase"

TRITON, FLASHINFER = "triton", "flashinfer"


def h_rows(layout: str, extend_lens: Sequence[int], chunk: int) -> list:
    """Rows of `h` per sequence: Triton keeps the state entering each chunk, FlashInfer the state after
    each whole chunk."""
    if layout == TRITON:
        return [(n + chunk - 1) // chunk for n in extend_lens]
    return [n // chunk for n in extend_lens]


def h_index(layout: str, offsets: Sequence[int], row: int, relative: int, chunk: int) -> int:
    """Row of `h` holding the state after `relative` tokens of sequence `row` (a multiple of `chunk`,
    0 < relative < its extend length)."""
    return offsets[row] + relative // chunk - (1 if layout == FLASHINFER else 0)


@dataclass
class CaptureIndices:
    """One forward's extra captures as index tensors on the backend's device."""

    h_src: Any  # [n] rows of h
    dst: Any  # [n] physical mamba slots
    conv_src: Any  # [n, kernel - 1] token rows of mixed_qkv
    num_h_rows: int  # rows h must have for this batch under the layout
    captures: tuple = ()  # the capture.Capture records, told which layers wrote them
    layer_id: Optional[int] = None  # the layer between its conv copy and its SSM copy (one forward_extend)


def build_indices(captures: Sequence[tuple], extend_lens: Sequence[int], chunk: int, conv_len: int, layout: str,
                  translate: Any, device: Any) -> CaptureIndices:
    """`captures`: (row, relative position, slot tensor) per extra state (module docstring)."""
    import torch

    rows_per_seq = h_rows(layout, extend_lens, chunk)
    offsets = list(accumulate(rows_per_seq, initial=0))
    starts = list(accumulate(extend_lens, initial=0))
    h_src, conv_src, slots = [], [], []
    for row, relative, capture in captures:
        if relative % chunk or not 0 < relative < extend_lens[row]:
            raise RuntimeError(f"HiState capture at {relative} tokens into a pass of {extend_lens[row]} "
                               f"tokens is not an interior boundary of its {chunk}-token chunks")
        h_src.append(h_index(layout, offsets, row, relative, chunk))
        end = starts[row] + relative
        conv_src.append(list(range(end - conv_len, end)))
        slots.append(capture.slot.view(-1))
    dst = translate(torch.cat(slots).to(device=device, dtype=torch.int64))
    return CaptureIndices(torch.tensor(h_src, dtype=torch.int64, device=device), dst,
                          torch.tensor(conv_src, dtype=torch.int64, device=device), offsets[-1],
                          tuple(capture for _, _, capture in captures))


def h_layout(backend: Any) -> str:
    """FlashInfer's checkpoint layout when the extend kernel uses state checkpoints, else Triton's."""
    return FLASHINFER if backend.kernel_dispatcher.extend_uses_state_checkpoints else TRITON


def ensure_checkpoint_plan(metadata: Any, extend_lens: Sequence[int], chunk: int, device: Any) -> None:
    """Make a FlashInfer extend materialise its per-chunk states (the plan SGLang builds only when its
    own track rows need one, gdn_flashinfer.py:80-118; same fields, same layout)."""
    import torch

    if getattr(metadata, "num_state_checkpoints", 0):
        return
    counts = [n // chunk for n in extend_lens]
    cu_starts = list(accumulate(counts, initial=0))
    metadata.state_checkpoint_cu_starts = torch.tensor(cu_starts, dtype=torch.int64, device=device)
    metadata.num_state_checkpoints = int(cu_starts[-1])
    metadata.state_checkpoint_every_n_tokens = chunk


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


def init_forward_metadata_after(result: Any, backend: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from .capture import CARRIER_FIELD

    metadata = backend.forward_metadata
    captures = getattr(forward_batch, CARRIER_FIELD, None)
    metadata._hs_capture = None
    if not captures or backend.is_draft_worker:  # a draft model's pool is not the one the slots belong to
        return result
    # The scheduler inserts these slots after the pass: a pass that could not fill them must fail.
    if forward_batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED):
        raise RuntimeError(f"HiState: extra captures in a {forward_batch.forward_mode.name} forward")
    if getattr(forward_batch, "tbo_parent_token_range", None) is not None:
        raise RuntimeError("HiState: extra captures in a two-batch-overlap split (rows are per parent batch)")
    if not metadata.has_mamba_track_mask:  # capture.py tracks the deepest planned position of every such pass
        raise RuntimeError("HiState: extra captures in a pass SGLang tracks nothing in")
    extend_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    chunk = int(backend.mamba_chunk_size)
    layout = h_layout(backend)
    if layout == FLASHINFER:
        ensure_checkpoint_plan(metadata, extend_lens, chunk, backend.device)
    metadata._hs_capture = build_indices(captures, extend_lens, chunk, backend.conv_states_shape[-1], layout,
                                         backend._translate_mamba_indices, backend.device)
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
            raise RuntimeError(
                f"HiState: the extend kernel returned {None if rows is None else rows.shape[0]} per-chunk states, "
                f"not the {indices.num_h_rows} its layout has; refusing to capture (a wrong state is worse "
                f"than a failed pass)")
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
