"""Torch stand-ins for the three Triton kernels SGLang's Gated-DeltaNet prefill calls, for CPU tests.

SGLang 0.5.23 runs a GDN extend through `GDNAttnBackend.forward_extend` (layers/attention/linear/
gdn_backend.py): the causal conv (`causal_conv1d_fn`, kernels/ops/mamba/causal_conv1d_triton.py), the
gates (`fused_gdn_gating`, kernels/ops/attention/linear/fused_gdn_gating.py) and the chunked
gated-delta-rule (`chunk_gated_delta_rule`, kernels/ops/attention/fla/chunk.py, through
`TritonGDNKernel.extend`). All three are Triton; everything around them (metadata, track indices,
the state pool, the copies into track slots) is plain torch and runs on CPU. `install(monkeypatch)`
swaps these three module globals for the functions below, which keep the Triton kernels' contracts:

  causal_conv1d_fn(x [dim, T], weight [dim, K], bias, conv_states, query_start_loc, seq_lens_cpu,
                   cache_indices, has_initial_state, activation) -> [dim, T]
      varlen depthwise causal conv; a sequence with an initial state continues from
      conv_states[cache_indices[i]] (its last K-1 inputs); afterwards that row holds the sequence's last
      K-1 inputs.
  fused_gdn_gating(A_log, a [T, H], b [T, H], dt_bias) -> (g [1, T, H], beta [1, T, H])
  chunk_gated_delta_rule(q, k, v [1, T, H, D], g, beta [1, T, H], initial_state=pool [N, H, V, K],
                         initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel, ...) -> (o, None, h)
      per sequence, 64-token chunks from its first token; the final state is written back into the
      pool row; `h` [1, sum ceil(len_i / 64), H, V, K] holds the state entering every chunk, sequence
      after sequence (FLA's `chunk_gated_delta_rule_fwd_h` layout, which `_init_track_ssm_indices`
      indexes).

A fourth stand-in, `FlashInferGDNKernel`, replaces SGLang's FlashInfer extend kernel (the default GDN
prefill on H100/H200/B200) for the rig's FlashInfer layout: same numerics, but `h` follows FlashInfer's
checkpoint contract instead of Triton's (its docstring).

Numerics mirror the reference model (`histate.reference`): the gates as transformers' Qwen3.5 computes
them, the recurrence `histate.reference.gdr.chunk_gated_delta_rule` in the inputs' dtype (float64 gives
the exact mode), run one 64-token chunk per call, and the conv as an explicit sum over taps: both do the
same arithmetic whatever the length of the call, so a state captured inside a long prefill and a cold
prefill that ends at it agree bit for bit. Test support only: never imported by `histate`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from histate.reference.gdr import GDN_CHUNK_NUM_TOKENS
from histate.reference.gdr import chunk_gated_delta_rule as reference_chunk_gated_delta_rule


def causal_conv(inputs: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                initial: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal conv + SiLU of `inputs` [dim, T] after `initial` [dim, K-1] (zeros if None):
    out[:, t] = silu(bias + sum_j weight[:, j] * padded[:, t + j]), taps added in order j = 0..K-1."""
    width = weight.shape[-1]
    if initial is None:
        initial = inputs.new_zeros(inputs.shape[0], width - 1)
    padded = torch.cat([initial.to(inputs.dtype), inputs], dim=-1)
    num_tokens = inputs.shape[-1]
    out = weight[:, 0:1] * padded[:, 0:num_tokens]
    for j in range(1, width):
        out = out + weight[:, j:j + 1] * padded[:, j:j + num_tokens]
    if bias is not None:
        out = out + bias[:, None]
    return F.silu(out)


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], conv_states: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens_cpu: list, cache_indices: Optional[torch.Tensor] = None,
                     has_initial_state: Optional[torch.Tensor] = None, activation: Any = "silu", **kwargs: Any) -> torch.Tensor:
    if activation not in ("silu", "swish", True):
        raise NotImplementedError(f"activation {activation!r}")
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    keep = weight.shape[-1] - 1
    for i in range(len(starts) - 1):
        begin, end = starts[i], starts[i + 1]
        row = int(cache_indices[i])
        initial = conv_states[row] if has_initial_state is not None and bool(has_initial_state[i]) else None
        out[:, begin:end] = causal_conv(x[:, begin:end], weight, bias, initial)
        history = torch.cat([initial if initial is not None else x.new_zeros(x.shape[0], keep), x[:, begin:end]], dim=-1)
        conv_states[row] = history[:, -keep:].to(conv_states.dtype)
    return out


def fused_gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                     beta: float = 1.0, threshold: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # transformers' Qwen3.5 expression
    return g.unsqueeze(0), b.sigmoid().unsqueeze(0)


def gated_delta_rule_by_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              initial_state: torch.Tensor, use_qk_l2norm: bool) -> tuple:
    """One sequence, 64 tokens at a time from its first token, each chunk one call of the reference
    recurrence from the state the previous chunk left. Returns (out, the states entering each chunk,
    the final state), states in the kernel's [H, K, V]. Chunk by chunk, the arithmetic of a chunk does
    not depend on how many chunks the call holds, so a state taken inside a long prefill and a cold
    prefill that ends there are computed by the same operations (a batched-over-chunks kernel rounds the
    last bit differently with the number of chunks)."""
    chunk = GDN_CHUNK_NUM_TOKENS
    state, outs, entering = initial_state, [], []
    for begin in range(0, q.shape[1], chunk):
        end = begin + chunk
        entering.append(state)
        out, final, _ = reference_chunk_gated_delta_rule(
            q[:, begin:end], k[:, begin:end], v[:, begin:end], g[:, begin:end], beta[:, begin:end],
            initial_state=state.unsqueeze(0), use_qk_l2norm=use_qk_l2norm, compute_dtype=q.dtype)
        outs.append(out)
        state = final[0]
    return torch.cat(outs, dim=1), entering, state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           initial_state_indices: Optional[torch.Tensor] = None,
                           cu_seqlens: Optional[torch.Tensor] = None, head_first: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, inplace_update: bool = True) -> tuple:
    if head_first or scale is not None or cu_seqlens is None or initial_state is None:
        raise NotImplementedError("the stand-in covers SGLang's extend call only")
    starts = cu_seqlens.tolist()
    outs, h_rows = [], []
    for i in range(len(starts) - 1):
        begin, end = starts[i], starts[i + 1]
        row = int(initial_state_indices[i])
        # pool [H, V, K] -> kernel [H, K, V]; contiguous, as a cold prefill's state is (matmul rounding follows layout)
        start_state = initial_state[row].transpose(-1, -2).to(q.dtype).contiguous()
        out, entering, final = gated_delta_rule_by_chunk(
            q[:, begin:end], k[:, begin:end], v[:, begin:end], g[:, begin:end], beta[:, begin:end], start_state,
            use_qk_l2norm_in_kernel)
        outs.append(out)
        h_rows.extend(state.transpose(-1, -2) for state in entering)  # back to the pool's [H, V, K]
        if inplace_update:
            initial_state[row] = final.transpose(-1, -2).to(initial_state.dtype)
    return torch.cat(outs, dim=1), None, torch.stack(h_rows).unsqueeze(0)


class FlashInferGDNKernel:
    """STAND-IN (torch, CPU) for SGLang's `FlashInferGDNKernel` (layers/attention/linear/kernels/
    gdn_flashinfer.py:178), with the contract of its `extend` (gdn_flashinfer.py:481-596) over FlashInfer's
    `chunk_gated_delta_rule` (flashinfer/gdn_prefill.py), not its code. The class has SGLang's name because
    the plugin accepts extend kernels by class name (`capture_forward.CAPTURING_KERNELS`); the rig puts it
    in `GDNAttnBackend.kernel_dispatcher.extend_kernel` (FlashInfer itself needs CUDA SM90+).

    extend(q, k, v [1, T, H, D], g, beta [1, T, H], *, ssm_states [N, H, V, K], cache_indices,
           query_start_loc, state_checkpoint_cu_starts, num_state_checkpoints,
           state_checkpoint_every_n_tokens) -> (o, None, h)
      * the final state of sequence i is written back into ssm_states[cache_indices[i]];
      * `h` is None when num_state_checkpoints == 0 (SGLang passes no checkpoint buffer then,
        gdn_flashinfer.py:559-565); otherwise [1, num_state_checkpoints, H, V, K] where, with
        N = state_checkpoint_every_n_tokens, row cu_starts[i] + j is the state after (j + 1) * N tokens
        of sequence i, for j < cu_starts[i + 1] - cu_starts[i] = len_i // N (flashinfer/gdn_prefill.py:
        "checkpoint_cu_starts[i+1] - checkpoint_cu_starts[i] is the number of checkpoints for sequence i
        (= seq_len_i // checkpoint_every_n_tokens)"). Unlike Triton's `h`, there is no row for the
        sequence's start and, for a sequence that ends on the grid, the last row is its final state;
      * FlashInfer's argument checks are kept: N must be a multiple of 64, and a plan with N > 0 must
        come with both the checkpoint buffer and cu_starts (a plan of zero checkpoints with N > 0 is
        refused, as FlashInfer refuses it). A plan whose per-sequence counts are not len_i // N is
        refused too (the contract above is all FlashInfer documents).
    Numerics: `gated_delta_rule_by_chunk`, as the Triton stand-in, so a checkpoint row and a cold prefill
    that ends at it agree bit for bit in float64."""

    uses_state_checkpoints = True  # gdn_flashinfer.py:187
    supports_track_state_snapshot = False  # kernel_backend.py:24 (SGLang's GDN kernels never snapshot)

    def __init__(self) -> None:
        self.plans: list = []  # test instrumentation: (every_n_tokens, cu_starts) of each extend call with a plan

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the FlashInfer stand-in covers SGLang's extend call only")

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
               ssm_states: torch.Tensor, cache_indices: torch.Tensor, query_start_loc: torch.Tensor,
               state_checkpoint_cu_starts: Optional[torch.Tensor] = None, num_state_checkpoints: int = 0,
               state_checkpoint_every_n_tokens: int = 0, **kwargs: Any) -> tuple:
        every = int(state_checkpoint_every_n_tokens)
        starts = [int(x) for x in query_start_loc.tolist()]
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        wants_checkpoints = num_state_checkpoints > 0
        # gdn_flashinfer.py:559-582: a buffer only when num_state_checkpoints > 0; the rest goes to FlashInfer.
        if every < 0 or (every > 0 and every % GDN_CHUNK_NUM_TOKENS):
            raise ValueError(f"checkpoint_every_n_tokens must be a multiple of the chunk size (64), got {every}")
        if every > 0 and (not wants_checkpoints or state_checkpoint_cu_starts is None):
            raise ValueError("state_checkpoints and checkpoint_cu_starts must both be provided "
                             "when checkpoint_every_n_tokens > 0")
        if every == 0 and (wants_checkpoints or state_checkpoint_cu_starts is not None):
            raise ValueError("state_checkpoints and checkpoint_cu_starts must be None "
                             "when checkpoint_every_n_tokens == 0")
        cu = [int(x) for x in state_checkpoint_cu_starts.tolist()] if every else [0] * (len(lengths) + 1)
        if every and (len(cu) != len(lengths) + 1 or cu[0] != 0 or cu[-1] != num_state_checkpoints
                      or any(b - a != n // every for a, b, n in zip(cu, cu[1:], lengths))):
            raise ValueError(f"checkpoint plan {cu} (every {every}, {num_state_checkpoints} rows) does not follow "
                             f"len // every for sequences of {lengths} tokens")
        if every:
            self.plans.append((every, tuple(cu)))
        outs, rows = [], []
        for i, (begin, end) in enumerate(zip(starts, starts[1:])):
            slot = int(cache_indices[i])
            start_state = ssm_states[slot].transpose(-1, -2).to(q.dtype).contiguous()  # pool [H, V, K] -> [H, K, V]
            out, entering, final = gated_delta_rule_by_chunk(
                q[:, begin:end], k[:, begin:end], v[:, begin:end], g[:, begin:end], beta[:, begin:end], start_state,
                use_qk_l2norm=True)  # SGLang l2-normalises q, k before FlashInfer (gdn_prefill_qkv_prepare_fwd)
            outs.append(out)
            for j in range(cu[i + 1] - cu[i]):
                tokens = (j + 1) * every
                state = final if tokens == end - begin else entering[tokens // GDN_CHUNK_NUM_TOKENS]
                rows.append(state.transpose(-1, -2))
            ssm_states[slot] = final.transpose(-1, -2).to(ssm_states.dtype)
        h = torch.stack(rows).unsqueeze(0) if wants_checkpoints else None
        return torch.cat(outs, dim=1), None, h


def install(monkeypatch: Any) -> None:
    """Point SGLang's GDN prefill at these kernels for one test (pytest's monkeypatch)."""
    import sglang.srt.layers.attention.linear.gdn_backend as gdn_backend
    import sglang.srt.layers.attention.linear.kernels.gdn_triton as gdn_triton

    monkeypatch.setattr(gdn_backend, "causal_conv1d_fn", causal_conv1d_fn)
    monkeypatch.setattr(gdn_backend, "fused_gdn_gating", fused_gdn_gating)
    monkeypatch.setattr(gdn_triton, "chunk_gated_delta_rule", chunk_gated_delta_rule)
