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
(a request that resumes from another's checkpoint), and several requests in one batch, at the rig's
16-token page on the Triton layout of the kernel's per-chunk states `h`; then pages of 64, 128 and 256
tokens on both layouts, Triton's and FlashInfer's (`gdn_kernels.FlashInferGDNKernel`, whose `h` follows the
checkpoint plan in the forward metadata: issue F1), and the plugin's plan handling and refusals alone.
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

    def build(numerics: str, intervals: str = "128", **rig_args) -> GdnRig:
        return GdnRig(numerics, resolve_config({"enable": True, "intervals_tokens": intervals}, {}), **rig_args)

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
        adder, new_chunked = prefill_round(cache, rig.pools.allocator, rig.page, chunked, pending,
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


def _check_every_planned_state(rig: GdnRig, numerics: str, reqs_tokens: list, model_level: str = "all") -> int:
    """`model_level`: where to compare with the reference model's own cold prefill too ("all" planned
    positions, or each request's "deepest"); every position is compared with the per-layer cold prefill."""
    layer_tol, model_tol = TOLERANCE[numerics]
    checked = 0
    for req, tokens in reqs_tokens:
        assert req._hs_captures == []  # every capture slot went into the tree
        for position in req._hs_plan:
            got = rig.tree_state(tokens, position)
            assert got is not None, f"{req.rid}: no state at planned position {position}"
            references = [(rig.cold_layer_state(req.rid, position), layer_tol)]
            if model_level == "all" or position == req._hs_plan[-1]:
                references.append((rig.cold_model_state(tokens, position), model_tol))
            for want, tol in references:
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


@pytest.mark.parametrize("page", [64, 128, 256])
@pytest.mark.parametrize("kernel", ["triton", "flashinfer"])
def test_every_page_size_on_both_kernel_layouts_keeps_every_planned_state(rig_for, kernel, page):
    """Issue F1. SGLang tracks on its cache grid, max(64, page) tokens (`mamba_cache_chunk_size()`), and
    HiState captures on it too. Triton's `h` is one row per 64-token chunk whatever the page. FlashInfer's
    `h` is whatever checkpoint plan the metadata holds: a pass whose deepest planned position is inside it
    makes SGLang track an interior row, for which SGLang builds its own plan, one row per page-size step
    (not per 64 tokens) at page 128/256; a pass whose deepest planned position is its end gets HiState's
    own plan. Here both happen, at every page size, on both layouts:
      * x (1100 tokens) and y (700) in one pass: deepest planned positions inside the pass (SGLang's plan),
        y's rows after x's in `h`;
      * z (900 tokens, 512-token chunks): its first pass ends on its deepest planned position in it.
    Every planned state must be in the tree and equal a cold prefill; nothing may raise in the forward
    (before the fix, FlashInfer at page 128 and 256 raised on x and y's pass)."""
    rig = rig_for("fp32", intervals="256", page=page, prefill_kernel=kernel)
    grid = rig.grid
    items = [(rig.request(rid, tokens), tokens) for rid, tokens in (("x", _tokens(11, 1100)), ("y", _tokens(12, 700)))]
    batches = _serve(rig, [req for req, _ in items], chunk_tokens=4096)
    z_tokens = _tokens(13, 900)
    z = rig.request("z", z_tokens)
    batches += _serve(rig, [z], chunk_tokens=512)
    items.append((z, z_tokens))
    assert batches == [[("x", 0, 1100), ("y", 0, 700)], [("z", 0, 512)], [("z", 512, 900)]]
    x, y = items[0][0], items[1][0]
    assert x._hs_plan[-1] < 1100 and y._hs_plan[-1] < 700  # the deepest planned positions are inside the pass
    assert 256 in z._hs_plan and 512 in z._hs_plan  # z's first pass: an extra capture, and its end tracked
    metrics = rig.cache.histate.metrics.totals
    assert metrics[("captures_total", "unfilled")] == 0
    assert metrics[("captures_total", "extra")] == sum(len(r._hs_plan) for r, _ in items) - 4  # 4 passes track one
    if kernel == "flashinfer":
        plans = set(rig.backend.kernel_dispatcher.extend_kernel.plans)
        # SGLang's plan for x and y (its own grid), then HiState's for z's first pass (the same grid).
        assert (grid, (0, 1100 // grid, 1100 // grid + 700 // grid)) in plans and (grid, (0, 512 // grid)) in plans
        assert {every for every, _ in plans} == {grid}
    planned = sum(len(r._hs_plan) for r, _ in items)
    assert _check_every_planned_state(rig, "fp32", items, model_level="deepest") == planned


class _FakeCapture:
    def __init__(self, slot: int):
        self.slot = torch.tensor([slot])
        self.conv_layers, self.ssm_layers = set(), set()


def _extend(kernel, inputs, lengths, plan=None):
    """One FlashInfer-stand-in extend over `lengths` from zero states: (h rows or None, final states)."""
    q, k, v, g, beta = inputs
    heads, dim = v.shape[2], v.shape[3]
    pool = torch.zeros(len(lengths), heads, dim, k.shape[3], dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    fields = {} if plan is None else dict(state_checkpoint_every_n_tokens=plan[0],
                                          state_checkpoint_cu_starts=torch.tensor(plan[1]),
                                          num_state_checkpoints=plan[1][-1])
    _, _, h = kernel.extend(q, k, v, g, beta, ssm_states=pool, cache_indices=torch.arange(len(lengths)),
                            query_start_loc=cu, **fields)
    return (None if h is None else h.squeeze(0)), pool


def test_a_capture_off_sglangs_checkpoint_grid_refines_its_plan_and_keeps_its_own_row(sglang_plugins):
    """The plugin's captures are on SGLang's grid, so SGLang's FlashInfer plan always holds them; if one
    were not (a capture 128 tokens in at page 256), the plugin replaces the plan by a finer one before the
    forward and moves SGLang's own `track_ssm_h_src` with it. SGLang's plan here is its own code's
    (`maybe_build_flashinfer_checkpoint_plan`); `h` comes from the FlashInfer stand-in under each plan.
    SGLang's tracked rows must hold the same states before and after, and every kept capture's row the
    state a cold prefill to it ends with; captures no row can hold are left out, not raised on."""
    import types

    from sglang.srt.layers.attention.linear.kernels.gdn_flashinfer import maybe_build_flashinfer_checkpoint_plan

    from histate.sglang_plugin.capture_forward import FLASHINFER, select_captures
    from sglang_cpu.pools import publish_server_args

    publish_server_args(page_size=256, chunk_tokens=256)  # mamba_cache_chunk_size() = 256
    lengths = [600, 300, 1000]
    forward_batch = types.SimpleNamespace(
        extend_seq_lens=torch.tensor(lengths), extend_prefix_lens=torch.tensor([0, 0, 0]),
        mamba_track_mask=torch.tensor([True, False, True]),
        mamba_track_seqlens=torch.tensor([512 + 1, -1, 768 + 1]))  # schedule_batch.py:3149-3163: p + 1
    metadata = types.SimpleNamespace(track_ssm_h_src=torch.tensor([0, 0]), track_ssm_h_dst=torch.tensor([7, 8]))
    maybe_build_flashinfer_checkpoint_plan(forward_batch, metadata, "cpu")
    old_plan = (metadata.state_checkpoint_every_n_tokens, metadata.state_checkpoint_cu_starts.tolist())
    old_src = metadata.track_ssm_h_src.clone()
    assert old_plan == (256, [0, 2, 3, 6]) and old_src.tolist() == [1, 5]

    wanted = [(0, 128), (0, 384), (2, 512), (2, 640), (1, 300), (1, 100), (2, 1000)]  # the last three: no row
    captures = [(row, relative, _FakeCapture(i)) for i, (row, relative) in enumerate(wanted)]
    backend = types.SimpleNamespace(mamba_chunk_size=64, device="cpu",
                                    kernel_dispatcher=types.SimpleNamespace(extend_uses_state_checkpoints=True))
    rows, held, dropped = select_captures(backend, metadata, captures, lengths)
    assert [(r, rel) for r, rel, _ in held] == wanted[:4] and [(r, rel) for r, rel, *_ in dropped] == wanted[4:]
    assert rows.layout == FLASHINFER and rows.spacing == 128 and rows.offsets == (0, 4, 6, 13)
    assert metadata.state_checkpoint_cu_starts.tolist() == [0, 4, 6, 13] and metadata.num_state_checkpoints == 13

    gen = torch.Generator().manual_seed(0)
    total, heads, dim = sum(lengths), 2, 8
    q, k, v = (torch.randn(1, total, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, total, heads, generator=gen, dtype=torch.float64))
    beta = torch.rand(1, total, heads, generator=gen, dtype=torch.float64)
    kernel = gdn_kernels.FlashInferGDNKernel()
    h_old, _ = _extend(kernel, (q, k, v, g, beta), lengths, old_plan)
    h_new, _ = _extend(kernel, (q, k, v, g, beta), lengths,
                       (128, metadata.state_checkpoint_cu_starts.tolist()))
    assert h_new.shape[0] == rows.num_rows
    assert torch.equal(h_new[metadata.track_ssm_h_src], h_old[old_src])  # SGLang's rows: the same states
    starts = [0, 600, 900]
    for row, relative in [(0, 512), (2, 768)] + wanted[:4]:  # SGLang's tracked positions, then the captures
        cold_inputs = [t[:, starts[row]:starts[row] + relative] for t in (q, k, v, g, beta)]
        _, cold = _extend(kernel, cold_inputs, [relative])
        index = rows.index(row, relative)
        assert torch.equal(h_new[index], cold[0]), (row, relative)
        if (row, relative) in [(0, 512), (2, 768)]:
            assert index in metadata.track_ssm_h_src.tolist()


def test_a_kernel_returning_other_rows_drops_the_captures_without_raising(sglang_plugins):
    """A pass whose `h` does not have the rows the plan promised writes no capture (they stay unfilled: the
    cache frees them) and raises nothing: a raise inside the forward takes SGLang's scheduler down."""
    import types

    from histate.sglang_plugin.capture_forward import CaptureIndices, track_extend_around

    capture = _FakeCapture(3)
    indices = CaptureIndices(h_src=torch.tensor([1]), dst=torch.tensor([3]), conv_src=torch.zeros(1, 3),
                             num_h_rows=4, captures=(capture,), layer_id=0)
    ssm_states = torch.zeros(5, 2, 2)
    metadata = types.SimpleNamespace(_hs_capture=indices)
    calls = []
    for h in (torch.ones(1, 3, 2, 2), None):
        track_extend_around(lambda *args, **kwargs: calls.append(1), None, None, h, ssm_states, metadata)
    assert len(calls) == 2 and capture.ssm_layers == set() and not ssm_states.any()
    track_extend_around(lambda *args, **kwargs: None, None, None, torch.ones(1, 4, 2, 2), ssm_states, metadata)
    assert not capture.ssm_layers  # the layer that copied a conv window was reset by the refused copies
    assert ssm_states[3].eq(1).all() and not ssm_states[[0, 1, 2, 4]].any()


def test_captures_the_forward_did_not_fill_never_enter_the_tree(rig_for, monkeypatch):
    """Fault injection (issue 27, R0): the capture list is dropped on its way to the backend, as SGLang's
    eager runner dropped it (`dataclasses.replace` of a ForwardBatch whose captures rode on an undeclared
    attribute). The slots hold whatever an earlier state left, so none may be inserted: each is freed
    and counted 'unfilled', and the only states in the tree are the ones SGLang's own track filled."""
    import histate.sglang_plugin.capture as capture

    monkeypatch.setattr(capture, "carrier_class", lambda base: base)  # the field is undeclared again
    rig = rig_for("fp32")
    tokens = _tokens(1, 600)
    free_before = rig.pools.mamba_allocator.available_size()
    req = rig.request("a", tokens)
    _serve(rig, [req])
    metrics = rig.cache.histate.metrics.totals
    assert metrics[("captures_total", "extra")] == 4
    assert metrics[("captures_total", "unfilled")] == 4  # the fault fired, and every extra capture was caught
    assert req._hs_plan == [128, 256, 384, 512, 576]
    assert [p for p in req._hs_plan if rig.tree_state(tokens, p) is not None] == [576]  # SGLang's own track
    want = rig.cold_layer_state(req.rid, 576)
    for got, ref in zip(rig.tree_state(tokens, 576), want):
        assert (got.to(torch.float64) - ref.to(torch.float64)).abs().max().item() <= TOLERANCE["fp32"][0]
    rig.cache.sanity_check()
    assert rig.pools.mamba_allocator.available_size() >= free_before - 2  # unfilled slots went back
