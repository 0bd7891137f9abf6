"""The tiny random-weight Qwen3.5 the exactness harness runs, and the shapes of its cached state.

Nothing is downloaded: `Qwen3_5ForCausalLM` is built from a small `Qwen3_5TextConfig` with seeded
random weights. The layer pattern is the real one (`full_attention_interval=4`: three Gated-DeltaNet
layers, then one full-attention layer). Recurrent decay is slowed down (A in [0.01, 0.1] instead of
transformers' [0.01, 16]) so every state carries information across thousands of tokens: with the
default decay most heads forget within a few tokens, and a wrong checkpoint would go unnoticed.

`StateGeometry` is the one place that knows what a KV page and a recurrent checkpoint look like for
a given model (shapes, dtypes, byte sizes); the executor, the state pool and the byte sizes handed to
histate.core all come from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Size and numerics of the reference model. Defaults: 8 layers (6 GDN + 2 attention), 1.5 M params."""

    num_layers: int = 8
    hidden_size: int = 128
    vocab_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 32
    conv_kernel_size: int = 4
    init_std: float = 0.02
    slow_decay: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.num_layers < 4 or self.num_layers % 4:
            raise ValueError(f"num_layers={self.num_layers}: need a multiple of 4 (3 GDN : 1 attention pattern)")


def build_tiny_qwen35(spec: TinyModelSpec = TinyModelSpec(), dtype: torch.dtype = torch.float32):
    """A seeded random `Qwen3_5ForCausalLM` in eval mode. Weights depend only on `spec` (the float64
    model is the float32 one converted), so fp32 and fp64 runs compare the same function."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        linear_conv_kernel_dim=spec.conv_kernel_size,
        max_position_embeddings=65536,
        initializer_range=spec.init_std,
    )
    config._attn_implementation = "sdpa"
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = Qwen3_5ForCausalLM(config)
        if spec.slow_decay:
            with torch.no_grad():
                for layer in model.model.layers:
                    gdn = getattr(layer, "linear_attn", None)
                    if gdn is not None:
                        gdn.A_log.copy_(torch.empty_like(gdn.A_log).uniform_(0.01, 0.1).log())
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(dtype).eval()


@dataclass(frozen=True, slots=True)
class StateGeometry:
    """Shapes and byte sizes of one KV page and one recurrent checkpoint of a hybrid model.

    KV page:    `[num_full_layers, 2 (K, V), num_kv_heads, page_num_tokens, head_dim]` in `kv_dtype`.
    Checkpoint: conv `[num_linear_layers, conv_dim, conv_num_columns]` in `conv_dtype` plus
                ssm `[num_linear_layers, num_v_heads, d_k, d_v]` in `ssm_dtype`. Only kernel-1 conv
                columns are kept (what SGLang stores): the oldest of transformers' 4 columns never
                reaches an output that is kept.
    """

    full_layer_ids: tuple[int, ...]
    linear_layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    page_num_tokens: int
    conv_dim: int
    conv_kernel_size: int
    num_v_heads: int
    d_k: int
    d_v: int
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    @property
    def conv_num_columns(self) -> int:
        return self.conv_kernel_size - 1

    @property
    def kv_page_shape(self) -> tuple[int, ...]:
        return (len(self.full_layer_ids), 2, self.num_kv_heads, self.page_num_tokens, self.head_dim)

    @property
    def conv_shape(self) -> tuple[int, ...]:
        return (len(self.linear_layer_ids), self.conv_dim, self.conv_num_columns)

    @property
    def ssm_shape(self) -> tuple[int, ...]:
        return (len(self.linear_layer_ids), self.num_v_heads, self.d_k, self.d_v)

    @property
    def kv_bytes_per_token(self) -> int:
        return len(self.full_layer_ids) * 2 * self.num_kv_heads * self.head_dim * _itemsize(self.kv_dtype)

    @property
    def kv_page_size_bytes(self) -> int:
        return self.kv_bytes_per_token * self.page_num_tokens

    @property
    def conv_size_bytes(self) -> int:
        return _numel(self.conv_shape) * _itemsize(self.conv_dtype)

    @property
    def ssm_size_bytes(self) -> int:
        return _numel(self.ssm_shape) * _itemsize(self.ssm_dtype)

    @property
    def checkpoint_size_bytes(self) -> int:
        return self.conv_size_bytes + self.ssm_size_bytes


def state_geometry(model, page_num_tokens: int, ssm_dtype: torch.dtype) -> StateGeometry:
    """Geometry of `model`'s cache. `ssm_dtype` is the GDN compute dtype (float32 in transformers'
    kernels; float64 in the exact mode), which is the dtype the recurrent state lives in."""
    config = model.config
    layer_types = tuple(config.layer_types)
    model_dtype = next(model.parameters()).dtype
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    return StateGeometry(
        full_layer_ids=tuple(i for i, t in enumerate(layer_types) if t == FULL_ATTENTION),
        linear_layer_ids=tuple(i for i, t in enumerate(layer_types) if t == LINEAR_ATTENTION),
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        kv_dtype=model_dtype,
        page_num_tokens=page_num_tokens,
        conv_dim=2 * key_dim + value_dim,
        conv_kernel_size=config.linear_conv_kernel_dim,
        num_v_heads=config.linear_num_value_heads,
        d_k=config.linear_key_head_dim,
        d_v=config.linear_value_head_dim,
        conv_dtype=model_dtype,
        ssm_dtype=ssm_dtype,
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
