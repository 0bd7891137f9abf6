"""One HiState: the SGLang plugin and the simulator's `histate` on the same request stream.

Plugin side: the GDN rig (sglang_cpu/gdn_rig.py): SGLang's PrefillAdder, ScheduleBatch, ForwardBatch and
GDN backend with HiState's hooks, real HiCache host pools and storage threads with HiState's SSD backend
(sglang_cpu/hicache.py; only the D<->H copy engine is a CPU stand-in), the scheduler's steps around each
request (the SSD-restore hold, load-back, backup acknowledgements). Simulator side: the replay's own
`CacheGate` over `HybridPrefixCache("histate")`, with the pass ends the simulator's SGLang engine makes
(`core.floor_cut` on the same chunk budget) and the same clock. Sizes, intervals, tau and restore costs
are the plugin's. One request at a time, with room on every tier (no eviction: under pressure the two
engines cannot reach the same trees, test_fidelity.py says why and checks each eviction decision).

After every request both hold the same thing:
  * the pass ends (the plugin's PrefillAdder cuts = the simulator engine's rule);
  * the reused and KV-matched lengths at admission (the plugin's after SGLang's host load-back and
    HiState's SSD restore);
  * the checkpoint positions on the request's path, and each one's tiers: the device copy of a terminal
    checkpoint, SSD for all, and no device copy of a historical one (a state's host copy is a staging
    slot in the plugin and no cache tier in the simulator, so it is not compared);
  * the KV tiers of every page on the path: device, host and SSD (write-through, inclusive).
The same stream runs a third time under `--hicache-write-policy write_back` against the simulator's
`histate-writeback`: nothing is copied to the host in either, each checkpoint goes to the SSD at creation
(the plugin's state-only writes through a host staging slot, sglang_plugin/state_writes.py) and is homed
there once historical, and positions, reuse, misses, tiers and states agree as above. Under eviction the placement is
checked on the plugin's side alone (test_write_back.py: every state exact, none left without a copy;
test_write_back_host_pressure.py: SGLang's host-duplicate reclaim, the rule the simulator keeps in
`Evictor.reclaim_host_duplicates`, test/core/test_host_duplicates.py).
And the plugin's states are the right ones: every checkpoint with a device copy on the request's path,
looked at after each insert (before the next scheduler step can home a historical one to SSD) and after
the prompt, equals in both its conv window and its recurrent state, bit for bit (float32, the same
arithmetic: test_capture.py's layer-level tolerance), each GDN layer prefilled cold from nothing to that
position (`GdnRig.cold_layer_state`: no SGLang code, no pool, no capture). That covers every state a
pass captured (tracked and extra) and every state a request resumed from, including the ones restored
from SSD (the stream has such restores; counted) and loaded back from the host.
Outputs are not decoded here (the rig runs prefills), so the simulator caches no output
(`EngineConfig(caches_outputs=False)`); decode states are covered by test_tree_cache.py.
"""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from histate.core import (CPU_BIT, GPU_BIT, SSD_BIT, CacheConfig, HybridPrefixCache, MissHistory, MissRecorder, Tier,
                          floor_cut, make_policy, with_host_write_policy)
from histate.sim.admission import CacheGate, engine_profile
from histate.sim.costs import get_model
from histate.sim.engine import EngineConfig, EngineRequest
from histate.sim.workloads import AgentWorkloadConfig, agent_workload

from ._scheduler_round import serve_request
from sglang_cpu import gdn_kernels
from sglang_cpu.gdn_rig import GRID, GdnRig

CHUNK = 512  # --chunked-prefill-size of both sides
# float32 states against a cold prefill: test_capture.py's model-level float32 tolerance. A pass that
# resumes from a pool state starts from a contiguous copy where a cold prefill carries a transposed view,
# which rounds the last bits differently (measured: at most ~1e-9 here), so not bit-identical.
STATE_TOLERANCE = 1e-5
NUM_NEIGHBOUR_CHECKS = 10
TRACE = AgentWorkloadConfig(
    num_sessions=4, num_turns=6, system_prompt_num_tokens=4 * GRID, first_input_num_tokens=(8 * GRID, 20 * GRID),
    append_num_tokens=(2 * GRID, 9 * GRID), output_num_tokens=(8, 40), truncation_rate=0.2, rewind_edit_rate=0.2,
    fork_rate=0.1, compaction_rate=0.0, cut_granularity_num_tokens=2 * GRID, page_num_tokens=GRID,
    max_context_num_tokens=None, seed=5)


# Application-placed checkpoints (docs/hints.md): every request names the end of a 5-page system prompt,
# a position eq. 5's grid (even page counts here) never plans, sent to the plugin through SGLang's
# custom_params as a client would.
HINTED_TRACE = dataclasses.replace(TRACE, system_prompt_num_tokens=5 * GRID, hint_system_prompt=True)


def _stream(trace: AgentWorkloadConfig = TRACE):
    per_session = [s.requests for s in agent_workload(trace, name="differential").iter_sessions()]
    for turn in itertools.zip_longest(*per_session):
        yield from (r for r in turn if r is not None)


class _Tokens:
    """Page keys -> token ids below the reference model's vocabulary, GRID per page; a request's tail
    past its last full page gets tokens of its own."""

    def __init__(self):
        self.pages = {}

    def __call__(self, request) -> list:
        out = []
        for key in request.page_keys:
            if key not in self.pages:
                rng = random.Random(repr(key))
                self.pages[key] = [rng.randrange(512) for _ in range(GRID)]
            out.extend(self.pages[key])
        rng = random.Random(f"tail{request.uid}")
        return out + [rng.randrange(512) for _ in range(request.input_num_tokens - len(out))]


def _pass_ends(start: int, end: int) -> list:
    """The simulator's SGLang engine for a lone request: CHUNK tokens a step, cuts floored to the grid."""
    ends = []
    while start < end:
        cut = min(start + CHUNK, end)
        if cut < end:
            cut = floor_cut(start, cut, GRID)
        ends.append(cut)
        start = cut
    return ends


def _sim(rig: GdnRig, policy: str = "histate"):
    runtime = rig.cache.histate
    config = runtime.core_config
    host = rig.cache.host_pool_group.get_pool(_pool_name("KV"))
    cpu_bytes = host.size * config.kv_bytes_per_token
    cache = HybridPrefixCache(
        CacheConfig(page_num_tokens=GRID, kv_bytes_per_token=config.kv_bytes_per_token,
                    checkpoint_size_bytes=config.checkpoint_size_bytes, tau_s=config.tau_s,
                    supported_intervals_pages=config.supported_intervals_pages,
                    restore_cost_tokens=config.restore_cost_tokens,
                    capacity_bytes={Tier.GPU: config.capacity_bytes[Tier.GPU], Tier.CPU: cpu_bytes,
                                    Tier.SSD: config.capacity_bytes[Tier.SSD]}),
        # as `ReplayConfig.rules`: `histate` on a short host is the server that picks write_back
        with_host_write_policy(make_policy(policy), config.capacity_bytes[Tier.GPU], cpu_bytes, has_ssd=True,
                               has_l3=False))
    # SGLang matches at most a prompt's first L-1 tokens (the last one is always prefilled for its logits)
    engine = EngineConfig(caches_outputs=False, matches_last_prompt_token=False)
    profile = engine_profile(cache.policy, get_model("tiny-qwen3.5"), engine, GRID)
    misses = MissHistory(max_keys=None)
    cache.observer = MissRecorder(misses)
    return cache, CacheGate(cache, profile, misses=misses)


def _pool_name(name: str):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return getattr(PoolName, name)


class _ColdStates:
    """Checks the device states on a request's path against cold prefills (module docstring); each
    distinct prefix is prefilled once, however often its state is looked at."""

    def __init__(self, rig: GdnRig):
        self.rig = rig
        self.cold: dict = {}  # (position, prefix tokens) -> (conv, ssm)
        self.checked: set = set()  # the distinct (position, prefix) states compared
        self.max_diff = 0.0

    def device_states(self, tokens: list) -> list:
        """(position, mamba slot) of every node on `tokens`' path holding a device state."""
        out, node, depth = [], self.rig.cache.tree_core.root_node, 0
        while depth < len(tokens):
            child = next((c for c in node.children.values()
                          if list(c.key.token_ids[:len(c.key)]) == tokens[depth:depth + len(c.key)]), None)
            if child is None:
                break
            node, depth = child, depth + len(child.key)
            value = node.component_data[2].value
            if value is not None:
                out.append((depth, int(value[0])))
        return out

    def check(self, rid: str, tokens: list, positions_seen: set) -> None:
        for position, slot in self.device_states(tokens):
            key = (position, tuple(tokens[:position]))
            if key not in self.cold:
                self.cold[key] = self.rig.cold_layer_state(rid, position)
                assert all(t.grad_fn is None for t in self.cold[key])  # a kept state holds no recompute graph
            for name, got, want in zip(("conv", "ssm"), self.rig.slot_state(slot), self.cold[key]):
                diff = (got.double() - want.double()).abs().max().item()
                assert diff <= STATE_TOLERANCE, f"{rid}: the {name} state at {position} is {diff:.3g} off a cold prefill"
                self.max_diff = max(self.max_diff, diff)
            if len(self.checked) < NUM_NEIGHBOUR_CHECKS and key not in self.checked and position > GRID:
                # the tolerance tells states one kernel chunk apart from each other by far
                neighbour = self.rig.cold_layer_state(rid, position - GRID)[1]
                assert (neighbour.double() - self.cold[key][1].double()).abs().max().item() > 100 * STATE_TOLERANCE
            self.checked.add(key)
            positions_seen.add(position)


def _plugin_path(rig: GdnRig, tokens: list, num_pages: int) -> list:
    """Per page of `tokens`: (KV tier bits, checkpoint tier bits at the page's end or None)."""
    from histate.sglang_plugin.core_nodes import core_of

    out, node, depth = [], rig.cache.tree_core.root_node, 0
    while len(out) < num_pages:
        child = next((c for c in node.children.values()
                      if list(c.key.token_ids[:len(c.key)]) == tokens[depth:depth + len(c.key)]), None)
        if child is None:
            break
        node, depth = child, depth + len(child.key)
        core = core_of(node)
        while (len(out) + 1) * GRID <= depth:
            end = (len(out) + 1) * GRID == depth
            out.append((core.kv_mask, (core.ckpt_mask & ~CPU_BIT) if end and core.ckpt_mask else None))
    return out


def _sim_path(cache: HybridPrefixCache, keys: tuple) -> list:
    path, _, _ = cache.tree.walk(list(keys))
    out = []
    for node in path:
        for page in range(node.depth_pages - node.num_pages + 1, node.depth_pages + 1):
            end = page == node.depth_pages
            out.append((node.kv_mask, node.ckpt_mask if end and node.ckpt_mask else None))
    return out


# (hinted, SGLang's --hicache-write-policy, the simulator policy that models the plugin under it); "auto":
# the flag not given, on a host KV pool 1.5x the device's, where both pick write_back by themselves
CASES = [(False, "write_through", "histate"), (True, "write_through", "histate"),
         (False, "write_back", "histate-writeback"), (False, "auto", "histate")]


@pytest.mark.parametrize("hinted, write_policy, sim_policy", CASES, ids=["plain", "hinted", "write_back", "auto"])
def test_the_plugin_and_the_simulators_histate_agree_on_every_request(sglang_plugins, monkeypatch, tmp_path, hinted,
                                                                     write_policy, sim_policy):
    from histate.sglang_plugin.checkpoint_hints import HINTS_KEY
    from histate.sglang_plugin.config import resolve_config

    gdn_kernels.install(monkeypatch)
    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "256MiB", "intervals_tokens": "128,256,512,1024",
                             "miss_reasons": True}, {})
    clock = [0.0]
    # KV of 1 KiB per token: a checkpoint is ~112 tokens of KV (N_s), so eq. 5 plans interior positions.
    rig = GdnRig("fp32", config, mamba_slots=400, kv_tokens=1 << 15, hicache_ratio=1.5 if write_policy == "auto" else 4.0,
                 clock=lambda: clock[0], kv_heads=4, kv_head_dim=32, write_policy=write_policy)
    sim, gate = _sim(rig, sim_policy)
    write_back = write_policy != "write_through"
    assert rig.cache.is_write_back == write_back  # "auto": the plugin switched by itself ...
    assert sim.policy.kv_write_through_tiers == (() if write_back else (Tier.CPU,))  # ... and so did the simulator
    tokens_of = _Tokens()
    compared = checkpoints = homed = resumed = 0
    reasons_seen: set = set()
    states = _ColdStates(rig)
    resumed_at_hint = 0
    for i, request in enumerate(_stream(HINTED_TRACE if hinted else TRACE)):
        clock[0] = float(i)
        tokens = tokens_of(request)
        # simulator
        gate.register(request)
        admitted = gate.admit(EngineRequest(request.uid, request.input_num_tokens, request.input_num_tokens, 1),
                              request.input_num_tokens, clock[0], idle=True)
        match = gate.first_match(request.uid)
        sim_misses = dict(gate.first_misses(request.uid).tokens_by_reason)
        sim_ends = _pass_ends(request.input_num_tokens - admitted.num_compute_tokens, request.input_num_tokens)
        gate.finish(request.uid, sim_ends, clock[0])
        # plugin
        req = rig.request(f"r{i}", tokens)
        if request.checkpoint_hint_tokens:
            req.sampling_params.custom_params = {HINTS_KEY: list(request.checkpoint_hint_tokens)}
        seen: set = set()
        plugin_ends = serve_request(rig, req, CHUNK, lambda: states.check(req.rid, tokens, seen))
        rig.forget(req.rid)
        # every state this request planned and the state it resumed from were among those compared
        assert set(req._hs_plan) <= seen, (i, sorted(set(req._hs_plan) - seen))
        if req._hs_admitted[0]:
            assert req._hs_admitted[0] in seen, (i, req._hs_admitted)
            resumed += 1
        assert states.checked, "no state was compared"
        assert plugin_ends == sim_ends, (i, plugin_ends, sim_ends)
        reused, branch = req._hs_admitted
        assert reused == match.num_reused_pages * GRID, (i, reused, match)
        if hinted and request.index == 0 and i > 0:
            # a later session's first turn shares exactly the system prompt with the first session's,
            # whose pass kept the named state there: it resumes at the hint, in both
            assert reused == HINTED_TRACE.system_prompt_num_tokens, (i, reused)
            resumed_at_hint += 1
        # the same miss reasons, request by request (core/misses.py; no eviction here: no_prefix,
        # no_checkpoint and page_boundary)
        assert dict(req._hs_misses.tokens_by_reason) == sim_misses, (i, req._hs_misses, sim_misses)
        assert sum(sim_misses.values()) == request.input_num_tokens - reused
        reasons_seen |= {reason for reason, tokens in sim_misses.items() if tokens}
        assert (branch or reused) // GRID == max(match.num_kv_pages, match.num_reused_pages), (i, branch, match)
        sim_path = _sim_path(sim, request.page_keys)
        plugin_path = _plugin_path(rig, tokens, len(sim_path))
        assert plugin_path == sim_path, (i, [(k, a, b) for k, (a, b) in enumerate(zip(plugin_path, sim_path)) if a != b],
                                         len(plugin_path), len(sim_path))
        for kv, ckpt in sim_path:
            # write-through to the host; the SSD takes KV only when the host runs short (not here)
            # write_back copies no KV below the device until it evicts (nothing does here)
            assert kv == (GPU_BIT if write_back else GPU_BIT | CPU_BIT)
            checkpoints += ckpt is not None
            homed += ckpt == SSD_BIT
        compared += 1
    # The stream exercises what it compares (counts of this seeded run: 24 requests, 47 planned interior
    # positions, 160 checkpoints on request paths, 136 of them historical and on SSD alone).
    assert compared == 24 and homed >= 100 and checkpoints - homed >= 20
    assert resumed_at_hint == (HINTED_TRACE.num_sessions - 1 if hinted else 0)
    assert reasons_seen == {"no_prefix", "no_checkpoint", "page_boundary"}, reasons_seen
    assert gate.stats.captured_interior == gate.stats.planned_interior >= 30
    assert gate.stats.off_grid == 0
    # Both learned the same reuse-position prior from the same matches: the plugin's token-unit matches
    # and the simulator's pages put the same far interior hits in the same depth bins.
    plugin_bins = rig.cache.histate.state.depth_prior.bins_in(0, 1 << 20)
    assert plugin_bins and plugin_bins == sim.state.depth_prior.bins_in(0, 1 << 20)
    assert rig.cache.histate.state.near_end_probs == sim.state.near_end_probs
    # States: every captured and resumed state compared with a cold prefill (this seeded run: 85 distinct
    # states, 22 requests resumed from one, 16 of those from an SSD restore; max |diff| 9.3e-10).
    restores = rig.cache.histate.metrics.totals.get(("ssd_restores_total", "ok"), 0)
    print(f"states compared: {len(states.checked)} distinct, {resumed} resumed, {restores} SSD restores, "
          f"max |diff| {states.max_diff:.3g}")
    assert len(states.checked) >= 80 and resumed >= 20  # 85, 22 (write_back too)
    assert restores >= 10  # write_through: 16
    rig.cache.sanity_check()
