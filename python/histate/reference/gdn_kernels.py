"""Run transformers' Qwen3.5 GDN layers on this package's torch kernels, optionally capturing states.

transformers resolves its GDN kernels (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn`, `causal_conv1d_update`) as module globals of `modeling_qwen3_5`, preferring fla /
causal-conv1d when importable (which breaks on a CPU host that has triton). While `gdn_kernels(...)`
is active those globals point at:

* `histate.reference.gdr` kernels in a chosen compute dtype (float64 = exact reference mode);
* transformers' own torch conv fallbacks (`__wrapped__`), whatever optional packages are installed;
* and, for one prefill call, recorders that keep the recurrent state and the conv window (the last
  kernel-1 pre-conv inputs) at each requested absolute position -- a complete checkpoint per position,
  produced by the same forward pass that computes the logits.

The swap is process-global (module attributes), so it refuses to nest. Layers are identified by call
order: the GDN layers run in layer order, once each per forward.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from histate.reference.gdr import GDN_CHUNK_NUM_TOKENS, chunk_gated_delta_rule, recurrent_gated_delta_rule

_SWAP_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class CapturedStates:
    """Checkpoints taken inside one prefill, stacked over GDN layers (batch row 0).

    positions: absolute token positions, ascending (a checkpoint at p is the state after tokens [0, p)).
    conv:      `[num_linear_layers, len(positions), conv_dim, kernel-1]` in the model dtype.
    ssm:       `[num_linear_layers, len(positions), num_v_heads, d_k, d_v]` in the compute dtype.
    """

    positions: tuple[int, ...]
    conv: torch.Tensor
    ssm: torch.Tensor


class _Recorder:
    def __init__(self, start_position: int, num_new_tokens: int, capture_positions: Sequence[int]):
        self.start_position = start_position
        self.num_new_tokens = num_new_tokens
        self.positions = tuple(sorted(set(int(p) for p in capture_positions)))
        self.relative = [p - start_position for p in self.positions]
        self.conv_windows: list[torch.Tensor] = []
        self.ssm_states: list[torch.Tensor] = []

    def record_conv(self, pre_conv: torch.Tensor, kernel_size: int) -> None:
        # pre_conv: [B, C, num_previous + num_new_tokens]; num_previous = cached conv columns (0 on a
        # fresh prefill). The conv state at relative position p is the kernel-1 inputs before p.
        num_previous = pre_conv.shape[-1] - self.num_new_tokens
        keep = kernel_size - 1
        windows = []
        for p in self.relative:
            end = num_previous + p
            window = pre_conv[..., max(0, end - keep) : end]
            if window.shape[-1] < keep:
                window = F.pad(window, (keep - window.shape[-1], 0))
            windows.append(window)
        self.conv_windows.append(torch.stack(windows, dim=1) if windows else pre_conv.new_empty(0))

    def result(self, num_linear_layers: int) -> CapturedStates:
        if len(self.ssm_states) != num_linear_layers or len(self.conv_windows) != num_linear_layers:
            raise RuntimeError(
                f"state capture saw {len(self.ssm_states)} GDN kernel calls and {len(self.conv_windows)} conv calls "
                f"for {num_linear_layers} GDN layers: capture must wrap exactly one prefill forward"
            )
        if not self.positions:
            empty = torch.empty(0)
            return CapturedStates((), empty, empty)
        conv = torch.stack([w[0] for w in self.conv_windows], dim=0)
        ssm = torch.stack([s[0] for s in self.ssm_states], dim=0)
        return CapturedStates(self.positions, conv.contiguous(), ssm.contiguous())


def _modeling_module():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


@contextlib.contextmanager
def gdn_kernels(
    compute_dtype: torch.dtype,
    *,
    start_position: int = 0,
    num_new_tokens: int | None = None,
    capture_positions: Sequence[int] = (),
) -> Iterator[_Recorder | None]:
    """Swap the GDN kernels for the duration of the block; capture states when positions are given.

    With `capture_positions`, the block must run exactly one prefill forward of `num_new_tokens`
    tokens starting at absolute `start_position`; every position p must satisfy
    start_position < p <= start_position + num_new_tokens and (p - start_position) % 64 == 0.
    The yielded recorder's `result(num_linear_layers)` returns the `CapturedStates`.
    """
    recorder = None
    if capture_positions:
        if num_new_tokens is None:
            raise ValueError("capture_positions needs num_new_tokens (the length of the prefill call)")
        recorder = _Recorder(start_position, num_new_tokens, capture_positions)
    module = _modeling_module()
    names = ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    originals = {name: getattr(module, name) for name in names}
    torch_conv_fn = getattr(originals["causal_conv1d_fn"], "__wrapped__", originals["causal_conv1d_fn"])
    torch_conv_update = getattr(originals["causal_conv1d_update"], "__wrapped__", originals["causal_conv1d_update"])

    def conv_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        if recorder is not None:
            recorder.record_conv(hidden_states, weight.shape[-1])
        return torch_conv_fn(hidden_states, weight, bias, activation)

    def chunk_fn(query, key, value, g, beta, chunk_size=GDN_CHUNK_NUM_TOKENS, initial_state=None,
                 output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        out, final_state, captured = chunk_gated_delta_rule(
            query, key, value, g, beta,
            chunk_num_tokens=chunk_size,
            initial_state=initial_state,
            use_qk_l2norm=use_qk_l2norm_in_kernel,
            compute_dtype=compute_dtype,
            capture_num_tokens=recorder.relative if recorder is not None else (),
        )
        if recorder is not None:
            recorder.ssm_states.append(captured)
        return out, (final_state if output_final_state else None)

    def recurrent_fn(query, key, value, g, beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **kwargs):
        out, final_state = recurrent_gated_delta_rule(
            query, key, value, g, beta,
            initial_state=initial_state,
            use_qk_l2norm=use_qk_l2norm_in_kernel,
            compute_dtype=compute_dtype,
        )
        return out, (final_state if output_final_state else None)

    if not _SWAP_LOCK.acquire(blocking=False):
        raise RuntimeError("gdn_kernels(...) is already active: the kernel swap is process-global and cannot nest")
    try:
        module.causal_conv1d_fn = conv_fn
        module.causal_conv1d_update = torch_conv_update
        module.torch_chunk_gated_delta_rule = chunk_fn
        module.torch_recurrent_gated_delta_rule = recurrent_fn
        yield recorder
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)
        _SWAP_LOCK.release()
