"""`--histate-short-prefill-first`: short prefills before the next chunk of a long one, with aging.

Every scheduling case drives SGLang's own `Scheduler.get_new_batch_prefill` (the real
`_get_new_batch_prefill_raw`, which calls `SchedulePolicy.shortest_prefill_chunk_limit` and hands the
result to the real `PrefillAdder.add_chunked_req`) on a scheduler made with `object.__new__`
(`_scheduler_rig.py` lists what it holds), pass after pass, over HiState's tree cache on real pools.

Geometry, as in test_chunking.py: page 16, a 64-token state grid, chunk budget 1,000 tokens, a long
prompt of 4,000 tokens. Its first chunk is 960 (the budget floored to the grid). From then on, by
hand, for waiting requests of work w_i (compute tokens; no restores unless a case says so):
    reserved = sum of ceil(w_i / 16) * 16 over the leading run of short ones that fits in 1000 - 16
    limit    = (1000 - reserved) // 16 * 16          (core ShortPrefillFirst.chunk_limit)
    chunk    = floor(prefix + limit, 64) - prefix    (chunking.py's floor; the prefix is on the grid)
e.g. shorts of 100 and 150: reserved 112 + 160 = 272, limit 728 -> 720, chunk 704 (960 + 720 = 1680 -> 1664).
SGLang charges a chunk's compute in whole pages (`_update_prefill_budget`: `ceil_paged_tokens`), so a
740-token chunk leaves 1000 - 752 = 248 tokens for the rest of the pass.
"""
from __future__ import annotations

from unittest import mock

import pytest

from histate.core import Tier
from histate.sglang_plugin.cli_hooks import stashed_config

from ._scheduler_rig import GRID, PAGE, SchedulerRig, new_req

LONG = 4000
BUDGET = 1000


def _config(flag, max_yields, align, restore_costs=None):
    from histate.sglang_plugin.config import resolve_config

    values = {"enable": True, "chunk_align": align, "short_prefill_first": flag,
              "short_prefill_max_yields": max_yields if flag else None, "restore_costs": restore_costs}
    return resolve_config(values, {})


def _rig(*, flag=True, max_yields=2, align="grid", policy="fcfs", page=PAGE):
    from histate.sglang_plugin.chunking import install_chunk_planning
    from histate.sglang_plugin.short_prefill import install_short_prefill_first
    from sglang_cpu.pools import build_cache, build_pools, publish_server_args

    publish_server_args(page_size=page, chunk_tokens=GRID, mamba_radix_cache_strategy="extra_buffer",
                        pp_max_micro_batch_size=32)
    install_chunk_planning()
    install_short_prefill_first()
    pools = build_pools(32 * 1024, 96, page_size=page, max_reqs=32)
    cache = build_cache("histate", pools, histate_config=_config(flag, max_yields, align))
    assert cache.histate.grid_tokens == GRID
    return SchedulerRig(cache, pools, schedule_policy=policy, chunked_prefill_size=BUDGET)


class Shorts:
    """Short prompts with tokens of their own (no shared prefixes), named s0, s1, ..."""

    def __init__(self):
        self.count = 0

    def __call__(self, *lengths):
        reqs = []
        for n in lengths:
            first = 20_000 + 400 * self.count
            reqs.append(new_req(f"s{self.count}", range(first, first + n)))
            self.count += 1
        return reqs


def _long(n=LONG):
    return new_req("long", range(10_000, 10_000 + n))


def _long_part(batch):
    return next(((p, e) for rid, p, e in batch if rid == "long"), None)


def _others(batch):
    return sorted((rid, p, e) for rid, p, e in batch if rid != "long")


def _metric(rig, result):
    return rig.cache.histate.metrics.totals[("short_prefill_passes_total", result)]


@pytest.mark.parametrize("flag, align, first_end, batch", [
    # capped: 1000 - (112 + 160) = 728 -> 720 (pages); on the grid 960 + 720 = 1680 floors to 1664 (704 tokens)
    (True, "grid", 960, [("long", 960, 1664), ("s0", 0, 100), ("s1", 0, 150)]),
    # the same cap with SGLang's cuts (--histate-chunk-align off): 992 + 720
    (True, "off", 992, [("long", 992, 1712), ("s0", 0, 100), ("s1", 0, 150)]),
    # flag off (fcfs): the long chunk takes 960 of the budget; the 40 left cannot hold a short one
    (False, "grid", 960, [("long", 960, 1920)]),
])
def test_short_prefills_go_before_the_next_chunk_whose_cut_stays_on_the_grid(sglang_plugins, flag, align, first_end,
                                                                              batch):
    rig, shorts, long_req = _rig(flag=flag, align=align), Shorts(), _long()
    assert rig.run_pass([long_req]) == [("long", 0, first_end)]
    assert rig.run_pass(shorts(100, 150)) == batch
    if flag:
        assert _metric(rig, "capped") == 1 and long_req._hs_spf_yields == 1


@pytest.mark.parametrize("page, batch", [
    # a page of 32: reserved 128 + 160 = 288, limit (1000 - 288) // 32 * 32 = 704, 960 + 704 = 1664 on the
    # grid; SGLang charges 704, then 128 and 160 of the 296 left
    (32, [("long", 960, 1664), ("s0", 0, 100), ("s1", 0, 150)]),
    # a page as wide as the grid: reserved 128 + 192 = 320, limit (1000 - 320) // 64 * 64 = 640, 960 + 640 =
    # 1600 on the grid; SGLang charges 640, then 128 and 192 of the 360 left
    (64, [("long", 960, 1600), ("s0", 0, 100), ("s1", 0, 150)]),
])
def test_the_cap_reserves_whole_pages_of_the_servers_page_size(sglang_plugins, page, batch):
    """The case above at other page sizes: the shorts are reserved, and the cap floored, in the server's
    own pages (what SGLang's `_update_prefill_budget` charges), and the cut still lands on the grid. (A
    one-token page is not here: this rig's pools fail SGLang's own first extend at page 1, stock cache
    included, in the ping-pong track setup.)"""
    rig, shorts, long_req = _rig(page=page), Shorts(), _long()
    assert rig.pools.page_size == page
    assert rig.run_pass([long_req]) == [("long", 0, 960)]
    assert rig.run_pass(shorts(100, 150)) == batch
    assert _metric(rig, "capped") == 1


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "shortest-prefill-first"])
def test_after_max_yields_capped_passes_the_long_prefill_runs_one_pass_uncapped(sglang_plugins, policy):
    """max_yields 2; two shorts (100, 150) arrive every pass. The cap is the same under every
    --schedule-policy (stock caps only under shortest-prefill-first); only the queue order is the policy's."""
    rig, shorts, long_req = _rig(max_yields=2, policy=policy), Shorts(), _long()
    rig.run_pass([long_req])
    expected = [
        ((960, 1664), ["s0", "s1"]),    # capped (yield 1): 704
        ((1664, 2368), ["s2", "s3"]),   # capped (yield 2): 704
        ((2368, 3328), []),             # aged out: uncapped, 1000 floored to the grid (960); 40 left: s4, s5 wait
        # capped again (yield 1): s4..s7 reserve 112+160+112+160 = 544, limit 456 -> 448 (3776 is on the grid)
        ((3328, 3776), ["s4", "s5", "s6", "s7"]),
        ((3776, 4000), ["s8", "s9"]),   # 224 left <= 1000 - 272: not capped; the final chunk
    ]
    for long_part, short_rids in expected:
        batch = rig.run_pass(shorts(100, 150))
        assert _long_part(batch) == long_part
        assert [rid for rid, _, _ in _others(batch)] == short_rids
        assert all(e - p == (100 if int(rid[1:]) % 2 == 0 else 150) for rid, p, e in _others(batch))
    assert rig.scheduler.chunked_req is None
    assert long_req._hs_spf_yields == 0  # the final (uncapped) chunk cleared the count
    assert (_metric(rig, "capped"), _metric(rig, "aged")) == (3, 1)


@pytest.mark.parametrize("policy, order", [
    ("fcfs", ["s0", "s1"]),
    ("lpm", ["s0", "s1"]),  # no cached prefix on either: the sort keeps arrival order
    ("shortest-prefill-first", ["s1", "s0"]),  # SGLang's sort by uncached tokens: 100 before 150
])
def test_the_queue_order_stays_the_policys(sglang_plugins, policy, order):
    """Shorts of 150 then 100 tokens arrive: the same cap under every policy (reserved 160 + 112 = 272,
    chunk 704), admitted in the order the policy sorted the queue."""
    rig, shorts = _rig(policy=policy), Shorts()
    rig.run_pass([_long()])
    batch = rig.run_pass(shorts(150, 100))
    assert batch[0] == ("long", 960, 1664) and [rid for rid, _, _ in batch[1:]] == order


@pytest.mark.parametrize("other, batch", [
    # 740 tokens of work, exactly what the long one has left (1700 - 960): not short, and the rule stops
    # there (y is not reserved). The long prompt finishes (charged 752); the 248 left cut x at 240, on the
    # grid 192 (x is the next chunked request)
    (740, [("long", 960, 1700), ("x", 0, 192)]),
    # 739: short, and y (100) behind it too: reserved 752 + 112 = 864, limit 136 -> 128; 960 + 128 = 1088
    # is on the grid; x and y fit in the 872 left
    (739, [("long", 960, 1088), ("x", 0, 739), ("y", 0, 100)]),
])
def test_a_waiting_request_with_as_much_work_as_the_long_one_has_left_is_not_short(sglang_plugins, other, batch):
    rig = _rig()
    rig.run_pass([_long(1700)])
    assert rig.run_pass([new_req("x", range(30_000, 30_000 + other)), new_req("y", range(40_000, 40_100))]) == batch


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "shortest-prefill-first"])
@pytest.mark.parametrize("cached", [True, False])
def test_a_prompt_whose_prefix_is_cached_counts_only_what_it_computes(sglang_plugins, policy, cached):
    """A returning 1,600-token prompt whose first 1,024 tokens are cached with a checkpoint has 576 tokens of
    work: short. Under fcfs SGLang does not match the waiting queue (HiState runs SGLang's Python tree core,
    no fast match), so the hook runs the match itself; lpm and shortest-prefill-first matched it already.
    Cached: reserved 576, limit 424 -> 416, 960 + 416 floors to 1344; the prompt computes 1024..1600.
    Not cached: 1,600 tokens of work are more than one pass's budget: not short, the long chunk is whole."""
    from sglang_cpu.pools import Driver

    rig = _rig(policy=policy)
    prompt = list(range(50_000, 51_600))
    if cached:
        Driver(rig.cache, rig.pools).serve(prompt, checkpoints=[1024])
    rig.run_pass([_long()])
    batch = rig.run_pass([new_req("returning", prompt)])
    assert batch == ([("long", 960, 1344), ("returning", 1024, 1600)] if cached else [("long", 960, 1920)])


@pytest.mark.parametrize("host_cost, batch", [
    # restoring the 1,024 host tokens costs 1,024 x 1.0: work 576 + 1024 = 1600 > one pass: not short
    (1.0, [("long", 960, 1920)]),
    # 1,024 x 0.25 = 256: work 832, reserved 832, limit 168 -> 160, 960 + 160 floors to 1088; the prompt's
    # host prefix is loaded back (SGLang's init_load_back) and it computes 1024..1600 in the 872 left
    (0.25, [("long", 960, 1088), ("returning", 1024, 1600)]),
])
def test_a_prefix_on_the_host_counts_its_restore_at_the_configured_cost(sglang_plugins, host_cost, batch):
    """The returning prompt's cached 1,024 tokens (KV and checkpoint) were moved to SGLang's host tier by a
    device eviction: HiState's match records them as host tokens, and `--histate-restore-cost HOST SSD`
    prices their restore in tokens of prefill."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from histate.sglang_plugin.chunking import install_chunk_planning
    from histate.sglang_plugin.short_prefill import install_short_prefill_first
    from sglang_cpu.hicache import attach_hicache, drain_backups, hicache_server_args
    from sglang_cpu.pools import Driver, build_cache, build_pools

    server_args = hicache_server_args(PAGE, GRID, mamba_radix_cache_strategy="extra_buffer",
                                      pp_max_micro_batch_size=32)
    install_chunk_planning()
    install_short_prefill_first()
    pools = build_pools(32 * 1024, 96, max_reqs=32)
    config = _config(True, 2, "grid", restore_costs=[host_cost, 1.0])
    cache = attach_hicache(build_cache("histate", pools, histate_config=config), pools, server_args, config)
    prompt = list(range(50_000, 51_600))
    Driver(cache, pools).serve(prompt, checkpoints=[1024])
    drain_backups(cache)
    assert cache.evict(EvictParams(num_tokens=32 * 1024)).num_tokens_evicted == 1024  # device -> host
    rig = SchedulerRig(cache, pools, chunked_prefill_size=BUDGET, hicache=True)
    rig.run_pass([_long()])
    returning = new_req("returning", prompt)
    assert rig.run_pass([returning]) == batch
    assert returning._hs_reuse.kv_tokens_by_tier == {Tier.CPU: 1024}


def test_an_ssd_only_checkpoint_counts_before_sglang_can_see_it(sglang_plugins, tmp_path):
    """A 1,600-token prompt was served with checkpoints at 1,024 and 1,536; once its SSD copies are
    acknowledged, the historical one (1,024) lives on SSD alone (asymmetric tiering), its KV on the device.
    SGLang's match of a returning prompt that shares those 1,024 tokens finds nothing (its validators see
    device and host states); HiState's finds the SSD checkpoint: 576 tokens of work, short. Pass 2: reserved
    576, limit 424 -> 416, 960 + 416 floors to 1344; the prompt itself is held while its state is read (the
    scheduler's `check_prefetch_progress`), so it runs in pass 3, beside a second capped chunk (1344 + 384)."""
    from histate.sglang_plugin.chunking import install_chunk_planning
    from histate.sglang_plugin.server_settings import storage_extra_config
    from histate.sglang_plugin.short_prefill import install_short_prefill_first
    from histate.sglang_plugin.config import resolve_config
    from sglang_cpu.hicache import attach_hicache, drain_backups, hicache_server_args
    from sglang_cpu.pools import Driver, build_cache, build_pools

    config = resolve_config({"enable": True, "short_prefill_first": True, "short_prefill_max_yields": 2,
                             "ssd_dirs": [str(tmp_path)], "ssd_backend": "file", "ssd_size_bytes": "64MiB"}, {})
    server_args = hicache_server_args(PAGE, GRID, storage_extra=storage_extra_config(None, config),
                                      mamba_radix_cache_strategy="extra_buffer", pp_max_micro_batch_size=32)
    install_chunk_planning()
    install_short_prefill_first()
    pools = build_pools(32 * 1024, 96, max_reqs=32)
    cache = attach_hicache(build_cache("histate", pools, histate_config=config), pools, server_args, config)
    prompt = list(range(50_000, 51_600))
    Driver(cache, pools).serve(prompt, checkpoints=[1024, 1536])
    drain_backups(cache)
    rig = SchedulerRig(cache, pools, chunked_prefill_size=BUDGET, hicache=True)
    rig.scheduler.enable_hicache_storage = True
    rig.run_pass([_long()])
    returning = new_req("returning", prompt[:1024] + list(range(60_000, 60_576)))
    assert rig.run_pass([returning]) == [("long", 960, 1344)]
    assert returning.num_matched_prefix_tokens == 0  # SGLang's own match: nothing
    assert returning._hs_reuse.reused_tokens == 1024 and returning._hs_reuse.kv_tokens_by_tier == {Tier.GPU: 1024}
    for job in list(cache.histate.ssd_tier.restores.values()):
        job.read.result(timeout=30)  # the read on the I/O thread
    assert rig.run_pass([]) == [("long", 1344, 1728), ("returning", 1024, 1600)]


@pytest.mark.parametrize("align, batch", [
    # reserved 512 + 464 = 976, limit 24 -> 16: under one grid, so the long one keeps a grid (64);
    # the 936 left hold the 500-token short; the 460-token one would be cut next to a chunk: it waits
    ("grid", [("long", 960, 1024), ("s0", 0, 500)]),
    ("off", [("long", 992, 1008), ("s0", 0, 500), ("s1", 0, 460)]),  # SGLang's one page
])
def test_a_cap_under_one_grid_never_empties_or_unaligns_the_chunk(sglang_plugins, align, batch):
    rig, shorts = _rig(align=align), Shorts()
    rig.run_pass([_long()])
    assert rig.run_pass(shorts(500, 460)) == batch


def _replay(rig, passes, long_tokens=LONG):
    """The long prompt, then two shorts (100, 150) every pass until its prefill ended."""
    long_req, shorts = _long(long_tokens), Shorts()
    trace = [rig.run_pass([long_req])]
    for _ in range(passes):
        trace.append(rig.run_pass(shorts(100, 150)))
        if rig.scheduler.chunked_req is not long_req:
            break
    return trace


@pytest.mark.parametrize("policy, long_ends", [
    ("fcfs", [960, 1920, 2880, 3840, 4800, 5000]),
    ("lpm", [960, 1920, 2880, 3840, 4800, 5000]),
    # SGLang's own cap, capped on every pass (no aging: with it the 6th pass would run uncapped): 704 each,
    # then the final 520 (SGLang's limit, 720, is not below it)
    ("shortest-prefill-first", [960, 1664, 2368, 3072, 3776, 4480, 5000]),
])
def test_flag_off_leaves_sglangs_batches_bit_identical(sglang_plugins, policy, long_ends):
    """The same stream with the flag off, through the installed hook, and through SGLang's original method
    (the hook taken out): the same batches, request for request."""
    from sglang.srt.managers.schedule_policy import SchedulePolicy

    hooked = _replay(_rig(flag=False, policy=policy), 10, 5000)
    method = SchedulePolicy.shortest_prefill_chunk_limit
    original = getattr(method, "__wrapped__", method)  # upstream/series 0012: no hook, SGLang's method asks the cache
    with mock.patch.object(SchedulePolicy, "shortest_prefill_chunk_limit", original):
        reference = _replay(_rig(flag=False, policy=policy), 10, 5000)
    assert hooked == reference
    assert [_long_part(batch)[1] for batch in hooked] == long_ends


def _stream_until_done(rig, max_passes=60):
    """Three 300-token shorts arrive every pass after the first: they would take 3 x 304 = 912 of the
    1,000-token budget on every pass."""
    shorts, long_ends, long_req = Shorts(), [], _long()
    batch = rig.run_pass([long_req])
    long_ends.append(_long_part(batch)[1])
    while rig.scheduler.chunked_req is long_req and len(long_ends) < max_passes:
        long_ends.append(_long_part(rig.run_pass(shorts(300, 300, 300)))[1])
    return long_ends


def test_a_continuous_stream_of_shorts_cannot_starve_the_long_prefill(sglang_plugins):
    """Alone, the long prompt takes 5 passes (960 x 4 + 160). Under the stream, with max_yields 2, it
    yields two passes (64 each: limit 1000 - 912 = 88 -> 80, floored to the grid) and runs the third
    uncapped (960), so it ends within (2 + 1) x 5 = 15 passes: here 10. SGLang's own cap under
    --schedule-policy shortest-prefill-first (flag off) leaves it 64 tokens a pass until fewer than 300
    are left: 1 + 43 + 1 = 45 passes."""
    hist = _stream_until_done(_rig(max_yields=2, policy="shortest-prefill-first"))
    assert hist == [960, 1024, 1088, 2048, 2112, 2176, 3136, 3200, 3264, 4000]
    assert len(hist) <= (2 + 1) * 5
    stock = _stream_until_done(_rig(flag=False, policy="shortest-prefill-first"))
    assert stock[-1] == LONG and len(stock) == 45


def test_two_ranks_interleaved_take_the_same_decisions(sglang_plugins):
    """Two schedulers (two TP ranks) in one process, passes interleaved, the same stream: the same batches.
    (The yield count lives on each rank's own `Req`; a count kept per rid in shared state would advance
    twice per pass here.)"""
    ranks = [_rig(max_yields=2), _rig(max_yields=2)]
    streams = [Shorts(), Shorts()]
    traces = [[rig.run_pass([_long()])] for rig in ranks]
    for _ in range(5):
        for rig, shorts, trace in zip(ranks, streams, traces):
            trace.append(rig.run_pass(shorts(100, 150)))
    assert traces[0] == traces[1]
    assert [_long_part(batch) for batch in traces[0]] == [
        (0, 960), (960, 1664), (1664, 2368), (2368, 3328), (3328, 3776), (3776, 4000)]


def _simulated_long_parts(num_short_passes: int) -> list:
    """The simulator's SGLang engine (sim/engine.py) on the stream of the test above: the long prompt
    alone, then two shorts (100, 150) arriving as each pass starts, HiState's grid rule, the rig's page."""
    from histate.core import ShortPrefillFirst
    from histate.sim.costs import H100_SXM, QWEN35_9B
    from histate.sim.engine import Engine, EngineConfig, EngineRequest

    config = EngineConfig(token_budget_per_step=BUDGET, mixed_batches=False, chunk_rule="grid", block_num_tokens=GRID,
                          page_tokens=PAGE, short_prefill_first=ShortPrefillFirst(max_yields=2))
    eng = Engine(QWEN35_9B, H100_SXM, config)
    timing = eng.submit(EngineRequest("long", LONG, LONG, 1), 0.0)
    for k in range(num_short_passes + 1):
        start = eng.next_event_time()
        eng.advance_until(start)
        if k:
            for n, name in ((100, f"s{2 * k}"), (150, f"s{2 * k + 1}")):
                eng.submit(EngineRequest(name, n, n, 1), start)
        eng.advance_until(start + 1e-9)  # runs the pass that starts now, shorts included
    ends = timing.step_end_tokens
    return list(zip([0] + ends, ends))


def test_the_simulator_caps_the_same_chunks_on_the_same_stream(sglang_plugins):
    """One HiState: the plugin's passes (the real scheduler loop) and the simulator's SGLang engine cut the
    long prompt at the same places when short prompts keep arriving."""
    rig, shorts = _rig(max_yields=2), Shorts()
    plugin = [_long_part(rig.run_pass([_long()]))]
    for _ in range(5):
        plugin.append(_long_part(rig.run_pass(shorts(100, 150))))
    assert plugin == [(0, 960), (960, 1664), (1664, 2368), (2368, 3328), (3328, 3776), (3776, 4000)]
    assert _simulated_long_parts(5) == plugin


# --- flags ------------------------------------------------------------------------------------------


def test_flags_resolve_and_keep_the_schedule_policy(sglang_plugins):
    from histate.core import DEFAULT_MAX_YIELDS

    from .test_plugin_cli import _prepare

    sa = _prepare(["--enable-histate", "--histate-short-prefill-first", "--histate-short-prefill-max-yields", "3",
                   "--schedule-policy", "shortest-prefill-first"])
    cfg = stashed_config(sa)
    assert (cfg.short_prefill_first, cfg.short_prefill_max_yields) == (True, 3)
    assert sa.schedule_policy == "shortest-prefill-first"  # the queue order stays SGLang's
    default = stashed_config(_prepare(["--enable-histate"]))
    assert (default.short_prefill_first, default.short_prefill_max_yields) == (False, DEFAULT_MAX_YIELDS)
    assert stashed_config(_prepare(["--enable-histate", "--histate-short-prefill-first"])).short_prefill_max_yields \
        == DEFAULT_MAX_YIELDS


@pytest.mark.parametrize("argv, message", [
    (["--histate-short-prefill-first"], "--histate-short-prefill-first needs --enable-histate (HiState is off)"),
    (["--enable-histate", "--histate-short-prefill-max-yields", "3"],
     "--histate-short-prefill-max-yields needs --histate-short-prefill-first"),
])
def test_flag_dependencies_are_one_line_errors(sglang_plugins, capsys, argv, message):
    from .test_plugin_cli import _cli_error

    assert _cli_error(capsys, argv) == f"sglang serve: error: {message}"


def test_zero_max_yields_is_refused_and_the_env_var_path_works(sglang_plugins, capsys, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    from .test_plugin_cli import _cli_error

    line = _cli_error(capsys, ["--enable-histate", "--histate-short-prefill-first",
                               "--histate-short-prefill-max-yields", "0"])
    assert line.startswith("sglang serve: error: --histate-short-prefill-max-yields: must be >= 1")
    monkeypatch.setenv("HISTATE_ENABLE", "1")
    monkeypatch.setenv("HISTATE_SHORT_PREFILL_FIRST", "1")
    monkeypatch.setenv("HISTATE_SHORT_PREFILL_MAX_YIELDS", "7")
    sa = ServerArgs(model_path="dummy")
    sa.resolve_once()
    assert (stashed_config(sa).short_prefill_first, stashed_config(sa).short_prefill_max_yields) == (True, 7)
