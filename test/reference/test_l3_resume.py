"""Two reference workers sharing one L3 store: a session's next turn on the other worker resumes from
the terminal bundle the first worker left there, and is exactly a cold prefill (fp64: <= 1e-12).

Each worker is a ReferenceExecutor with its own tiers and SSD directory; the store is a real
Mooncake master and store service on 127.0.0.1 (histate.l3.services). Faults -- the store service
killed between the turns, the state object gone while its KV stays, a foreign object under a key --
must turn into a shorter hit or a miss with the same output, never an error. The core's mirror and
invariants are checked after every request.

Hand counts (page = 64 tokens; a request's page keys cover tokens [0, L-1)): turn 1 of 300 tokens has
4 full pages, and HiState's terminal checkpoint ends there, so worker A's bundle is KV pages 0-3 plus
the state at page 4 (5 objects). Turn 2 (turn 1 + 40 tokens, 340) has 5 pages: worker B resumes 4
pages = 256 tokens from L3 and puts only what it adds (KV page 4 and the state at page 5).
"""
import random
import uuid

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("histate_kernels")

from histate.core import Tier  # noqa: E402
from histate.l3 import services  # noqa: E402
from histate.reference.exactness import TOLERANCE, max_logit_diff  # noqa: E402
from histate.reference.executor import ReferenceExecutor  # noqa: E402
from histate.reference.l3_tier import L3Tier, kv_object_name, state_object_name  # noqa: E402
from histate.reference.page_keys import page_keys  # noqa: E402
from histate.reference.ssd import open_ssd  # noqa: E402

NUMERICS = "fp64"
PAGE_NUM_TOKENS = 64
CAPACITY_PAGES = {Tier.GPU: 20, Tier.CPU: 20, Tier.SSD: 400}

_rng = random.Random(18)
TURN_0 = [_rng.randrange(512) for _ in range(150)]     # 2 pages: a shorter earlier turn
TURN_1 = TURN_0 + [_rng.randrange(512) for _ in range(150)]  # 300 tokens: 4 pages
TURN_2 = TURN_1 + [_rng.randrange(512) for _ in range(40)]   # 340 tokens: 5 pages
KEYS_1 = page_keys(TURN_1[:-1], PAGE_NUM_TOKENS)


def _mooncake():
    reason = services.unavailable_reason()
    if reason:
        pytest.skip(reason)
    return services.LoopbackMooncake(segment_size_bytes=32 * 2**20)


@pytest.fixture(scope="module")
def mooncake():
    with _mooncake() as mc:
        yield mc


@pytest.fixture
def own_mooncake():
    """A store of its own, for the test that kills the store service."""
    with _mooncake() as mc:
        yield mc


class Workers:
    """Worker A and worker B (separate tiers and SSD directories) and a raw client, all on one
    store under a key prefix of their own (tests sharing a store do not see each other's objects)."""

    def __init__(self, runner, mooncake, tmp_path, policy="histate"):
        from histate.l3.client import L3Client

        self.prefix = f"t-{uuid.uuid4().hex[:8]}"
        page_bytes = runner.geometry.kv_page_size_bytes
        capacity = {t: n * page_bytes for t, n in CAPACITY_PAGES.items()}
        self.executors = {}
        for name in "AB":
            ssd = open_ssd(str(tmp_path / f"ssd-{name}"), capacity[Tier.SSD])
            l3 = L3Tier(L3Client(mooncake.master_address, key_prefix=self.prefix))
            self.executors[name] = ReferenceExecutor(runner, policy, capacity, ssd, l3=l3)
        self.raw = L3Client(mooncake.master_address, key_prefix=self.prefix)

    def serve(self, name, token_ids, now_s, cold):
        executor = self.executors[name]
        served = executor.serve(token_ids, now_s, cold.decode_tokens)
        executor.check_mirror()
        executor.cache.check_invariants()
        return served

    def l3_stats(self, name):
        return self.executors[name].l3.stats

    def close(self):
        for executor in self.executors.values():
            executor.close()
            executor.l3.client.close()
        self.raw.close()


@pytest.fixture
def workers(runners, mooncake, tmp_path):
    w = Workers(runners(NUMERICS), mooncake, tmp_path)
    yield w
    w.close()


def _assert_cold_exact(served, cold):
    """Logits within the fp64 tolerance of a cold prefill, and the same greedy tokens."""
    assert max_logit_diff(served, cold) <= TOLERANCE[NUMERICS]
    logits = [served.last_logits, *served.decode_logits]
    assert [int(x.argmax()) for x in logits[:-1]] == list(cold.decode_tokens)


def test_turn_two_on_another_worker_resumes_from_the_first_workers_bundle(workers, cold_runs):
    cold_1, cold_2 = cold_runs(NUMERICS, TURN_1), cold_runs(NUMERICS, TURN_2)
    first = workers.serve("A", TURN_1, 1.0, cold_1)
    assert (first.num_reused_pages, first.num_l3_pages) == (0, 0)
    assert workers.l3_stats("A").objects_put == 5  # KV pages 0-3 and the state at page 4

    second = workers.serve("B", TURN_2, 2.0, cold_2)
    assert (second.num_reused_pages, second.num_l3_pages) == (0, 4)  # 256 tokens from L3
    assert 4 in second.planned_checkpoint_pages  # the core took L3's state as captured at page 4
    _assert_cold_exact(second, cold_2)
    assert workers.l3_stats("B").objects_put == 2  # KV page 4 and the state at page 5

    again = workers.serve("B", TURN_2, 3.0, cold_2)  # now a local hit: the state at 5 is B's own
    assert (again.num_reused_pages, again.num_l3_pages) == (5, 0)
    _assert_cold_exact(again, cold_2)


def test_l3_extends_a_local_hit(workers, cold_runs):
    """B holds turn 0 locally (state at page 2); A served turn 1 (state at page 4): B's turn 2 reuses
    2 pages locally and 2 more from L3."""
    workers.serve("B", TURN_0, 1.0, cold_runs(NUMERICS, TURN_0))
    workers.serve("A", TURN_1, 2.0, cold_runs(NUMERICS, TURN_1))
    cold_2 = cold_runs(NUMERICS, TURN_2)
    second = workers.serve("B", TURN_2, 3.0, cold_2)
    assert (second.num_reused_pages, second.num_l3_pages) == (2, 2)
    _assert_cold_exact(second, cold_2)


def test_store_service_killed_between_turns_is_a_miss(runners, own_mooncake, tmp_path, cold_runs):
    w = Workers(runners(NUMERICS), own_mooncake, tmp_path)
    try:
        w.serve("A", TURN_1, 1.0, cold_runs(NUMERICS, TURN_1))
        own_mooncake.kill_store()
        cold_2 = cold_runs(NUMERICS, TURN_2)
        second = w.serve("B", TURN_2, 2.0, cold_2)
        assert second.num_l3_pages == 0
        _assert_cold_exact(second, cold_2)
        # B's new objects (KV page 4, the state at 5) find no segment. A put of a key the master still
        # lists from the dead segment (pages 0-3, until the master notices) is accepted as a no-op by
        # Mooncake: counted as put, read back as a miss -- faults stay misses either way.
        assert w.l3_stats("B").object_put_failures >= 2
    finally:
        w.close()


def test_kv_without_its_state_is_no_resume_point(workers, cold_runs):
    workers.serve("A", TURN_1, 1.0, cold_runs(NUMERICS, TURN_1))
    assert workers.raw.remove(state_object_name(KEYS_1[3]))
    assert all(workers.raw.exists_many([kv_object_name(k) for k in KEYS_1]))  # every KV page stays
    cold_2 = cold_runs(NUMERICS, TURN_2)
    second = workers.serve("B", TURN_2, 2.0, cold_2)
    assert second.num_l3_pages == 0
    _assert_cold_exact(second, cold_2)


def test_a_lost_terminal_state_falls_back_to_an_earlier_bundles_state(workers, cold_runs):
    """A served turns 0 and 1 (states at pages 2 and 4 in L3); with the state at 4 gone, B resumes 2
    pages: the hit is shorter, still whole."""
    workers.serve("A", TURN_0, 1.0, cold_runs(NUMERICS, TURN_0))
    workers.serve("A", TURN_1, 2.0, cold_runs(NUMERICS, TURN_1))
    assert workers.raw.remove(state_object_name(KEYS_1[3]))
    cold_2 = cold_runs(NUMERICS, TURN_2)
    second = workers.serve("B", TURN_2, 3.0, cold_2)
    assert second.num_l3_pages == 2
    _assert_cold_exact(second, cold_2)


@pytest.mark.parametrize("corrupted", ["state at page 4", "KV page 1"])
def test_a_foreign_object_under_a_key_is_a_miss(workers, cold_runs, corrupted):
    """Bytes another program put under one of the bundle's keys (listed, but not a HiState frame):
    the listing promises 4 pages, the reads deliver none whole."""
    workers.serve("A", TURN_1, 1.0, cold_runs(NUMERICS, TURN_1))
    name = state_object_name(KEYS_1[3]) if corrupted.startswith("state") else kv_object_name(KEYS_1[1])
    assert workers.raw.remove(name)
    assert workers.raw._store.put(workers.raw.key(name), b"foreign bytes, not a frame" * 100) == 0
    cold_2 = cold_runs(NUMERICS, TURN_2)
    second = workers.serve("B", TURN_2, 2.0, cold_2)
    assert second.num_l3_pages == 0
    _assert_cold_exact(second, cold_2)
    stats = workers.l3_stats("B")
    assert (stats.listed_pages, stats.shortened_hits, stats.hits) == (4, 1, 0)
    assert workers.executors["B"].l3.client.stats.corrupt == 1


TURN_3 = TURN_2 + [_rng.randrange(512) for _ in range(200)]  # 540 tokens: 8 pages


@pytest.mark.parametrize("policy", ["histate", "histate-exclusive", "vllm-disk", "sglang-hicache", "marconi"])
def test_a_session_alternating_between_workers_is_exact_under_every_policy_kind(runners, mooncake, tmp_path,
                                                                                cold_runs, policy):
    """Turns 0-3 go A, B, A, B. Each turn resumes its own worker's latest state locally and the other
    worker's newer bundle from L3: (local, L3) pages (0, 0), (0, 2), (2, 2), (4, 1). Block-granular,
    write-back and exclusive placements all take the L3 state as a captured one (mirror checked)."""
    w = Workers(runners(NUMERICS), mooncake, tmp_path, policy)
    try:
        resumed = []
        for i, turn in enumerate([TURN_0, TURN_1, TURN_2, TURN_3]):
            cold = cold_runs(NUMERICS, turn)
            served = w.serve("AB"[i % 2], turn, float(i), cold)
            _assert_cold_exact(served, cold)
            resumed.append((served.num_reused_pages, served.num_l3_pages))
        assert resumed == [(0, 0), (0, 2), (2, 2), (4, 1)]
    finally:
        w.close()



def test_bundles_the_master_evicted_are_misses_and_every_answer_stays_exact(runners, tmp_path, cold_runs):
    """A 16 MiB store (Mooncake's smallest) holds about ten 600-token bundles (fp64: 9 KV pages of
    128 KiB and a state): worker A writes twenty-four, so the master evicts the oldest (approximately
    LRU). Worker B then serves every session's next turn, newest first: each resumes all 9 pages from L3 or none,
    the newest bundle is still whole and the oldest is gone, and every answer equals a cold prefill."""
    reason = services.unavailable_reason()
    if reason:
        pytest.skip(reason)
    rng = random.Random(7)
    sessions = [[rng.randrange(512) for _ in range(600)] for _ in range(24)]
    with services.LoopbackMooncake(segment_size_bytes=services.MIN_SEGMENT_SIZE_BYTES) as small:
        w = Workers(runners(NUMERICS), small, tmp_path)
        try:
            for i, turn_1 in enumerate(sessions):
                w.serve("A", turn_1, 1.0 + i, cold_runs(NUMERICS, turn_1))
            l3_pages = []  # newest first: B's own writes evict too, so the oldest are read last
            for i, turn_1 in reversed(list(enumerate(sessions))):
                turn_2 = turn_1 + [rng.randrange(512) for _ in range(40)]
                cold_2 = cold_runs(NUMERICS, turn_2)
                second = w.serve("B", turn_2, 100.0 + i, cold_2)
                _assert_cold_exact(second, cold_2)
                l3_pages.append(second.num_l3_pages)
        finally:
            w.close()
    assert set(l3_pages) <= {0, 9}, l3_pages
    assert l3_pages[0] == 9 and l3_pages[-1] == 0, l3_pages  # the newest whole, the oldest gone
