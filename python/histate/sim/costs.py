"""Cost model: model specs, hardware presets, transfer costs (paper eq. 2) and forward-step time.

Owns every constant the simulator charges time with, each with its source:

* Model shapes (`HybridArchitecture`): the Hugging Face `transformers` 5.19 config defaults of
  `Qwen3_5TextConfig` (Qwen3.5-9B) and `Qwen3NextConfig` (Qwen3-Next-80B-A3B), cross-checked
  against /work/shared/research/anchors.md §7.2 and refmodel.md §(c). Derived sizes and parameter
  counts are exact for those configs (counted on meta-device models: 8,953,803,264 and
  79,674,391,296 parameters).
* Native context (`native_context_num_tokens`, the longest prompt the model serves; the replay's
  default max context): 262,144 tokens for both Qwen3.5-9B and Qwen3-Next-80B-A3B ("Context
  Length: 262,144 natively", Hugging Face model cards Qwen/Qwen3.5-9B and
  Qwen/Qwen3-Next-80B-A3B-Instruct; `transformers`' `max_position_embeddings=32768` is only the
  config class default); 65,536 for the tiny reference model (`histate/reference/model.py:65`).
* Sizes: KV/token = attention layers x 2 (K, V) x KV heads x head_dim x dtype bytes; one
  checkpoint = linear layers x (SSM state H_v x d_k x d_v in FP32 + conv state conv_dim x
  (kernel - 1) columns in BF16), conv_dim = 2 H_k d_k + H_v d_v (refmodel.md §(c)).
  Qwen3.5-9B: 32 KiB/token and 51,511,296 B (49.1 MiB; the SSM part alone is 48 MiB).
* Hardware (`HardwareSpec`): dense BF16 tensor peak and HBM bandwidth from NVIDIA's H100 SXM5 /
  H200 SXM datasheets (989 TFLOP/s; 3.35 / 4.8 TB/s); H2D 64 GB/s (paper §3.1: PCIe 5.0 x16;
  anchors §7.1: 63 GB/s ceiling, ~50-55 GB/s practical); SSD 5 GB/s (paper §3.1). Efficiencies are
  assumptions (anchors §7.3: ~50% of peak for prefill), to be replaced by a measured profile.
* Transfer cost (paper eq. 2): T_CPU(X) = X / B_h2d, T_SSD(X) = X / B_ssd + X / B_h2d.
  Reproduces the paper's 16.8 / 231.5 ms for 32K tokens of KV and 67.1 / 926.1 ms for 128K. Its
  0.8 / 10.9 ms for one checkpoint match the 48 MiB SSM state (0.79 / 10.85 ms); the full
  checkpoint with conv state gives 0.80 / 11.10 ms (anchors §7.3 notes the same ~6% gap).

Step time (`RooflineStepCost`): one forward pass over a batch of prefill chunks and decode tokens
takes overhead + max(FLOPs / (peak x compute_efficiency), bytes / (HBM x memory_efficiency)).
FLOPs: 2 x active matmul parameters per token, attention 4 x attn layers x Q heads x head_dim per
(token, attended token) with causal prefill (token i of a chunk on c cached tokens attends c + i + 1),
the GDN recurrence, and the LM head for each token that is sampled. Bytes: weights once per step
(routed experts only in the touched fraction), KV read for every attended context and written for
new tokens, and each request's recurrent state read and written once per step. A measured prefill
profile (`PrefillProfile.from_csv`) replaces the prefill part (`CalibratedStepCost`).
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

GPU_TIER, CPU_TIER, SSD_TIER = 0, 1, 2   # the values of histate.core.Tier (an IntEnum): either works

GiB = 2**30
MiB = 2**20


# ----------------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class HybridArchitecture:
    """Shape of a hybrid full-attention + Gated-DeltaNet model (field names as in HF Qwen3.5 configs)."""

    name: str
    num_layers: int
    num_attention_layers: int            # the rest are GDN (linear attention) layers
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int = 0           # dense MLP width (0 when MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    attn_output_gate: bool = True        # q_proj also emits a gate as wide as the queries
    tie_word_embeddings: bool = False
    kv_dtype_bytes: int = 2              # BF16 KV cache
    ssm_dtype_bytes: int = 4             # FP32 recurrent state (SGLang --mamba-ssm-dtype default)
    conv_dtype_bytes: int = 2            # conv state in the model dtype
    conv_state_num_columns: Optional[int] = None  # kernel - 1 (SGLang, vLLM); transformers keeps kernel
    weight_dtype_bytes: int = 2
    gdn_chunk_num_tokens: int = 64       # FLA chunk size (chunked gated delta rule)
    native_context_num_tokens: int = 262144  # longest served prompt (Qwen3.5 / Qwen3-Next: model cards)

    @property
    def num_linear_layers(self) -> int:
        return self.num_layers - self.num_attention_layers

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    # Parameter counts per layer kind (norm weights included, so the totals are exact).
    def _attention_layer_params(self) -> int:
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return h * q * (2 if self.attn_output_gate else 1) + 2 * h * kv + q * h + 2 * self.head_dim

    def _linear_layer_params(self) -> int:
        h, hv = self.hidden_size, self.linear_num_value_heads
        k_dim = self.linear_num_key_heads * self.linear_key_head_dim
        v_dim = hv * self.linear_value_head_dim
        return (h * (2 * k_dim + 2 * v_dim) + h * 2 * hv + self.conv_dim * self.linear_conv_kernel_dim
                + v_dim * h + self.linear_value_head_dim + 2 * hv)

    def _mlp_params(self) -> tuple:
        """(always-active params, routed-expert params of all experts) of one layer's MLP."""
        h = self.hidden_size
        if not self.num_experts:
            return 3 * h * self.intermediate_size, 0
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_intermediate_size else 0)
        return h * self.num_experts + shared, self.num_experts * 3 * h * self.moe_intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def dense_params(self) -> int:
        """Non-embedding parameters every token uses (excludes routed experts and the LM head)."""
        mlp_dense, _ = self._mlp_params()
        per_layer_norms = 2 * self.hidden_size
        return (self.num_attention_layers * self._attention_layer_params()
                + self.num_linear_layers * self._linear_layer_params()
                + self.num_layers * (mlp_dense + per_layer_norms) + self.hidden_size)

    @property
    def expert_params(self) -> int:
        return self.num_layers * self._mlp_params()[1]

    @property
    def total_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.dense_params + self.expert_params + self.embedding_params + head


@dataclass(frozen=True)
class ModelSpec:
    """What the simulator charges for a model: sizes in bytes, work in FLOPs (module docstring)."""

    name: str
    kv_bytes_per_token: int
    checkpoint_size_bytes: int               # one recurrent checkpoint: SSM + conv state of every GDN layer
    ssm_state_bytes: int
    conv_state_bytes: int
    matmul_flops_per_token: float            # 2 x active params per token (LM head excluded)
    attention_flops_per_attended_token: float
    recurrent_flops_per_token: float         # GDN chunked recurrence (estimate; <1% for Qwen3.5-9B)
    logits_flops_per_token: float            # LM head, only for tokens that are sampled
    dense_weight_bytes: float                # weights every forward pass reads (no input embedding)
    expert_weight_bytes: float               # all routed experts
    expert_fraction_per_token: float         # experts_per_tok / num_experts
    native_context_num_tokens: int           # longest prompt the model serves (the default max context)
    architecture: Optional[HybridArchitecture] = None

    @classmethod
    def from_architecture(cls, arch: HybridArchitecture) -> "ModelSpec":
        n_lin, hv = arch.num_linear_layers, arch.linear_num_value_heads
        dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        columns = arch.conv_state_num_columns if arch.conv_state_num_columns is not None else \
            arch.linear_conv_kernel_dim - 1
        ssm = n_lin * hv * dk * dv * arch.ssm_dtype_bytes
        conv = n_lin * arch.conv_dim * columns * arch.conv_dtype_bytes
        active_experts = arch.expert_params * (arch.num_experts_per_tok / arch.num_experts if arch.num_experts else 0)
        head_params = arch.embedding_params  # the LM head (tied or not, it is one matmul per sampled token)
        return cls(
            name=arch.name,
            kv_bytes_per_token=arch.num_attention_layers * 2 * arch.num_key_value_heads * arch.head_dim
            * arch.kv_dtype_bytes,
            checkpoint_size_bytes=ssm + conv,
            ssm_state_bytes=ssm,
            conv_state_bytes=conv,
            matmul_flops_per_token=2.0 * (arch.dense_params + active_experts),
            attention_flops_per_attended_token=4.0 * arch.num_attention_layers * arch.num_attention_heads
            * arch.head_dim,
            # Per value head and token: S^T k, the rank-1 update and q^T S (3 d_k d_v MACs), plus the
            # intra-chunk attention of the chunked form (~C (d_k + d_v) MACs).
            recurrent_flops_per_token=2.0 * n_lin * hv * (3 * dk * dv + arch.gdn_chunk_num_tokens * (dk + dv)),
            logits_flops_per_token=2.0 * head_params,
            dense_weight_bytes=float((arch.dense_params + head_params) * arch.weight_dtype_bytes),
            expert_weight_bytes=float(arch.expert_params * arch.weight_dtype_bytes),
            expert_fraction_per_token=(arch.num_experts_per_tok / arch.num_experts) if arch.num_experts else 0.0,
            native_context_num_tokens=arch.native_context_num_tokens,
            architecture=arch,
        )

    @property
    def checkpoint_token_equivalents(self) -> float:
        """N_s of paper eq. 4: one checkpoint's size in tokens of KV."""
        return self.checkpoint_size_bytes / self.kv_bytes_per_token

    @property
    def int8_checkpoint_size_bytes(self) -> int:
        """One cached state in SGLang's int8 checkpoint pool (`--enable-int8-mamba-checkpoint`,
        sglang/srt/mem_cache/mamba_checkpoint_pool.py:61-80, 187-230): the SSM state in int8 (one byte
        per element), a scale per (layer, value head, key channel) in the state's own dtype, the conv
        window at its native dtype. Qwen3.5-9B with FP32 states: 14.2 MB against 51.5 MB."""
        arch = self.architecture
        if arch is None:
            raise ValueError(f"{self.name}: the int8 checkpoint size needs the model architecture")
        n_lin, hv, dk = arch.num_linear_layers, arch.linear_num_value_heads, arch.linear_key_head_dim
        ssm_elements = self.ssm_state_bytes // arch.ssm_dtype_bytes
        return ssm_elements + n_lin * hv * dk * arch.ssm_dtype_bytes + self.conv_state_bytes


QWEN35_9B_ARCH = HybridArchitecture(
    name="qwen3.5-9b", num_layers=32, num_attention_layers=8, hidden_size=4096, vocab_size=248320,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    intermediate_size=12288, native_context_num_tokens=262144)

QWEN3_NEXT_80B_A3B_ARCH = HybridArchitecture(
    name="qwen3-next-80b-a3b", num_layers=48, num_attention_layers=12, hidden_size=2048, vocab_size=151936,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    # FP8 weights: 80 B params in BF16 (159 GB) do not fit one H100/H200
    weight_dtype_bytes=1, native_context_num_tokens=262144)

TINY_QWEN35_ARCH = HybridArchitecture(
    # histate.reference's tiny random-weight Qwen3.5 (refmodel.md: 8 layers 3:1, hidden 128, fp32). Its
    # executor (and `histate serve`) checkpoints kernel - 1 conv columns like SGLang and vLLM
    # (reference/gdn_kernels.py): 116,736 B; transformers' own cache keeps all `kernel` (122,880 B).
    name="tiny-qwen3.5", num_layers=8, num_attention_layers=2, hidden_size=128, vocab_size=512,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, intermediate_size=256,
    kv_dtype_bytes=4, conv_dtype_bytes=4, weight_dtype_bytes=4, native_context_num_tokens=65536)

QWEN35_9B = ModelSpec.from_architecture(QWEN35_9B_ARCH)
QWEN3_NEXT_80B_A3B = ModelSpec.from_architecture(QWEN3_NEXT_80B_A3B_ARCH)
TINY_QWEN35 = ModelSpec.from_architecture(TINY_QWEN35_ARCH)
MODELS = {m.name: m for m in (QWEN35_9B, QWEN3_NEXT_80B_A3B, TINY_QWEN35)}


def get_model(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name]


VLLM_KERNEL_BLOCK_ALIGN_TOKENS = 64
"""The granularity vLLM rounds the hybrid attention block to with prefix caching: lcm(the model's mamba
chunk, 64 tokens for the GDN kernels; the attention kernel's alignment, 16). With it the rule below
gives the paper's 576-token blocks (§4.1: 2,560 blocks of 576 tokens in 45 GiB)."""


@dataclass(frozen=True)
class VllmHybridBlocks:
    """vLLM's hybrid allocator for one model (vllm-project/vllm@1936cf3,
    vllm/model_executor/models/config.py, `HybridAttentionMambaModelConfig.verify_and_update_config`):
    with prefix caching the attention block is `chunk * cdiv(cdiv(mamba_page_size,
    attn_page_size_1_token), chunk)` tokens, so that one page of an attention layer holds one layer's
    recurrent state; the state page is padded to it; layers are grouped by the smaller layer count, so
    a state takes one block in each mamba group."""

    block_num_tokens: int
    state_num_blocks: int
    block_size_bytes: int      # one block of one group: KV of `block_num_tokens` tokens

    @property
    def state_size_bytes(self) -> int:
        return self.state_num_blocks * self.block_size_bytes


def vllm_hybrid_blocks(model: ModelSpec, align_tokens: int = VLLM_KERNEL_BLOCK_ALIGN_TOKENS) -> VllmHybridBlocks:
    arch = model.architecture
    if arch is None:
        raise ValueError(f"{model.name}: vLLM block sizing needs the model architecture")
    kv_per_token_per_layer = model.kv_bytes_per_token // arch.num_attention_layers
    state_per_layer = math.ceil(model.checkpoint_size_bytes / arch.num_linear_layers)
    block = align_tokens * math.ceil(math.ceil(state_per_layer / kv_per_token_per_layer) / align_tokens)
    groups = math.ceil(arch.num_linear_layers / arch.num_attention_layers)
    return VllmHybridBlocks(block, groups, block * model.kv_bytes_per_token)


def attention_pair_tokens(model: ModelSpec) -> float:
    """One (query, key) attention pair over all attention layers, in FLOPs of one token's linear work
    (what Marconi's FLOP efficiency needs, histate.core CacheConfig.attention_pair_tokens)."""
    return model.attention_flops_per_attended_token / (model.matmul_flops_per_token + model.recurrent_flops_per_token)


# --------------------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class HardwareSpec:
    """One GPU and its host links. Bandwidths in bytes/s (decimal GB/s as datasheets and the paper)."""

    name: str
    peak_flops: float                       # dense BF16 tensor FLOP/s
    hbm_bandwidth_bytes_per_s: float
    hbm_capacity_bytes: int
    h2d_bandwidth_bytes_per_s: float = 64e9   # paper §3.1 (PCIe 5.0 x16)
    d2h_bandwidth_bytes_per_s: float = 64e9   # assumed symmetric
    ssd_read_bandwidth_bytes_per_s: float = 5e9   # paper §3.1 (SSD-to-CPU)
    ssd_write_bandwidth_bytes_per_s: float = 5e9  # assumed equal to reads (paper gives reads only)
    compute_efficiency: float = 0.5         # achieved / peak FLOP/s in prefill (anchors §7.3 assumption)
    memory_efficiency: float = 0.8          # achieved / peak HBM bandwidth (assumption)

    def with_links(self, *, h2d_gb_s: Optional[float] = None, ssd_gb_s: Optional[float] = None) -> "HardwareSpec":
        """Same GPU, other link speeds (GB/s), e.g. a Gen5 SSD at 14 GB/s (anchors §7.1)."""
        spec = self
        if h2d_gb_s is not None:
            spec = replace(spec, h2d_bandwidth_bytes_per_s=h2d_gb_s * 1e9, d2h_bandwidth_bytes_per_s=h2d_gb_s * 1e9)
        if ssd_gb_s is not None:
            spec = replace(spec, ssd_read_bandwidth_bytes_per_s=ssd_gb_s * 1e9,
                           ssd_write_bandwidth_bytes_per_s=ssd_gb_s * 1e9)
        return spec


H100_SXM = HardwareSpec(name="h100", peak_flops=989.4e12, hbm_bandwidth_bytes_per_s=3.35e12,
                        hbm_capacity_bytes=80 * 10**9)
H200_SXM = HardwareSpec(name="h200", peak_flops=989.4e12, hbm_bandwidth_bytes_per_s=4.8e12,
                        hbm_capacity_bytes=141 * 10**9)
HARDWARE = {h.name: h for h in (H100_SXM, H200_SXM)}


def get_hardware(name: str) -> HardwareSpec:
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {sorted(HARDWARE)}")
    return HARDWARE[name]


# ------------------------------------------------------------------------------- transfers (eq. 2)
def load_time_s(size_bytes: float, tier: Optional[int], hw: HardwareSpec) -> float:
    """Paper eq. 2: time to bring `size_bytes` from `tier` into GPU memory (0 on GPU or None)."""
    if tier is None or tier == GPU_TIER or size_bytes <= 0:
        return 0.0
    h2d = size_bytes / hw.h2d_bandwidth_bytes_per_s
    if tier == CPU_TIER:
        return h2d
    if tier == SSD_TIER:
        return size_bytes / hw.ssd_read_bandwidth_bytes_per_s + h2d
    raise ValueError(f"unknown tier {tier!r}")


def restore_cost_tokens(model: "ModelSpec", hw: HardwareSpec, step_cost: "RooflineStepCost",
                        reference_chunk_tokens: int = 8192, reference_context_tokens: int = 32768) -> dict:
    """Per tier: restoring one token's KV from it (eq. 2) in units of recomputing one token (a
    chunked-prefill step of `reference_chunk_tokens` on a `reference_context_tokens` context: a typical
    step of an agent request). What eq. 7 charges a unit that is demoted instead of dropped
    (histate.core CacheConfig.restore_cost_tokens). Qwen3.5-9B on an H100: CPU ~0.016, SSD ~0.2."""
    per_token_s = step_cost.prefill_time_s(reference_chunk_tokens, reference_context_tokens) / reference_chunk_tokens
    return {tier: load_time_s(model.kv_bytes_per_token, tier, hw) / per_token_s for tier in (CPU_TIER, SSD_TIER)}


def restore_time_s(kv_bytes_by_tier: Mapping, checkpoint_size_bytes: int, checkpoint_tier: Optional[int],
                   hw: HardwareSpec) -> float:
    """Eq. 2 summed over the items of one hit: the KV of every tier plus one checkpoint (no overlap)."""
    total = sum(load_time_s(size, tier, hw) for tier, size in kv_bytes_by_tier.items())
    return total + load_time_s(checkpoint_size_bytes, checkpoint_tier, hw)


# ------------------------------------------------------------------------------------ step costs
@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """`num_tokens` new tokens of one request on top of `context_num_tokens` already in its KV."""

    num_tokens: int
    context_num_tokens: int
    samples_token: bool = False     # the request's last chunk: its first output token is sampled


class RooflineStepCost:
    """Forward-pass time from FLOPs and bytes (module docstring). Stateless; all times in seconds."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, step_overhead_s: float = 1e-3) -> None:
        self.model, self.hw = model, hw
        self.step_overhead_s = step_overhead_s   # launch + scheduling per forward pass (assumption)
        self._flops_per_s = hw.peak_flops * hw.compute_efficiency
        self._bytes_per_s = hw.hbm_bandwidth_bytes_per_s * hw.memory_efficiency

    # Work of the pieces of a step -------------------------------------------------------------
    def prefill_work(self, chunks: Sequence[PrefillChunk]) -> tuple:
        """(FLOPs, HBM bytes excluding weights, tokens) of the prefill chunks of one step."""
        m = self.model
        per_token = m.matmul_flops_per_token + m.recurrent_flops_per_token
        flops = byts = 0.0
        tokens = 0
        state_rw = 2 * m.checkpoint_size_bytes
        for c in chunks:
            n, ctx = c.num_tokens, c.context_num_tokens
            attended = n * ctx + n * (n + 1) / 2
            flops += n * per_token + m.attention_flops_per_attended_token * attended
            if c.samples_token:
                flops += m.logits_flops_per_token
            byts += (ctx + n) * m.kv_bytes_per_token + state_rw
            tokens += n
        return flops, byts, tokens

    def weight_bytes(self, num_tokens: int) -> float:
        """Weights read by one forward pass over `num_tokens` tokens (experts: the touched fraction)."""
        m = self.model
        touched = min(1.0, num_tokens * m.expert_fraction_per_token) if m.expert_weight_bytes else 0.0
        return m.dense_weight_bytes + touched * m.expert_weight_bytes

    def decode_work(self, num_decode: int, context_sum: float) -> tuple:
        """(FLOPs, HBM bytes excluding weights) of `num_decode` decode tokens attending to
        `context_sum` + num_decode tokens in total (each also attends to itself)."""
        m = self.model
        per_token = m.matmul_flops_per_token + m.recurrent_flops_per_token + m.logits_flops_per_token
        attended = context_sum + num_decode
        flops = num_decode * per_token + m.attention_flops_per_attended_token * attended
        byts = attended * m.kv_bytes_per_token + num_decode * 2 * m.checkpoint_size_bytes
        return flops, byts

    # Step time --------------------------------------------------------------------------------
    def step_time_s(self, chunks: Sequence[PrefillChunk], num_decode: int = 0, decode_context_sum: float = 0) -> float:
        """One forward pass over prefill `chunks` plus `num_decode` decode tokens."""
        flops, byts, tokens = self.prefill_work(chunks)
        if num_decode:
            f, b = self.decode_work(num_decode, decode_context_sum)
            flops += f
            byts += b
        tokens += num_decode
        if tokens == 0:
            return 0.0
        byts += self.weight_bytes(tokens)
        return self.step_overhead_s + max(flops / self._flops_per_s, byts / self._bytes_per_s)

    def decode_coefficients(self, num_decode: int, context_sum: float) -> tuple:
        """Decode-only step j of a run (every context grows by one token per step) takes
        overhead + max(a + b j, c + d j); returns (overhead, a, b, c, d)."""
        m = self.model
        f0, b0 = self.decode_work(num_decode, context_sum)
        b0 += self.weight_bytes(num_decode)
        f_slope = m.attention_flops_per_attended_token * num_decode
        b_slope = m.kv_bytes_per_token * num_decode
        return (self.step_overhead_s, f0 / self._flops_per_s, f_slope / self._flops_per_s,
                b0 / self._bytes_per_s, b_slope / self._bytes_per_s)

    def prefill_time_s(self, num_tokens: int, context_num_tokens: int = 0,
                       chunk_num_tokens: Optional[int] = None) -> float:
        """A lone request's prefill of `num_tokens` on `context_num_tokens` cached, in chunks."""
        chunk = chunk_num_tokens or num_tokens
        total, done = 0.0, 0
        while done < num_tokens:
            n = min(chunk, num_tokens - done)
            total += self.step_time_s([PrefillChunk(n, context_num_tokens + done, done + n == num_tokens)])
            done += n
        return total


# ----------------------------------------------------------------------------------- calibration
PROFILE_COLUMNS = ("num_tokens", "context_num_tokens", "latency_s")


@dataclass(frozen=True)
class PrefillProfile:
    """Measured prefill latency, fitted as latency = c0 + c1 n + c2 n ctx + c3 n^2 (least squares).

    The form is the roofline's: per-pass overhead, per-token linear work, attention to the cached
    context and causal attention within the chunk. `max_relative_error` tells how well it fits.
    """

    coefficients: tuple
    num_points: int
    max_relative_error: float
    source: str = ""
    points: tuple = field(default=(), repr=False)

    @classmethod
    def from_csv(cls, path) -> "PrefillProfile":
        """CSV with a header holding num_tokens, context_num_tokens, latency_s (extra columns ignored,
        lines starting with '#' skipped). Errors name the file, line and column."""
        path = str(path)
        points = []
        with open(path, newline="") as f:
            rows = [(i, line) for i, line in enumerate(f, start=1) if line.strip() and not line.lstrip().startswith("#")]
        if not rows:
            raise ValueError(f"{path}: empty profile")
        header_line, header = rows[0][0], next(csv.reader([rows[0][1]]))
        header = [h.strip() for h in header]
        missing = [c for c in PROFILE_COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}:{header_line}: header lacks column(s) {missing}; expected {list(PROFILE_COLUMNS)}")
        index = {c: header.index(c) for c in PROFILE_COLUMNS}
        for line_number, text in rows[1:]:
            cells = next(csv.reader([text]))
            values = []
            for column in PROFILE_COLUMNS:
                j = index[column]
                if j >= len(cells):
                    raise ValueError(f"{path}:{line_number}: {column}: missing value")
                try:
                    value = float(cells[j])
                except ValueError:
                    raise ValueError(f"{path}:{line_number}: {column}: not a number: {cells[j]!r}") from None
                if not math.isfinite(value) or value < 0 or (column != "context_num_tokens" and value <= 0):
                    raise ValueError(f"{path}:{line_number}: {column}: out of range: {cells[j]!r}")
                values.append(value)
            points.append(tuple(values))
        return cls.fit(points, source=path)

    @classmethod
    def fit(cls, points: Sequence[tuple], source: str = "") -> "PrefillProfile":
        """Least-squares fit of (num_tokens, context_num_tokens, latency_s) points."""
        rows = [(1.0, n, n * ctx, n * n) for n, ctx, _ in points]
        ys = [lat for _, _, lat in points]
        coefficients = _least_squares(rows, ys, source)
        rel = max(abs(_dot(coefficients, r) - y) / y for r, y in zip(rows, ys))
        return cls(tuple(coefficients), len(points), rel, source, tuple(tuple(p) for p in points))

    def latency_s(self, num_tokens: int, context_num_tokens: int) -> float:
        c0, c1, c2, c3 = self.coefficients
        n = float(num_tokens)
        return max(0.0, c0 + c1 * n + c2 * n * context_num_tokens + c3 * n * n)


class CalibratedStepCost(RooflineStepCost):
    """Roofline whose prefill part comes from a measured `PrefillProfile`.

    A step with prefill chunks takes the sum of the profile's latency per chunk plus the decode
    tokens' marginal roofline time (no weights: the prefill already read them); decode-only steps
    keep the roofline. Conservative: prefill and decode do not overlap within a step.
    """

    def __init__(self, model: ModelSpec, hw: HardwareSpec, profile: PrefillProfile,
                 step_overhead_s: float = 1e-3) -> None:
        super().__init__(model, hw, step_overhead_s)
        self.profile = profile

    def step_time_s(self, chunks: Sequence[PrefillChunk], num_decode: int = 0, decode_context_sum: float = 0) -> float:
        if not chunks:
            return super().step_time_s(chunks, num_decode, decode_context_sum)
        total = sum(self.profile.latency_s(c.num_tokens, c.context_num_tokens) for c in chunks)
        if num_decode:
            f, b = self.decode_work(num_decode, decode_context_sum)
            total += max(f / self._flops_per_s, b / self._bytes_per_s)
        return total


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _least_squares(rows: Sequence[tuple], ys: Sequence[float], source: str) -> list:
    """Solve the normal equations (columns scaled to unit norm for conditioning)."""
    k = len(rows[0])
    if len(rows) < k:
        raise ValueError(f"{source or 'profile'}: need at least {k} points to fit, got {len(rows)}")
    scale = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(k)]
    xs = [[r[j] / scale[j] for j in range(k)] for r in rows]
    a = [[sum(x[i] * x[j] for x in xs) for j in range(k)] + [sum(x[i] * y for x, y in zip(xs, ys))]
         for i in range(k)]
    for col in range(k):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            raise ValueError(f"{source or 'profile'}: points do not determine the fit (vary both num_tokens "
                             f"and context_num_tokens)")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [v - factor * w for v, w in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] / scale[i] for i in range(k)]
