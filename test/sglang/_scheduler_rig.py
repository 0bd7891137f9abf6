"""SGLang's own `Scheduler.get_new_batch_prefill` on CPU, pass after pass.

`Scheduler.__init__` starts ZMQ sockets, a TP worker and a model; the prefill-batch builder does not
need any of that. `SchedulerRig` makes a scheduler with `object.__new__(Scheduler)` and gives it the
attributes `get_new_batch_prefill` / `_get_new_batch_prefill_raw` (managers/scheduler.py:4052-4420)
and `stash_chunked_request` (:3772) read, with these SGLang objects behind them: the real pools and
tree cache (sglang_cpu/pools.py), `SchedulePolicy` (so `calc_priority` sorts and matches the queue as
in a server), `PrefillAdder` (via `get_prefill_adder_class`), `NewTokenRatioTracker.from_config()`,
`BeamCoordinator`, a `GrammarManager` with an empty grammar queue, a `SchedulerLoadInquirer` reading
this scheduler's queue and chunked request, and `ScheduleBatch` (`init_new`, `prepare_for_extend`:
request rows, KV and state slots are really allocated). Two collaborators are plain values, because
the method only reads a field or two of them: `tp_worker` (`model_runner.attn_backend`, which has no
`extend_attention_block_m` here, so SGLang's fallback 64 applies; `model_runner.prefill_aware_swa`
False) and `model_config` (the fields `ScheduleBatch` reads, as in sglang_cpu/gdn_rig.py). Off, as
they would be on a server without those options: LoRA, priority scheduling and preemption, PP/DP, the
prefill delayer, mixed chunks, HiCache storage (L3), speculative decoding, DLLM, hisparse.

Between two passes `step` does what the scheduler does to the requests of the batch that ran, minus
the model: SGLang's `_process_hicache_events` (backup acks, load-back completions), the continuing
chunked request is stashed by SGLang's `stash_chunked_request` (the tree checkpoint after its chunk,
`checkpoint_kv_cache`), and a request whose prefill ended leaves with
`release_kv_cache` (as one with `max_new_tokens=1` does after its first token).
"""
from __future__ import annotations

import types
from array import array
from typing import Any, Optional

PAGE = 16
GRID = 64


def build_policy(cache: Any, schedule_policy: str, hicache: bool = False) -> Any:
    from sglang.srt.managers.schedule_policy import SchedulePolicy

    return SchedulePolicy(schedule_policy, tree_cache=cache, enable_hierarchical_cache=hicache,
                          enable_priority_scheduling=False, schedule_low_priority_values_first=False)


def new_req(rid: str, tokens: Any) -> Any:
    """A real SGLang `Req` (one output token)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=1))


class SchedulerRig:
    """One scheduler (one rank) over `cache` / `pools`; `run_pass` builds the next prefill batch."""

    def __init__(self, cache: Any, pools: Any, *, schedule_policy: str = "fcfs", chunked_prefill_size: int = 1000,
                 max_prefill_tokens: int = 16 * 1024, max_running_requests: int = 32, hicache: bool = False):
        """`hicache`: the cache has SGLang's host tier attached (sglang_cpu/hicache.py); the scheduler then
        starts the batch's load-backs (`ready_to_load_host_cache`) and runs `_process_hicache_events`."""
        from sglang.srt.beam_search.coordinator import BeamCoordinator
        from sglang.srt.constrained.grammar_manager import GrammarManager
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components.load_inquirer import SchedulerLoadInquirer
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.cache, self.pools = cache, pools
        s = self.scheduler = object.__new__(Scheduler)
        grammar_manager = object.__new__(GrammarManager)
        grammar_manager.grammar_queue = []
        s.grammar_manager = grammar_manager
        s.tree_cache = cache
        s.req_to_token_pool = pools.req_to_token_pool
        s.token_to_kv_pool_allocator = pools.allocator
        s.page_size = pools.page_size
        s.policy = build_policy(cache, schedule_policy, hicache)
        s.waiting_queue = []
        s.chunked_req = None
        s.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        s.chunked_prefill_size = chunked_prefill_size
        s.max_prefill_tokens = max_prefill_tokens
        s.max_running_requests = max_running_requests
        s.new_token_ratio_tracker = NewTokenRatioTracker.from_config()
        s.spec_algorithm = SpeculativeAlgorithm.NONE
        s.beam_coordinator = BeamCoordinator(
            model_config=None, spec_algorithm=s.spec_algorithm, dllm_enabled=False, max_req_len=8192,
            req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.allocator, tree_cache=cache,
            future_map=None)
        s.load_inquirer = SchedulerLoadInquirer(**{
            **{name: None for name in SchedulerLoadInquirer.__dataclass_fields__},
            "get_waiting_queue": lambda: s.waiting_queue, "get_chunked_req": lambda: s.chunked_req})
        s.disaggregation_mode = DisaggregationMode.NULL
        s.tp_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=object(),
                                                                               prefill_aware_swa=False))
        s.model_config = types.SimpleNamespace(
            hf_text_config=types.SimpleNamespace(mamba_chunk_size=GRID), vocab_size=1 << 17, is_encoder_decoder=False,
            is_multimodal=False, requires_mm_token_modalities=False, model_is_mrope=False, context_len=8192)
        for name in ("enable_priority_preemption", "is_hybrid_swa", "enable_lora", "enable_hicache_storage",
                     "enable_lmcache", "is_mixed_chunk", "enable_overlap",
                     "enable_unified_cache_external_linker", "enable_priority_scheduling"):
            setattr(s, name, False)
        s.enable_hierarchical_cache = hicache
        for name in ("prefill_delayer", "min_free_slots_delayer", "dynamic_chunk_sizer", "dllm_config",
                     "hisparse_coordinator", "truncation_align_size"):
            setattr(s, name, None)
        s.processed_tokens_counter = 0
        s.priority_scheduling_preemption_threshold = 0
        s.max_prefill_bs = 0
        self.last_batch: Optional[Any] = None

    def step(self) -> None:
        """After the last batch ran (see module docstring)."""
        from sglang.srt.mem_cache.common import release_kv_cache

        s, batch = self.scheduler, self.last_batch
        s._process_hicache_events()  # the scheduler's per-step HiCache drain (a no-op without a host tier)
        if batch is None:
            return
        if s.chunked_req is not None and s.chunked_req.extend_end > s.chunked_req.prefix_len:
            s.stash_chunked_request(s.chunked_req)
        for req in batch.reqs:
            if req is not s.chunked_req:
                release_kv_cache(req, self.cache, checkpoint=False)
        self.last_batch = None

    def run_pass(self, arriving: tuple = ()) -> list:
        """`step`, then `arriving` join the waiting queue, then SGLang builds the next prefill batch.
        Returns the batch as (rid, prefix_len, extend_end) per request, in batch order ([] when none)."""
        s = self.scheduler
        self.step()
        s.waiting_queue.extend(arriving)
        plan = s.get_new_batch_prefill(s.running_batch)
        s.running_batch = plan.running_batch
        self.last_batch = plan.batch_to_run
        if self.last_batch is None:
            return []
        return [(r.rid, r.prefix_len, r.extend_end) for r in self.last_batch.reqs]
