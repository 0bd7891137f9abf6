"""SGLang's scheduler and Gated-DeltaNet backend on CPU, over the reference model's GDN layers.

What runs is SGLang 0.5.23's own code: `PrefillAdder` admission (test/sglang/_scheduler_round.py),
`ScheduleBatch.init_new` / `prepare_for_extend` (allocation, the per-request track choice, copy-on-write),
`ForwardBatch.init_new`, `ModelRunner`'s deferred copy-on-write, `GDNAttnBackend.init_forward_metadata`
and `forward_extend` for every GDN layer (its metadata, conv-window and SSM track copies), and the tree
inserts after each pass (`checkpoint_kv_cache`, `release_kv_cache`), with HiState's hooks installed as
the cache factory installs them. Two things are stand-ins:
  * the three Triton kernels of a GDN extend (sglang_cpu/gdn_kernels.py), and
  * the model around the GDN layers: each layer's inputs (the pre-conv `mixed_qkv` and the gate inputs
    `a`, `b`) come from one cold forward of the reference model (`histate.reference`, a tiny random
    Qwen3.5) over the whole prompt, recorded with forward hooks. A layer's input at a position does not
    depend on later tokens, so these are the inputs of any pass over any part of the prompt.
Attention layers are not run: their KV slots are allocated and cached as SGLang does, their bytes unused.

`page` (the `--page-size`) and `prefill_kernel` pick the setup: SGLang's tracking grid is
`mamba_cache_chunk_size()` = max(64, page) (arg_groups/overrides.py:1897-1925), published as the server's
`_mamba_cache_chunk_size`; `prefill_kernel` "triton" runs the Triton-layout stand-in (the rig's default,
SGLang's own `TritonGDNKernel` object calling the swapped `chunk_gated_delta_rule`), "flashinfer" puts
`gdn_kernels.FlashInferGDNKernel` (FlashInfer's checkpoint layout of `h`) in the dispatcher's
`extend_kernel`, where SGLang's `GDNKernelDispatcher` puts its FlashInfer kernel (gdn_backend.py:326-338).

`cold_layer_state` is the independent reference: each GDN layer prefilled from nothing over tokens
[0, p) of the same inputs with the same arithmetic (`gdn_kernels`), its final state taken directly: no
SGLang code, no pool, no per-chunk state rows, no capture.
"""
from __future__ import annotations

import types
from array import array
from typing import Any, Optional, Sequence

import torch

from .gdn_kernels import causal_conv, fused_gdn_gating, gated_delta_rule_by_chunk
from .pools import Pools, cache_params, publish_server_args

PAGE = 16  # the default page
GRID = 64  # the GDN state chunk: the state grid (lcm with the 16-token page)
PREFILL_KERNELS = ("triton", "flashinfer")


def cache_chunk_tokens(page: int) -> int:
    """SGLang's `mamba_cache_chunk_size()` for a GDN model (chunk 64) at `page` (overrides.py:1917-1924)."""
    assert max(GRID, page) % min(GRID, page) == 0, f"page {page}: SGLang refuses it with a 64-token chunk"
    return max(GRID, page)


class _KvPlan:
    def bind(self, *args: Any, **kwargs: Any) -> None:
        """Attention KV locations are not used here (no attention layer runs)."""


class _KvTranslator:
    def own_plan(self, forward_batch: Any) -> _KvPlan:
        return _KvPlan()


class GdnRig:
    def __init__(self, numerics: str, histate_config: Any, *, mamba_slots: int = 96, kv_tokens: int = 16384,
                 max_reqs: int = 8, clock: Any = None, hicache_ratio: Optional[float] = None,
                 kv_heads: int = 1, kv_head_dim: int = 4, page: int = PAGE, prefill_kernel: str = "triton",
                 write_policy: str = "write_through"):
        """`page`, `prefill_kernel`: the module docstring. `hicache_ratio`: attach SGLang's host tier (host
        pools of that many times the device pools, re-split by HiState) and, when `histate_config` names SSD
        directories, HiState's SSD tier; `write_policy`: its --hicache-write-policy.
        `kv_heads` x `kv_head_dim`: the attention KV geometry; only its size matters (no attention layer
        runs), through N_s = checkpoint bytes / KV bytes per token in eq. 3-7."""
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
        from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
        from sglang.srt.layers.attention.linear.utils import LinearAttnBackends, LinearAttnKernelBackend
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

        from histate.reference.runner import ModelRunner
        from histate.sglang_plugin.tree_cache import HiStateRadixCache

        if prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel {prefill_kernel!r}: one of {PREFILL_KERNELS}")
        self.page, self.grid = page, cache_chunk_tokens(page)
        if hicache_ratio is None:
            self.server_args = publish_server_args(page_size=page, chunk_tokens=self.grid,
                                                   mamba_radix_cache_strategy="extra_buffer")
        else:
            from histate.sglang_plugin.server_settings import storage_extra_config

            from .hicache import hicache_server_args

            storage = storage_extra_config(None, histate_config) if histate_config.has_ssd else None
            self.server_args = hicache_server_args(page, self.grid, storage_extra=storage, hicache_ratio=hicache_ratio,
                                                   mamba_radix_cache_strategy="extra_buffer",
                                                   hicache_write_policy=write_policy)
        self.runner = ModelRunner(numerics, page_num_tokens=GRID)
        model = self.runner.model
        config = model.config
        layer_types = list(config.layer_types)
        self.mamba_layers = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
        full_layers = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        self.gdn = [model.model.layers[i].linear_attn for i in self.mamba_layers]
        dtype = self.runner.compute_dtype
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=config.linear_value_head_dim * config.linear_num_value_heads,
            n_groups=config.linear_num_key_heads, num_heads=config.linear_num_value_heads,
            head_dim=config.linear_value_head_dim, state_size=config.linear_key_head_dim,
            conv_kernel=config.linear_conv_kernel_dim)
        params = Mamba2CacheParams(shape=shape, layers=self.mamba_layers,
                                   dtype=Mamba2StateDType(conv=self.runner.model_dtype, temporal=dtype))
        pool = HybridReqToTokenPool(size=max_reqs, mamba_size=mamba_slots, mamba_spec_state_size=max_reqs,
                                    max_context_len=8192, device="cpu", enable_memory_saver=False, cache_params=params,
                                    mamba_layer_ids=self.mamba_layers, enable_mamba_extra_buffer=True)
        kvcache = HybridLinearKVPool(size=kv_tokens, dtype=torch.bfloat16, page_size=page, head_num=kv_heads,
                                     head_dim=kv_head_dim,
                                     full_attention_layer_ids=full_layers, device="cpu", enable_memory_saver=False,
                                     mamba_pool=pool.mamba_pool)
        allocator = PagedTokenToKVPoolAllocator(size=kv_tokens, page_size=page, dtype=torch.bfloat16, device="cpu",
                                                kvcache=kvcache, need_sort=False)
        self.pools = Pools(pool, kvcache, allocator, page)
        install_hooks()
        self.cache = HiStateRadixCache(cache_params(self.pools), histate_config=histate_config,
                                       clock=clock or (lambda: 0.0))
        if hicache_ratio is not None:
            from .hicache import attach_hicache

            attach_hicache(self.cache, self.pools, self.server_args, histate_config)
        self.model_config = types.SimpleNamespace(
            hf_text_config=types.SimpleNamespace(mamba_chunk_size=GRID), vocab_size=config.vocab_size,
            is_encoder_decoder=False, is_multimodal=False, requires_mm_token_modalities=False, model_is_mrope=False,
            context_len=8192)
        triton = LinearAttnKernelBackend("triton")
        self.model_runner = types.SimpleNamespace(
            server_args=self.server_args, device="cpu", is_draft_worker=False, req_to_token_pool=pool,
            token_to_kv_pool=kvcache, model_config=self.model_config, lora_manager=None,
            linear_attn_backends=LinearAttnBackends(decode=triton, prefill=triton, verify=triton),
            kv_index_translator=_KvTranslator(), prefill_attention_backend_str="torch_native",
            ngram_embedding_manager=types.SimpleNamespace(enabled=False))
        self.backend = GDNAttnBackend(self.model_runner)
        if prefill_kernel == "flashinfer":
            from histate.sglang_plugin.capture_forward import check_extend_kernel

            from .gdn_kernels import FlashInferGDNKernel

            self.backend.kernel_dispatcher.extend_kernel = FlashInferGDNKernel()
            check_extend_kernel(None, self.backend)  # the plugin's model-load check, on the kernel it will run
        self.inputs: dict = {}  # rid -> per GDN layer (mixed_qkv, a, b) over the whole prompt

    # --- requests ------------------------------------------------------------------------------------

    def request(self, rid: str, tokens: Sequence[int], max_new_tokens: int = 1, decoded: Sequence[int] = ()) -> Any:
        """A real `Req`, and its GDN layers' inputs from one cold forward of the reference model over its
        prompt and then `decoded`, the tokens it will sample (a decode row's input is its last one)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.inputs[rid] = self.layer_inputs(list(tokens) + list(decoded))
        return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
                   sampling_params=SamplingParams(temperature=0, max_new_tokens=max_new_tokens))

    def forget(self, rid: str) -> None:
        """Drop `rid`'s layer inputs once nothing will prefill it again (a long stream would otherwise
        hold every prompt's layer inputs until the rig goes: about 0.3 GB over the differential test's
        stream, measured by process RSS)."""
        self.inputs.pop(rid, None)

    @torch.no_grad()
    def layer_inputs(self, tokens: Sequence[int]) -> list:
        recorded = [{} for _ in self.gdn]
        hooks = [getattr(module, name).register_forward_hook(
                     lambda _m, _i, out, slot=slot, name=name: slot.__setitem__(name, out[0].detach().clone()))
                 for module, slot in zip(self.gdn, recorded) for name in ("in_proj_qkv", "in_proj_a", "in_proj_b")]
        try:
            self.runner.prefill(self.runner.new_cache(), tokens, 0)
        finally:
            for hook in hooks:
                hook.remove()
        return [(r["in_proj_qkv"], r["in_proj_a"], r["in_proj_b"]) for r in recorded]

    # --- one forward pass ------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, reqs: list, running: Any = None) -> Any:
        """Build the batch as the scheduler does and run every GDN layer of it through SGLang's backend.
        `running`: a batch of requests past their prompt, mixed into this one as SGLang's
        `--enable-mixed-chunk` does (scheduler.py:4376-4395): `prepare_for_decode`, then
        `mix_with_running`, one decode row per request after the prefill rows."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        pools = self.pools
        batch = ScheduleBatch.init_new(reqs, pools.req_to_token_pool, pools.allocator, self.cache, self.model_config,
                                       False, SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        if running is not None:
            running.prepare_for_decode()
            batch.mix_with_running(running)
            batch.decoding_reqs = running.reqs
        forward_batch = runner_copy(ForwardBatch.init_new(batch, self.model_runner,
                                                          return_hidden_states_before_norm=False))
        ModelRunner._maybe_execute_deferred_mamba_cow_and_clear(self.model_runner, forward_batch)
        self.backend.init_forward_metadata(forward_batch)
        # Each row's tokens as the batch lists them (a decode row's prefix is its sequence less one token).
        spans = [(start, start + length) for start, length in zip(batch.prefix_lens, batch.extend_lens)]
        for index, (layer_id, module) in enumerate(zip(self.mamba_layers, self.gdn)):
            parts = [self.inputs[req.rid][index] for req in batch.reqs]
            mixed_qkv, a, b = (torch.cat([p[k][start:end] for p, (start, end) in zip(parts, spans)])
                               for k in range(3))
            self.backend.forward_extend(_layer(layer_id, module), forward_batch, mixed_qkv, a, b)
        return batch

    # --- reading states back -----------------------------------------------------------------------------

    def slot_state(self, slot: int) -> tuple:
        """(conv [layers, dim, K-1], ssm [layers, H, V, K]) held in mamba slot `slot`."""
        cache = self.pools.mamba_pool.mamba_cache
        return cache.conv[0][:, slot].clone(), cache.temporal[:, slot].clone()

    def working_state(self, req: Any) -> tuple:
        """The request's own running state slot, in `tree_state`'s layout."""
        return self.slot_state(int(req.kv.mamba_pool_idx))

    def tree_state(self, tokens: Sequence[int], position: int) -> tuple:
        """`slot_state` of the device state the tree holds at the end of `tokens[:position]`, or None if
        no node ends there with one."""
        node = self.cache.tree_core.root_node
        depth = 0
        while depth < position:
            child = next((c for c in node.children.values()
                          if list(c.key.token_ids[:len(c.key)]) == list(tokens[depth:depth + len(c.key)])), None)
            if child is None:
                return None
            node, depth = child, depth + len(child.key)
        value = node.component_data[2].value
        if depth != position or value is None:
            return None
        return self.slot_state(int(value[0]))

    @torch.no_grad()
    def cold_layer_state(self, rid: str, position: int) -> tuple:
        """Every GDN layer prefilled from nothing over tokens [0, position) of `rid`'s inputs (without
        autograd: a kept state would otherwise hold its whole recompute graph alive, gigabytes per stream)."""
        convs, ssms = [], []
        for module, (mixed_qkv, a, b) in zip(self.gdn, self.inputs[rid]):
            x = mixed_qkv[:position]
            conv_out = causal_conv(x.t(), module.conv1d.weight.squeeze(1), module.conv1d.bias).t()
            q, k, v = torch.split(conv_out, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
            g, beta = fused_gdn_gating(module.A_log, a[:position], b[:position], module.dt_bias)
            zero = x.new_zeros(module.num_v_heads, module.head_k_dim, module.head_v_dim)
            _, _, final = gated_delta_rule_by_chunk(
                q.reshape(1, position, module.num_k_heads, module.head_k_dim),
                k.reshape(1, position, module.num_k_heads, module.head_k_dim),
                v.reshape(1, position, module.num_v_heads, module.head_v_dim), g, beta, zero, use_qk_l2norm=True)
            convs.append(x[position - (module.conv_kernel_size - 1):].t())
            ssms.append(final.transpose(-1, -2))
        return torch.stack(convs), torch.stack(ssms)

    @torch.no_grad()
    def cold_model_state(self, tokens: Sequence[int], position: int) -> tuple:
        """The reference model's own cold prefill of tokens [0, position) (transformers' kernels for
        everything but the GDN recurrence): (conv, ssm) in the pool's layouts."""
        checkpoint = self.runner.checkpoint_by_prefill(tokens, position)
        return checkpoint.conv, checkpoint.ssm.transpose(-1, -2)


def _layer(layer_id: int, module: Any) -> Any:
    """The attributes of SGLang's `RadixLinearAttention` that `GDNAttnBackend.forward_extend` reads."""
    return types.SimpleNamespace(
        layer_id=layer_id, conv_weights=module.conv1d.weight.squeeze(1), bias=module.conv1d.bias, activation="silu",
        A_log=module.A_log, dt_bias=module.dt_bias, q_dim=module.key_dim, k_dim=module.key_dim,
        v_dim=module.value_dim, num_q_heads=module.num_k_heads, num_k_heads=module.num_k_heads,
        num_v_heads=module.num_v_heads, head_q_dim=module.head_k_dim, head_k_dim=module.head_k_dim,
        head_v_dim=module.head_v_dim)


def runner_copy(forward_batch: Any) -> Any:
    """The batch the model runs on, as SGLang's eager runner makes it: `EagerRunner.load_batch`
    returns a `dataclasses.replace` of the scheduler's ForwardBatch (model_executor/runner/
    eager_runner.py:180-208; the no-copy branch, which keeps the rig's tensors, is lines 186-187).
    Anything the backend needs must survive that copy: the R0 wrong answers of issue 27 were captures
    riding on an undeclared attribute that this copy drops, which a rig feeding `init_new`'s result
    straight to the backend never saw."""
    from sglang.srt.environ import envs
    from sglang.srt.model_executor.runner.eager_runner import EagerRunner

    with envs.SGLANG_EAGER_INPUT_NO_COPY.override(True):
        return EagerRunner.load_batch(None, forward_batch)


def install_hooks() -> None:
    """HiState's scheduler and backend hooks, as `histate_cache_factory` installs them."""
    from histate.sglang_plugin.capture import install_scheduler_hooks
    from histate.sglang_plugin.capture_forward import install_forward_hooks
    from histate.sglang_plugin.chunking import install_chunk_planning

    install_chunk_planning()
    install_scheduler_hooks()
    install_forward_hooks()
