"""Torch reference of the gated delta rule (GDN) that can hand out intermediate recurrent states.

Owns the two GDN kernels the reference model runs:

* `chunk_gated_delta_rule` -- the chunked (64-token) prefill form. Same math and operation order as
  transformers' `torch_chunk_gated_delta_rule` (so float32 outputs are bit-identical to it), plus
  two things transformers does not offer: a chosen compute dtype (float64 gives an exact-arithmetic
  reference; transformers always computes in float32) and `capture_num_tokens`, the chunk boundaries
  whose recurrent state the caller wants back. Those states are the loop variable of the sequential
  chunk scan, which the stock kernel overwrites; keeping the requested ones is what lets one prefill
  yield several checkpoints (HiState's interval controller plans them, paper section 3.2).
* `recurrent_gated_delta_rule` -- the token-by-token form used by decode steps (and as an
  independent check of the chunked form in tests).

Layouts follow transformers / fla: q, k `[B, T, H_k, d_k]`, v `[B, T, H_v, d_v]`, g and beta
`[B, T, H_v]`, recurrent state `[B, H_v, d_k, d_v]`. When H_k < H_v (grouped heads) q and k are
repeated here, which covers both transformers 5.19 (repeats before the call) and later releases
(repeat inside the kernel).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

GDN_CHUNK_NUM_TOKENS = 64


def _l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same formula as transformers' / fla's l2norm, so float32 results stay bit-identical.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _to_heads_first(query, key, value, g, beta, compute_dtype):
    num_v_heads = value.shape[-2]
    if query.shape[2] != num_v_heads:
        repeat = num_v_heads // query.shape[2]
        query = query.repeat_interleave(repeat, dim=2)
        key = key.repeat_interleave(repeat, dim=2)
    return [
        x.transpose(1, 2).to(compute_dtype, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    ]


def _check_capture(capture_num_tokens: Sequence[int], num_tokens: int, chunk_num_tokens: int) -> list[int]:
    wanted = sorted(set(int(n) for n in capture_num_tokens))
    for n in wanted:
        if n <= 0 or n > num_tokens or n % chunk_num_tokens:
            raise ValueError(
                f"capture_num_tokens={n}: a state can only be captured at a chunk boundary inside this call "
                f"(a positive multiple of {chunk_num_tokens} that is <= {num_tokens} tokens)"
            )
    return wanted


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_num_tokens: int = GDN_CHUNK_NUM_TOKENS,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    capture_num_tokens: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over T tokens.

    Returns `(out, final_state, captured_states)`:
      out             `[B, T, H_v, d_v]` in query's dtype;
      final_state     `[B, H_v, d_k, d_v]` in `compute_dtype` (state after all T tokens);
      captured_states `[B, n, H_v, d_k, d_v]` in `compute_dtype`, the state after the first
                      `capture_num_tokens[j]` tokens of this call, in ascending order (n may be 0).
    Capture points must be chunk boundaries of *this call*; they are absolute 64-token boundaries
    only when the call itself starts on one (a fresh prefill or a resume from an aligned checkpoint).
    """
    out_dtype = query.dtype
    batch_size, num_tokens = key.shape[:2]
    wanted = _check_capture(capture_num_tokens, num_tokens, chunk_num_tokens)
    query, key, value, beta, g = _to_heads_first(query, key, value, g, beta, compute_dtype)
    num_heads, d_k, d_v = value.shape[1], key.shape[-1], value.shape[-1]
    if use_qk_l2norm:
        query, key = _l2_normalize(query), _l2_normalize(key)
    query = query * (d_k**-0.5)

    # Right padding only: padded steps have k = v = beta = g = 0, so they leave the state unchanged.
    pad = (chunk_num_tokens - num_tokens % chunk_num_tokens) % chunk_num_tokens
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    num_chunks = (num_tokens + pad) // chunk_num_tokens

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (
        x.reshape(x.shape[0], x.shape[1], -1, chunk_num_tokens, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    )
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk_num_tokens)
    strictly_upper = torch.ones(chunk_num_tokens, chunk_num_tokens, dtype=torch.bool, device=query.device).triu(1)
    cum_g = g.cumsum(dim=3)
    pair_decay = (cum_g.unsqueeze(4) - cum_g.unsqueeze(3)).masked_fill(strictly_upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pair_decay
    intra_attn = (query @ key.transpose(-1, -2)) * pair_decay
    decayed_k_beta = k_beta * cum_g.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    if initial_state is None:
        state = torch.zeros((batch_size, num_heads, d_k, d_v), dtype=compute_dtype, device=value.device)
    else:
        state = initial_state.to(new_values)
    out = torch.zeros_like(new_values)
    query = query * cum_g.exp().unsqueeze(-1)
    key = key * (cum_g[..., -1:] - cum_g).exp().unsqueeze(-1)
    chunk_decay = cum_g[..., -1].exp()[..., None, None]

    capture_chunks = {n // chunk_num_tokens for n in wanted}
    captured = []
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra_attn[:, :, i] @ v_new
        # A fresh tensor each step (no in-place update), so keeping a reference is a free snapshot.
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
        if i + 1 in capture_chunks:
            captured.append(state)

    out = out.reshape(batch_size, num_heads, -1, d_v)[:, :, :num_tokens]
    out = out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format)
    if captured:
        captured_states = torch.stack(captured, dim=1)
    else:
        captured_states = state.new_empty((batch_size, 0, num_heads, d_k, d_v))
    return out, state, captured_states


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule: S_t = a_t S_{t-1} + k_t (beta_t (v_t - (a_t S_{t-1})^T k_t))^T,
    o_t = S_t^T q_t / sqrt(d_k). Returns `(out [B, T, H_v, d_v] in query's dtype, final_state)`."""
    out_dtype = query.dtype
    batch_size, num_tokens = key.shape[:2]
    query, key, value, beta, g = _to_heads_first(query, key, value, g, beta, compute_dtype)
    num_heads, d_k, d_v = value.shape[1], key.shape[-1], value.shape[-1]
    if use_qk_l2norm:
        query, key = _l2_normalize(query), _l2_normalize(key)
    query = query / (d_k**0.5)
    if initial_state is None:
        state = torch.zeros((batch_size, num_heads, d_k, d_v), dtype=compute_dtype, device=value.device)
    else:
        state = initial_state.to(value)
    out = torch.zeros_like(value)
    for t in range(num_tokens):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * key[:, :, t].unsqueeze(-1)).sum(dim=-2)
        delta = (value[:, :, t] - kv_mem) * beta[:, :, t].unsqueeze(-1)
        state = state + key[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (state * query[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(out_dtype), state
