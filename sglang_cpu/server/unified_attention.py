"""A CPU stand-in for SGLang's Triton attention backend that reads and writes KV through SGLang's translator.

Test and bench support only (like `kernels.py`): nothing in `histate` imports it, and it is never
what a GPU server runs.

Why it exists. HiState's default device pool (`--histate-device-pool unified`) is SGLang's unified memory
pool, which implies the page-major KV layout (sglang/srt/arg_groups/kv_cache_hook.py:770-826). Under it a
KV slot has a VIRTUAL id (what the scheduler allocates and `req_to_token` stores) and a PHYSICAL id (where
the pool keeps it now); attention must write through the iteration's `KVLocPlan` and read through the
`KVIndexTranslator` (mem_cache/kv_loc_plan.py, mem_cache/kv_index_translator.py). SGLang's only attention
backend that runs on a CPU, torch_native (layers/attention/torch_native_backend.py), does neither: it
writes `KVWriteLoc(out_cache_loc)` without the plan's physical mark (the unified pool's write door refuses
it, mem_cache/memory_pool.py:2108-2116) and reads raw `req_to_token` rows, i.e. virtual ids, as if they
were physical. So the allow-list leaves it out, and HiState refuses unified + torch_native.

What it is. `TranslatingTorchAttnBackend` is SGLang's own `TorchNativeAttnBackend` (the same per-request
SDPA loop, `_run_sdpa_forward_extend` / `_run_sdpa_forward_decode`, so answers match a stock torch_native
server to fp32 rounding), with its two KV accesses done the way SGLang's Triton backend does them
(layers/attention/triton_backend.py):

  * writes: `KVWriteLoc.for_layer(forward_batch, layer)` (triton_backend.py:1717 uses `for_batch`), i.e.
    the write ids `KVLocPlan.bind` gave the batch in `ForwardBatch.init_new`
    (model_executor/forward_batch_info.py:1140-1142), carrying the plan's physical mark;
  * reads: the iteration's page table from the translator's read primitive
    `KVIndexTranslator.read_table(plan)` (kv_index_translator.py, `read_table`): built once per iteration
    by the plan (the translation happens there, exactly once, over `[0, seq_lens + read_extent)`) and
    shared by every layer and every later reader of the plan. Its page entries become per-token ids by
    the rule the translator documents for page-table consumers, `entry * entry_page_size + pos %
    entry_page_size` (a page's in-page offset is never translated). On a static pool the same call is the
    `req_to_token` passthrough, so the stand-in serves both pools.

Where it is selected. On a machine without CUDA, `patches.py` points SGLang's attention registry entry
"triton" (layers/attention/attention_registry.py:206-214, `create_triton_backend`) at this class: the
Triton backend has no CPU path (its kernels are Triton), this is its stand-in, and it keeps the Triton
backend's KV contract. Registering it under its own name instead would need SGLang's allow-list
(kv_cache_hook.py:812-826) and HiState's (`plugin.PAGE_MAJOR_ATTENTION_BACKENDS`) widened for a name that
no GPU server has; as "triton" both checks stay exactly as shipped and keep refusing torch_native, which
really does not read through the translator (test/server/test_launch_refusals.py). A server started with
`--attention-backend triton` on this CPU therefore runs THIS stand-in, not Triton kernels; the log says
so at start ("[cpu-server] attention backend 'triton' is the CPU stand-in ...").

HiState's own check (`plugin.check_device_pool`) reads the same resolved backend names
(`attention_backends_of`), so it accepts unified + "triton" here for the same reason SGLang's allow-list
does, and still refuses unified + torch_native. The unified pool needs three more CPU stand-ins, in
`patches.py`: the allocator's Triton paged-allocation kernels (`unified_alloc_torch`), its CUDA stream
ordering (`unified_allocator_streams`), and the host tier's copies of the pool's strided per-layer rows
(`keep_direct_io_on_cpu`, `strided_direct_io`).

Not covered (raises at construction or first use, never computes garbage): sliding-window pools,
encoder-decoder / cross attention, speculative decoding (target verify, draft extend), DCP, and reads
the translator defers (`reads_are_translated` False on a translating pool).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

logger = logging.getLogger(__name__)

STAND_IN_NOTICE = ("[cpu-server] attention backend 'triton' is the CPU stand-in "
                   "sglang_cpu.server.unified_attention.TranslatingTorchAttnBackend (torch SDPA, KV through "
                   "SGLang's KVIndexTranslator); no Triton kernel runs")
TRANSLATED_READ_NOTICE = "[cpu-server] unified pool: attention read physical ids that differ from req_to_token's"


class TranslatingTorchAttnBackend(TorchNativeAttnBackend):
    """torch_native's SDPA with the Triton backend's KV contract (see the module docstring). Stand-in."""

    def __init__(self, model_runner: Any):
        super().__init__(model_runner)
        if self.use_sliding_window_kv_pool:
            raise NotImplementedError("TranslatingTorchAttnBackend (CPU stand-in): sliding-window KV pools are not "
                                      "covered")
        if model_runner.model_config.is_encoder_decoder:
            raise NotImplementedError("TranslatingTorchAttnBackend (CPU stand-in): encoder-decoder models are not "
                                      "covered")
        # As TritonAttnBackend.__init__ does (triton_backend.py:226): the runner builds its translator before
        # its attention backends, and the hybrid wrapper copies this attribute when it is built
        # (hybrid_linear_attn_backend.py:1199).
        self.kv_index_translator = model_runner.kv_index_translator
        self.page_size = getattr(model_runner, "page_size", 1) or 1
        self.kv_ids: Optional[torch.Tensor] = None  # [bs, max_kv_len] physical token ids of this forward
        self.seen_translated_read = False
        logger.info(STAND_IN_NOTICE)

    # -- reads -------------------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Once per forward: this iteration's read table from the translator, expanded to token ids."""
        self.swa_out_cache_loc = None
        self.kv_ids = None
        mode = forward_batch.forward_mode
        if mode.is_idle() or forward_batch.batch_size == 0:
            return
        speculative = mode.is_target_verify() or mode.is_draft_extend_v2()
        if speculative or getattr(forward_batch, "spec_info", None) is not None:
            raise NotImplementedError("TranslatingTorchAttnBackend (CPU stand-in): speculative decoding is not covered")
        self.kv_ids = self.physical_kv_ids(forward_batch)

    def physical_kv_ids(self, forward_batch: Any) -> torch.Tensor:
        """[bs, max(seq_lens)] int64: row b, column p = the id of token p of request b in the K/V buffers."""
        translator = self.kv_index_translator
        plan = forward_batch.kv_loc_plan
        bs = int(forward_batch.batch_size)
        seq_lens = [int(n) for n in (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                                     else forward_batch.seq_lens)[:bs].tolist()]
        if translator is not None and translator.is_translating:
            if not translator.reads_are_translated:
                raise NotImplementedError("TranslatingTorchAttnBackend (CPU stand-in): deferred read translation "
                                          "(DCP) is not covered")
            assert plan is not None, "a forward on the unified pool without its iteration's KVLocPlan"
        if plan is not None and translator is not None:
            table = translator.read_table(plan, rows=bs)
            ids, row_ids, entry_page_size = table.ids, table.row_ids, table.entry_page_size
            assert table.v2p is None, "read_table returned a table-less (untranslated) source"
        else:  # a batch no plan was built for (a static pool outside ForwardBatch.init_new)
            ids, row_ids, entry_page_size = self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, 1
        out = torch.zeros((bs, max(seq_lens, default=0)), dtype=torch.int64, device=ids.device)
        for b, length in enumerate(seq_lens):
            row = int(row_ids[b])
            if entry_page_size == 1:
                out[b, :length] = ids[row, :length].to(torch.int64)
                continue
            pos = torch.arange(length, device=ids.device)
            entries = ids[row, pos // entry_page_size].to(torch.int64)
            out[b, :length] = entries * entry_page_size + pos % entry_page_size
        if not self.seen_translated_read and plan is not None and translator.is_translating:
            self._note_translated_read(forward_batch, out, seq_lens)
        return out

    def _note_translated_read(self, forward_batch: Any, physical: torch.Tensor, seq_lens: list) -> None:
        """Log once that a read's physical ids differ from its virtual `req_to_token` ids: evidence (read by
        test/server/test_unified_pool.py) that reading untranslated rows would have read other slots."""
        req_to_token = self.req_to_token_pool.req_to_token
        for b, length in enumerate(seq_lens):
            virtual = req_to_token[int(forward_batch.req_pool_indices[b]), :length].to(torch.int64)
            moved = int((virtual != physical[b, :length]).sum())
            if moved:
                self.seen_translated_read = True
                logger.info(f"{TRANSLATED_READ_NOTICE}: {moved} of {length} token ids of a row, e.g. virtual "
                            f"{int(virtual[0])} -> physical {int(physical[b, 0])}")
                return

    def _rows(self, forward_batch: Any) -> torch.Tensor:
        assert self.kv_ids is not None, "forward before init_forward_metadata"
        return torch.arange(self.kv_ids.shape[0], device=self.kv_ids.device)

    # -- forwards (TorchNativeAttnBackend.forward_extend / forward_decode, with the two KV accesses above)

    def _write(self, q: torch.Tensor, k: Any, v: Any, layer: Any, forward_batch: Any,
               save_kv_cache: bool) -> torch.Tensor:
        """The layer's K/V into the pool at the plan's physical write ids; returns the output buffer."""
        if layer.is_cross_attention:
            raise NotImplementedError("TranslatingTorchAttnBackend (CPU stand-in): cross attention is not covered")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v)
        if layer.qk_head_dim != layer.v_head_dim:
            return q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        return torch.empty_like(q)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        o = self._write(q, k, v, layer, forward_batch, save_kv_cache)
        causal = layer.attn_type != AttentionType.ENCODER_ONLY
        window = layer.sliding_window_size
        self._run_sdpa_forward_extend(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.kv_ids,
            self._rows(forward_batch),
            forward_batch.seq_lens,
            forward_batch.extend_prefix_lens,
            forward_batch.extend_seq_lens,
            None,
            scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            causal=causal,
            is_cross_attn=False,
            sliding_window_size=window if causal and window is not None and window > -1 else None,
        )
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o = self._write(q, k, v, layer, forward_batch, save_kv_cache)
        window = layer.sliding_window_size
        self._run_sdpa_forward_decode(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.kv_ids,
            self._rows(forward_batch),
            forward_batch.seq_lens,
            None,
            scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            causal=False,
            is_cross_attn=False,
            sliding_window_size=window if window is not None and window > -1 else None,
        )
        return o


def create_backend(runner: Any) -> TranslatingTorchAttnBackend:
    """The registry entry `patches.py` installs as "triton" on a machine without CUDA."""
    return TranslatingTorchAttnBackend(runner)
