"""Checkpoints captured inside one prefill forward pass, through SGLang's own scheduler and GDN backend.

Rig (sglang_cpu/gdn_rig.py): SGLang 0.5.23's `PrefillAdder`, `ScheduleBatch.prepare_for_extend`,
`ForwardBatch.init_new`, `GDNAttnBackend` (metadata, conv and SSM track copies) and tree inserts, with
HiState's hooks; the three Triton kernels of a GDN extend are torch stand-ins (sglang_cpu/gdn_kernels.py)
and each GDN layer's inputs come from a cold forward of the tiny reference Qwen3.5. After the passes,
every position HiState planned must hold, in the tree, exactly the state a cold prefill to that
position has:
  * per GDN layer, prefilled from nothing over the same inputs with `histate.reference.gdr` (no SGLang
    code): bit-identical in float64, within 1e-5 in float32;
  * the reference model's own cold prefill to that position (its attention layers round differently
    for a shorter prompt): within 1e-12 in float64, 1e-5 in float32.
Scenarios: a prompt in one pass, a prompt over several chunked passes, a branch point inside a pass
(a request that resumes from another's checkpoint), and several requests in one batch.
"""
from __future__ import annotations

import random

import pytest
import torch

from ._scheduler_round import prefill_round
from sglang_cpu import gdn_kernels
from sglang_cpu.gdn_rig import PAGE, GdnRig

TOLERANCE = {"fp64": (0.0, 1e-12), "fp32": (0.0, 1e-5)}  # (layer-level, model-level) max abs difference


def _tokens(seed: int, num_tokens: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(num_tokens)]


@pytest.fixture
def rig_for(sglang_plugins, monkeypatch):
    from histate.sglang_plugin.config import resolve_config

    gdn_kernels.install(monkeypatch)

    def build(numerics: str, intervals: str = "128") -> GdnRig:
        return GdnRig(numerics, resolve_config({"enable": True, "intervals_tokens": intervals}, {}))

    return build


def _serve(rig: GdnRig, waiting: list, chunk_tokens=None) -> list:
    """Admission rounds until every request ran its prompt, as the scheduler runs them: a cut request
    is inserted at the start of the next round (`stash_chunked_request`), a finished prompt at its end
    (batch_result_processor.py:393) and then released (`release_kv_cache`). Returns the batches run."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

    cache, pending, chunked, batches = rig.cache, list(waiting), None, []
    while pending or chunked is not None:
        if chunked is not None:
            checkpoint_kv_cache(chunked, cache)
        adder, new_chunked = prefill_round(cache, rig.pools.allocator, PAGE, chunked, pending,
                                           rem_chunk_tokens=chunk_tokens)
        batch = list(adder.can_run_list)
        assert batch, "a round admitted nothing"
        pending = [r for r in pending if r not in batch]
        rig.forward(batch)
        batches.append([(r.rid, r.prefix_len, r.extend_end) for r in batch])
        for req in batch:
            if req is new_chunked:
                continue
            checkpoint_kv_cache(req, cache)
            req.finished_reason = FINISH_LENGTH(length=0)
            release_kv_cache(req, cache, checkpoint=True)
        chunked = new_chunked
    cache.sanity_check()
    return batches


def _check_every_planned_state(rig: GdnRig, numerics: str, reqs_tokens: list) -> int:
    layer_tol, model_tol = TOLERANCE[numerics]
    checked = 0
    for req, tokens in reqs_tokens:
        assert req._hs_captures == []  # every capture slot went into the tree
        for position in req._hs_plan:
            got = rig.tree_state(tokens, position)
            assert got is not None, f"{req.rid}: no state at planned position {position}"
            for want, tol in ((rig.cold_layer_state(req.rid, position), layer_tol),
                              (rig.cold_model_state(tokens, position), model_tol)):
                for name, g, w in zip(("conv", "ssm"), got, want):
                    diff = (g.to(torch.float64) - w.to(torch.float64)).abs().max().item()
                    assert diff <= tol, f"{req.rid} @{position} {name}: {diff:.3g} > {tol}"
            checked += 1
    return checked


@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_a_prompt_in_one_pass_keeps_every_planned_state(rig_for, numerics):
    rig = rig_for(numerics)
    tokens = _tokens(1, 600)
    req = rig.request("a", tokens)
    batches = _serve(rig, [req])
    assert batches == [[("a", 0, 600)]]  # one forward pass
    assert req._hs_plan == [128, 256, 384, 512, 576]
    metrics = rig.cache.histate.metrics.totals
    assert (metrics[("captures_total", "tracked")], metrics[("captures_total", "extra")]) == (1, 4)
    assert _check_every_planned_state(rig, numerics, [(req, tokens)]) == 5


@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_a_prompt_over_chunked_passes_keeps_every_planned_state(rig_for, numerics):
    """300-token chunks, cuts floored to the 64-token grid: passes end at 256, 512, 768 and 1000; each
    captures the planned positions inside it, the later ones from the state its prefix left."""
    rig = rig_for(numerics)
    tokens = _tokens(2, 1000)
    req = rig.request("a", tokens)
    batches = _serve(rig, [req], chunk_tokens=300)
    assert [b[0][1:] for b in batches] == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert req._hs_plan == [128, 256, 384, 512, 640, 768, 896, 960]
    assert _check_every_planned_state(rig, numerics, [(req, tokens)]) == 8


@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_a_branch_point_inside_the_pass_is_captured(rig_for, numerics):
    """B shares 500 tokens with A, whose deepest state at or before them is at 384: B resumes there
    (copy-on-write of that state) and its KV match ends in the middle of a grid chunk, so SGLang's
    branch point is 448, inside B's pass, with HiState's interval positions and its terminal."""
    rig = rig_for(numerics)
    tokens_a = _tokens(3, 600)
    tokens_b = tokens_a[:500] + _tokens(4, 300)
    a = rig.request("a", tokens_a)
    _serve(rig, [a])
    b = rig.request("b", tokens_b)
    batches = _serve(rig, [b])
    assert batches == [[("b", 384, 800)]] and b.mamba_branching_seqlen == 448
    assert 448 in b._hs_plan and b._hs_plan[-1] == 768
    assert _check_every_planned_state(rig, numerics, [(a, tokens_a), (b, tokens_b)]) == len(a._hs_plan) + len(b._hs_plan)


@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_several_requests_in_one_batch(rig_for, numerics):
    """Three prompts in one forward pass: rows of different lengths, so each request's per-chunk states
    start at its own offset of the kernel's `h` (and two of them have an off-64 length)."""
    rig = rig_for(numerics)
    items = [(rig.request(rid, tokens), tokens) for rid, tokens in
             (("x", _tokens(5, 300)), ("y", _tokens(6, 520)), ("z", _tokens(7, 397)))]
    batches = _serve(rig, [req for req, _ in items], chunk_tokens=4096)
    assert batches == [[("x", 0, 300), ("y", 0, 520), ("z", 0, 397)]]
    assert _check_every_planned_state(rig, numerics, items) == sum(len(req._hs_plan) for req, _ in items)


def test_a_prefill_kernel_without_per_chunk_states_is_refused_at_model_load(rig_for):
    """SGLang's CuTe DSL prefill (SM10x) returns no `h`: HiState must refuse it when the backend is built,
    never reach a pass whose capture slots it cannot fill."""
    import types

    from histate.sglang_plugin.capture_forward import check_extend_kernel

    rig = rig_for("fp32")  # the backend was built through the hook: SGLang's Triton GDN kernel passes
    assert type(rig.backend.kernel_dispatcher.extend_kernel).__name__ == "TritonGDNKernel"

    class CuteDSLGDNKernel:  # the name SGLang's class has; what matters is that it is not a capturing one
        pass

    backend = types.SimpleNamespace(kernel_dispatcher=types.SimpleNamespace(extend_kernel=CuteDSLGDNKernel()))
    with pytest.raises(RuntimeError, match="--linear-attn-prefill-backend triton"):
        check_extend_kernel(None, backend)


@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_a_prefill_mixed_with_running_decodes_keeps_every_planned_state(rig_for, numerics, monkeypatch):
    """`--enable-mixed-chunk`: a prompt's pass carries the running requests' decode rows, appended after
    the prefill rows by SGLang's own `mix_with_running` (one token each, untracked), and the round's
    budgets lose one token per decode row (`num_mixed_decode_tokens`). Every state the prompt planned must
    still be the cold one (its per-chunk rows come first in `h`; the decode rows add one each), and each
    decode row must leave its request's running state exactly as a cold prefill over its prompt and the
    token it decoded does: HiState's capture writes must not touch it. (`prepare_for_decode` pins its
    track mask before the host-to-device copy; with no accelerator, pinning is the identity here.)"""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)
    _, tol = TOLERANCE[numerics]  # a 200 + 1 split rounds unlike one 201-token pass: not bit-identical
    rig = rig_for(numerics)
    cache = rig.cache
    decoders = [("d", _tokens(8, 200), [11, 12]), ("e", _tokens(9, 333), [13, 14])]
    running_reqs = [rig.request(rid, tokens, max_new_tokens=4, decoded=out) for rid, tokens, out in decoders]
    adder, chunked = prefill_round(cache, rig.pools.allocator, PAGE, None, running_reqs, rem_chunk_tokens=4096)
    assert adder.can_run_list == running_reqs and chunked is None
    running = rig.forward(running_reqs)
    for req, (_, _, out) in zip(running_reqs, decoders):  # batch_result_processor.py:393, then the sample
        checkpoint_kv_cache(req, cache)
        req.output_ids.append(out[0])
    running.filter_batch()

    tokens = _tokens(10, 600)
    req = rig.request("n", tokens)
    adder, chunked = prefill_round(cache, rig.pools.allocator, PAGE, None, [req], rem_chunk_tokens=4096,
                                   running_batch=running, num_mixed_decode_tokens=len(running_reqs))
    assert adder.can_run_list == [req] and chunked is None
    assert adder.rem_chunk_tokens == 4096 - len(running_reqs) - 608  # the prompt in whole 16-token pages
    batch = rig.forward([req], running=running)
    assert [r.rid for r in batch.reqs] == ["n", "d", "e"] and batch.extend_lens == [600, 1, 1]
    assert batch.forward_mode.name == "MIXED"
    assert req._hs_plan == [128, 256, 384, 512, 576]
    metrics = cache.histate.metrics.totals
    assert metrics[("captures_total", "extra")] >= 4  # the prompt's four interior states, in this pass

    for decoder, (rid, prompt, out) in zip(running_reqs, decoders):
        want = rig.cold_layer_state(rid, len(prompt) + 1)
        for name, got, ref in zip(("conv", "ssm"), rig.working_state(decoder), want):
            diff = (got.to(torch.float64) - ref.to(torch.float64)).abs().max().item()
            assert diff <= tol, f"{rid} after its mixed decode row, {name}: {diff:.3g} > {tol}"

    checkpoint_kv_cache(req, cache)
    req.finished_reason = FINISH_LENGTH(length=0)
    release_kv_cache(req, cache, checkpoint=True)
    assert _check_every_planned_state(rig, numerics, [(req, tokens)]) == 5
    for decoder in running_reqs:
        decoder.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(decoder, cache, checkpoint=True)
    cache.sanity_check()
