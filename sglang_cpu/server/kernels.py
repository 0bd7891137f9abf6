"""A stand-in `sgl_kernel` for SGLang's CPU engine, in torch: test and bench support only.

`SGLANG_USE_CPU_ENGINE=1` makes SGLang 0.5.23 take its `is_cpu()` branches, which import CPU ops from
`sgl_kernel` (12 module-level imports, e.g. kernels/ops/kvcache/cache_move.py:10,
layers/attention/linear/gdn_backend.py:183-189, kernels/gdn_triton.py:27-32) and look others up on
`torch.ops.sgl_kernel`. The real wheel cannot load without CUDA and has no CPU build on PyPI, so this
module answers those imports with the ops a dense Qwen3.5 (Gated-DeltaNet + gated full attention)
calls on a CPU without AMX, written against the contracts read at their call sites. Any other op
raises `NotImplementedError` naming it: a missing op fails the request loudly, never computes garbage.

GDN numerics are the project's stand-ins (`sglang_cpu.gdn_kernels`, the reference recurrence of
`histate.reference.gdr`, one 64-token chunk per call, run in float32 because torch's CPU triangular
solve has no bfloat16 kernel): a state captured inside a long prefill and a cold prefill ending there
are computed by the same operations, so a resumed request can be compared with a cold one exactly.

KV transfer ops (`sgl_kernel.kvcacheio`) for HiCache's host pools are here too: on a platform that is
neither CUDA/ROCm nor XPU the host pools bind none (mem_cache/pool_host/mha.py:60-90,
pool_host/mamba.py:28-53); `patches.py` binds these.
"""
from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

from sglang_cpu import gdn_kernels

# ---- scheduling ----------------------------------------------------------------------------------

def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, max_len):
    """req_to_token[r, s:e] = the next e - s entries of out_cache_loc, request after request."""
    position = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        num_tokens = end - start
        req_to_token[row, start:end] = out_cache_loc[position:position + num_tokens].to(req_to_token.dtype)
        position += num_tokens


# ---- Qwen3.5 layer ops ---------------------------------------------------------------------------

def _gemma_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps, head_dim):
    """Per-head Gemma RMSNorm of q and k (models/qwen3_5.py, `_is_cpu` branch)."""
    return _gemma_rms(q.reshape(-1, head_dim), q_weight, eps), _gemma_rms(k.reshape(-1, head_dim), k_weight, eps)


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, eps, head_dim, num_heads):
    """q_gate [T, heads * 2 * head_dim], per head [q | gate], as `forward_prepare_native` splits it
    (models/qwen3_5.py:1527): returns normed q, normed k and the gate, each [T, -1]."""
    num_tokens = q_gate.shape[0]
    per_head = q_gate.reshape(num_tokens, num_heads, 2 * head_dim)
    q, gate = per_head[..., :head_dim], per_head[..., head_dim:]
    return (_gemma_rms(q, q_weight, eps).reshape(num_tokens, -1).contiguous(),
            _gemma_rms(k.reshape(num_tokens, -1, head_dim), k_weight, eps).reshape(num_tokens, -1).contiguous(),
            gate.reshape(num_tokens, -1).contiguous())


def fused_sigmoid_mul_cpu(x, gate):
    """x *= sigmoid(gate), in place (the attention output gate)."""
    x.copy_((x.float() * torch.sigmoid(gate.reshape(x.shape).float())).to(x.dtype))
    return x


def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Qwen3.5's contiguous projection layout: qkvz = [q | k | v | z], ba = [b | a]."""
    num_tokens = mixed_qkvz.shape[0]
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    mixed_qkv = mixed_qkvz[:, :qkv_dim].contiguous()
    z = mixed_qkvz[:, qkv_dim:qkv_dim + num_heads_v * head_v].reshape(num_tokens, num_heads_v, head_v).contiguous()
    return mixed_qkv, z, mixed_ba[:, :num_heads_v].contiguous(), mixed_ba[:, num_heads_v:2 * num_heads_v].contiguous()


def fused_rmsnorm_gated_cpu(x, weight, g, eps):
    """RMSNormGated (norm, then SiLU gate), as transformers' Qwen3_5RMSNormGated computes it."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return (out.float() * F.silu(g.float())).to(x.dtype)


# ---- Gated-DeltaNet ------------------------------------------------------------------------------

def fused_gdn_gating_cpu(A_log, a, b, dt_bias, *args, **kwargs):
    return gdn_kernels.fused_gdn_gating(A_log, a, b, dt_bias)


def causal_conv1d_fn_cpu(x, weight, bias=None, **kwargs):
    """Varlen prefill conv: the stand-in of the Triton kernel (gdn_kernels.causal_conv1d_fn)."""
    kwargs.pop("block_table", None)
    return gdn_kernels.causal_conv1d_fn(x, weight, bias, kwargs.pop("conv_states"), kwargs.pop("query_start_loc"),
                                        kwargs.pop("seq_lens_cpu", None), **kwargs)


def causal_conv1d_update_cpu(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, **kwargs):
    """Decode conv: x [bs, dim], one token per row; conv_state [N, dim, K-1] updated in place."""
    if kwargs.get("intermediate_conv_window") is not None:
        raise NotImplementedError("causal_conv1d_update_cpu: speculative verify is not in the CPU stand-in")
    squeeze = x.dim() == 2
    tokens = x if squeeze else x[..., -1]
    out = torch.empty_like(tokens)
    for i, row in enumerate(conv_state_indices.tolist()):
        if row < 0:
            out[i] = 0
            continue
        initial = conv_state[row]
        column = tokens[i:i + 1].t()
        out[i] = gdn_kernels.causal_conv(column, weight, bias, initial)[:, 0]
        conv_state[row] = torch.cat([initial, column.to(conv_state.dtype)], dim=-1)[:, 1:]
    return out if squeeze else out.unsqueeze(-1)


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, **kwargs):
    """The extend kernel (kernels/gdn_triton.py:186-210 passes no `inplace_update` on CPU: the final
    state is always written back). Returns (out, None, h) with Triton's `h` layout."""
    f32 = torch.float32
    out, _, h = gdn_kernels.chunk_gated_delta_rule(q.to(f32), k.to(f32), v.to(f32), g.to(f32), beta.to(f32), **kwargs)
    return out.to(q.dtype), None, h


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens=None, use_qk_l2norm_in_kernel=True,
                                               softplus_beta=1.0, softplus_threshold=20.0, **kwargs):
    """Decode: gates, then one step of the reference recurrence from each row's pool slot."""
    if kwargs.get("disable_state_update") or kwargs.get("intermediate_states_buffer") is not None:
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update_cpu: speculative verify is not in the "
                                  "CPU stand-in")
    out_dtype, f32 = q.dtype, torch.float32
    q, k, v = q.to(f32), k.to(f32), v.to(f32)
    batch_size = q.shape[1]
    g, beta = gdn_kernels.fused_gdn_gating(A_log, a.reshape(batch_size, -1), b.reshape(batch_size, -1), dt_bias)
    out = v.new_zeros(v.shape)
    for i, row in enumerate(initial_state_indices.tolist()):
        if row < 0:
            continue
        state = initial_state_source[row].transpose(-1, -2).to(f32).contiguous()
        o, _, final = gdn_kernels.gated_delta_rule_by_chunk(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1],
                                                            beta[:, i:i + 1], state, use_qk_l2norm_in_kernel)
        out[:, i:i + 1] = o
        initial_state_source[row] = final.transpose(-1, -2).to(initial_state_source.dtype)
    return out.to(out_dtype)


# ---- HiCache host <-> device transfers (sgl_kernel.kvcacheio) -------------------------------------

def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=1, **_):
    """Per layer: dst[dst_indices] = src[src_indices] (layer-first on both sides)."""
    src_rows, dst_rows = src_indices.long(), dst_indices.long()
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_rows.to(dst.device)] = src[src_rows.to(src.device)].to(dst.device, dst.dtype)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size=1, **_):
    """Page-first host [pages, layers, page, ...] (Mamba host: [slots, layers, 1, ...]) -> one device
    layer [rows, ...]: dst[d] = host[s // page, layer_id, s % page]."""
    src_rows, dst_rows = src_indices.long(), dst_indices.long()
    for src, dst in zip(src_ptrs, dst_ptrs):
        page = src.shape[2]
        dst[dst_rows] = src[src_rows // page, layer_id, src_rows % page].reshape(dst[dst_rows].shape).to(dst.dtype)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size=1, **_):
    """Every device layer [rows, ...] -> page-first host [pages, layers, page, ...]; src_ptrs holds the
    layers of dst_ptrs[0] (K), then those of dst_ptrs[1] (V) when there are two."""
    src_rows, dst_rows = src_indices.long(), dst_indices.long()
    per_dst = len(src_ptrs) // len(dst_ptrs)
    for j, dst in enumerate(dst_ptrs):
        page = dst.shape[2]
        for layer, src in enumerate(src_ptrs[j * per_dst:(j + 1) * per_dst]):
            target = dst[dst_rows // page, layer, dst_rows % page]
            dst[dst_rows // page, layer, dst_rows % page] = src[src_rows].reshape(target.shape).to(dst.dtype)


KVCACHEIO_OPS = (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf)


# ---- install -------------------------------------------------------------------------------------

_OPS = {name: fn for name, fn in dict(globals()).items() if name.endswith("_cpu") and callable(fn)}


class _OpNamespace(types.ModuleType):
    """`sgl_kernel` (module) or `torch.ops.sgl_kernel` (strict): known ops from `_OPS`; an unknown op is
    a function raising NotImplementedError (module) or absent (strict: SGLang probes `hasattr`, e.g.
    `register_fake_if_exists("sgl_kernel::gptq_marlin_repack")`, quantization/gptq/gptq.py:670)."""

    def __init__(self, name: str, strict: bool):
        super().__init__(name)
        self.__path__ = []
        self._strict = strict

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _OPS:
            return _OPS[name]
        if self._strict:
            raise AttributeError(f"torch.ops.sgl_kernel.{name} is not in the CPU stand-in")

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"sgl_kernel.{name} is not in the CPU stand-in (sglang_cpu/server/kernels.py)")

        missing.__name__ = name
        return missing


def install() -> None:
    """Register the stand-in as `sgl_kernel`, `sgl_kernel.mamba`, `sgl_kernel.kvcacheio` and
    `torch.ops.sgl_kernel` (idempotent; before SGLang is imported)."""
    if "sgl_kernel" in sys.modules:
        return
    top = _OpNamespace("sgl_kernel", strict=False)
    top.__version__ = "0.0.0+histate-cpu-stand-in"
    for child in ("mamba", "kvcacheio"):
        module = _OpNamespace(f"sgl_kernel.{child}", strict=False)
        setattr(top, child, module)
        sys.modules[module.__name__] = module
    for fn in KVCACHEIO_OPS:
        setattr(top.kvcacheio, fn.__name__, fn)
    sys.modules["sgl_kernel"] = top
    setattr(torch.ops, "sgl_kernel", _OpNamespace("torch.ops.sgl_kernel", strict=True))
