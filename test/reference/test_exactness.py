"""Resuming through HiState's tiers is exact: every request of an agent workload -- appends, forks,
truncations inside earlier messages, rewind-and-edit, returns after demotion to CPU and SSD -- gives the
logits of a cold full prefill, while the executor's bytes mirror the core's placement after every step.

fp64 (float64 weights and GDN kernels): max |diff| <= 1e-12. fp32: <= 1e-5. A checkpoint one token off
must fail the check, or the check proves nothing.
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from histate.core import Tier  # noqa: E402
from histate.reference.exactness import TOLERANCE, max_logit_diff  # noqa: E402
from histate.reference.executor import ReferenceExecutor  # noqa: E402
from histate.reference.hybrid_cache import Checkpoint  # noqa: E402
from histate.reference.ssd import open_ssd  # noqa: E402
from histate.reference.workloads import agent_mutation_workload  # noqa: E402

# Tier sizes in KV pages (one page = 64 tokens = 64 KiB in fp32; a checkpoint = 1.8 pages). Small on
# purpose, so eviction, demotion and SSD round trips really happen: "roomy" keeps about two sessions'
# KV on the GPU and two on the CPU, with an SSD that never fills; "tight" also fills the SSD, so
# checkpoints and KV are dropped and later hits fall back to whatever survived.
CAPACITY_PAGES = {
    "roomy": {Tier.GPU: 20, Tier.CPU: 20, Tier.SSD: 400},
    "tight": {Tier.GPU: 20, Tier.CPU: 12, Tier.SSD: 40},
}
CASES = [("histate", "roomy"), ("histate", "tight"), ("histate-exclusive", "roomy"), ("vllm-disk", "roomy"),
         ("sglang-hicache", "roomy")]


def _executor(runner, policy, ssd_dir, capacity_name="roomy", **kwargs):
    page_bytes = runner.geometry.kv_page_size_bytes
    capacity = {t: n * page_bytes for t, n in CAPACITY_PAGES[capacity_name].items()}
    return ReferenceExecutor(runner, policy, capacity, open_ssd(str(ssd_dir), capacity[Tier.SSD]), **kwargs)


@pytest.fixture(scope="session")
def served_workload(runners, cold_runs, tmp_path_factory):
    """(numerics, policy, capacity) -> ([(request, served, diff)], executor), replayed once per session; the
    mirror and the core's invariants are checked after every request (a mismatch raises here)."""
    memo = {}

    def get(numerics, policy, capacity_name="roomy"):
        key = (numerics, policy, capacity_name)
        if key not in memo:
            runner = runners(numerics)
            executor = _executor(runner, policy, tmp_path_factory.mktemp(f"ssd-{numerics}-{policy}"), capacity_name)
            rows = []
            for request in agent_mutation_workload():
                cold = cold_runs(numerics, request.token_ids)
                served = executor.serve(request.token_ids, request.now_s, cold.decode_tokens)
                executor.check_mirror()
                executor.cache.check_invariants()
                rows.append((request, served, max_logit_diff(served, cold)))
            memo[key] = (rows, executor)
        return memo[key]

    yield get
    for _, executor in memo.values():
        executor.close()


@pytest.mark.parametrize("policy,capacity_name", CASES)
@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_every_request_matches_a_cold_prefill(numerics, policy, capacity_name, served_workload):
    rows, _ = served_workload(numerics, policy, capacity_name)
    failures = [(r.label, r.session, s.num_reused_pages, d) for r, s, d in rows if d > TOLERANCE[numerics]]
    assert not failures, f"resumed logits differ from cold prefill beyond {TOLERANCE[numerics]}: {failures}"
    assert sum(s.num_reused_pages for _, s, _ in rows) > 0


# Where HiState's checkpoints can be when a hit uses them: device (terminal) or SSD (historical, and the
# written-through copy of a terminal); the host tier holds KV (docs/policies.md, "Tiering"). The
# exclusive variant moves checkpoints through the host too, which keeps that transport under test.
CHECKPOINT_TIERS = {"histate": {Tier.GPU, Tier.SSD}, "histate-exclusive": {Tier.GPU, Tier.CPU, Tier.SSD}}


@pytest.mark.parametrize("policy", sorted(CHECKPOINT_TIERS))
@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_histate_workload_covers_every_hit_type_through_every_tier(numerics, policy, served_workload):
    rows, executor = served_workload(numerics, policy)
    hits = [(r, s) for r, s, _ in rows if s.num_reused_pages > 0]
    hit_labels = {r.label for r, _ in hits}
    assert {"append", "fork", "truncate", "rewind-edit", "return"} <= hit_labels
    # Checkpoints were restored from each tier they can be in, and KV was found in each tier at match time.
    assert {s.checkpoint_tier for _, s in hits} == CHECKPOINT_TIERS[policy]
    assert {t for _, s in hits for t in s.kv_pages_by_tier_at_match} == {Tier.GPU, Tier.CPU, Tier.SSD}
    # Mutations hit inside cached KV: the checkpoint used sits before the end of the KV match (where the
    # controller had already planned a checkpoint at that page, c == m is correct too, hence `any`: HiState
    # plans one at the first truncation point here, its exclusive variant does not).
    assert any(s.num_reused_pages < s.num_kv_pages for r, s in hits if r.label in ("truncate", "rewind-edit"))
    # Some prefill produced several checkpoints, and a later hit used an intermediate one of those.
    intermediate = {(r.session, d) for r, s, _ in rows for d in s.planned_checkpoint_pages[:-1]}
    assert intermediate, "the interval controller planned no intermediate checkpoint"
    assert any((r.session, s.num_reused_pages) in intermediate for r, s in hits)
    # Data went down to SSD and came back: direct SSD puts of historical checkpoints, and either copies
    # (write-through) or demotions on the way down and promotions back to the GPU.
    ops = {(a, k, src, dst) for (a, k, src, dst) in executor.op_counts}
    assert ("put", "checkpoint", None, Tier.SSD) in ops
    if policy == "histate":
        # KV written through to the host only; the SSD takes what the host evicts (its victim tier)
        assert {("copy", "kv", Tier.GPU, Tier.CPU), ("move", "kv", Tier.CPU, Tier.SSD),
                ("copy", "checkpoint", Tier.GPU, Tier.SSD), ("drop", "checkpoint", Tier.GPU, None)} <= ops
        assert ("copy", "kv", Tier.GPU, Tier.SSD) not in ops
        assert ("copy", "kv", Tier.CPU, Tier.GPU) in ops or ("copy", "kv", Tier.SSD, Tier.GPU) in ops
    else:
        assert ("move", "kv", Tier.CPU, Tier.SSD) in ops and ("move", "kv", Tier.SSD, Tier.GPU) in ops
        assert ("move", "checkpoint", Tier.GPU, Tier.CPU) in ops and ("move", "checkpoint", Tier.CPU, Tier.SSD) in ops


def test_hits_after_eviction_fall_back_to_surviving_checkpoints(served_workload):
    rows, executor = served_workload("fp32", "histate", "tight")
    dropped = {(k, src) for (a, k, src, _), n in executor.op_counts.items() if a == "drop"}
    assert ("checkpoint", Tier.SSD) in dropped and ("kv", Tier.SSD) in dropped
    late = rows[len(rows) // 2:]
    assert any(0 < s.num_reused_pages < s.num_kv_pages for _, s, _ in late)


def test_write_through_policy_restores_copies_from_lower_tiers(served_workload):
    rows, executor = served_workload("fp32", "vllm-disk")
    assert ("copy", "kv", Tier.SSD, Tier.GPU) in executor.op_counts
    assert any(s.checkpoint_tier is Tier.SSD for _, s, _ in rows if s.num_reused_pages)


def _off_by_one(runner):
    """A fault: the state after position-1 tokens, presented as the checkpoint at `position`."""

    def fault(token_ids, checkpoint):
        fault.calls += 1
        shifted = runner.checkpoint_by_prefill(token_ids, checkpoint.position - 1)
        return Checkpoint(checkpoint.position, shifted.conv, shifted.ssm)

    fault.calls = 0
    return fault


@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_a_checkpoint_one_token_off_fails_the_check(numerics, runners, cold_runs, tmp_path):
    runner = runners(numerics)
    fault = _off_by_one(runner)
    executor = _executor(runner, "histate", tmp_path, checkpoint_fault=fault)
    first, second = agent_mutation_workload()[:2]
    executor.serve(first.token_ids, first.now_s)
    cold = cold_runs(numerics, second.token_ids)
    served = executor.serve(second.token_ids, second.now_s, cold.decode_tokens)
    assert served.num_reused_pages > 0 and fault.calls >= 1  # the shifted checkpoint was put in the cache
    assert max_logit_diff(served, cold) > 100 * TOLERANCE["fp32"]
    executor.close()


def test_lost_ssd_objects_become_misses_and_results_stay_exact(runners, cold_runs, tmp_path):
    """Objects deleted behind the executor's back (a storage fault) are reported to the core and the
    request is served from what survives: never a wrong state, and still equal to a cold prefill."""
    runner = runners("fp32")
    executor = _executor(runner, "histate", tmp_path)
    requests = agent_mutation_workload()
    for request in requests[:4]:
        executor.serve(request.token_ids, request.now_s)
    ssd_ckpt, ssd_kv = executor.checkpoint_stores[Tier.SSD], executor.kv_stores[Tier.SSD]
    assert ssd_ckpt.names, "workload prefix put no checkpoint on SSD"
    for key in list(ssd_ckpt.names):
        ssd_ckpt.store.delete(f"ckpt-{key.hex()}")
    for key in list(ssd_kv.names):
        ssd_kv.store.delete(f"kv-{key.hex()}")
    for request in requests[4:]:
        cold = cold_runs("fp32", request.token_ids)
        served = executor.serve(request.token_ids, request.now_s, cold.decode_tokens)
        assert max_logit_diff(served, cold) <= TOLERANCE["fp32"]
        executor.check_mirror()
        executor.cache.check_invariants()
    assert executor.num_lost_objects > 0
    # Every loss reached the core: the SSD copy, and the copy a failed promotion from it was to make.
    assert executor.cache.stats.num_lost_reported == executor.num_copies_forgotten >= executor.num_lost_objects
    executor.close()
