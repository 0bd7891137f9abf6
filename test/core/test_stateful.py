"""Hypothesis stateful test: random request life cycles and evictions for every policy, with every
numbered invariant (docs/invariants.md) checked after every step, plus behaviour checks:
  - pinned data is never evicted (I9): an open lease's reused prefix stays restorable;
  - every reported hit is restorable (I6);
  - `unlimited` agrees with a brute-force model (c = m = longest previously inserted prefix);
  - reference counts return to zero when no request is open (I5).
"""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from histate.core import ItemKind, Tier, available_policies, make_cache

from .helpers import CKPT_BYTES, KV_PAGE_BYTES, assert_restorable, tiny_config

KEYS = st.lists(st.integers(0, 3), min_size=1, max_size=24)


def machine_for(policy_name: str):
    class CacheMachine(RuleBasedStateMachine):
        @initialize(gpu=st.integers(8, 40), cpu=st.integers(0, 40), ssd=st.integers(0, 80),
                    block=st.sampled_from([1, 3]))
        def build(self, gpu, cpu, ssd, block):
            # block > 1 matters to block-granular policies only (vLLM's whole-block hits)
            self.cache = make_cache(policy_name, tiny_config(gpu, cpu, ssd, tau_s=5.0, block_pages=block))
            self.now = 0.0
            self.leases = []
            self.reservations = []  # (bytes, tier) held by simulated running requests
            self.inserted = set()  # brute-force model for `unlimited`: every inserted prefix

        def tick(self):
            self.now += 1.0
            return self.now

        @rule(keys=KEYS)
        def begin(self, keys):
            lease = self.cache.begin_request(keys, self.tick())
            assert_restorable(self.cache, keys, lease.match)
            if policy_name == "unlimited":
                m = max((n for n in range(len(keys) + 1) if tuple(keys[:n]) in self.inserted), default=0)
                assert lease.match.num_kv_pages == lease.match.num_reused_pages == m
            self.leases.append(lease)

        @precondition(lambda self: self.leases)
        @rule(index=st.integers(0, 7), use_plan=st.booleans(), extra=st.lists(st.integers(1, 24), max_size=3),
              output=st.lists(st.integers(0, 3), max_size=6), steps=st.lists(st.integers(1, 24), max_size=3))
        def finish(self, index, use_plan, extra, output, steps):
            """Finish with the output's pages appended (engines cache decode KV and states)."""
            lease = self.leases.pop(index % len(self.leases))
            keys = list(lease.page_keys) + output
            positions = (self.cache.plan_checkpoints(lease, step_end_pages=sorted(steps), output_end_pages=len(keys))
                         if use_plan else [len(keys)])
            self.cache.finish_request(lease, keys, self.tick(), list(positions) + extra)
            if policy_name == "unlimited":
                self.inserted.update(tuple(keys[:n]) for n in range(len(keys) + 1))

        @precondition(lambda self: self.leases)
        @rule(index=st.integers(0, 7))
        def abort(self, index):
            self.cache.abort_request(self.leases.pop(index % len(self.leases)))

        @rule(tier=st.sampled_from(list(Tier)), num_pages=st.integers(1, 12))
        def evict(self, tier, num_pages):
            if self.cache.ledger.has_tier(tier):
                self.cache.evict(tier, num_pages * KV_PAGE_BYTES, self.tick())

        @precondition(lambda self: not self.leases)  # executors abort before reporting (docs/core-api.md)
        @rule(keys=KEYS, depth=st.integers(1, 24), kind=st.sampled_from(list(ItemKind)), tier=st.sampled_from(list(Tier)))
        def lose(self, keys, depth, kind, tier):
            depth = min(depth, len(keys))
            path, pos, partial = self.cache.tree.walk(keys[:depth])
            segment = partial if partial is not None else (path[-1] if path else None)
            start = segment.start_pages if segment is not None else 0
            if self.cache.report_lost(keys, depth, kind, tier, self.tick()) and policy_name == "unlimited":
                # the lost KV segment began at `start`: every cached prefix through its first page is gone
                cut = tuple(keys[: start + 1])
                self.inserted = {p for p in self.inserted if p[: start + 1] != cut}

        @rule(tier=st.sampled_from(list(Tier)), num_pages=st.integers(1, 30))
        def reserve(self, tier, num_pages):
            """A running request claims memory outside the cache: granted exactly when free +
            evictable bytes cover it, and then it fits (I1 with reservations)."""
            cache = self.cache
            if not cache.ledger.has_tier(tier):
                return
            size = num_pages * KV_PAGE_BYTES
            coverable = cache.free_bytes(tier) + cache.evictable_bytes(tier)
            granted = cache.reserve(size, self.tick(), tier)
            if size > coverable:
                assert not granted
            if granted:
                self.reservations.append((size, tier))
                assert cache.free_bytes(tier) >= 0

        @precondition(lambda self: self.reservations)
        @rule(index=st.integers(0, 7))
        def release(self, index):
            size, tier = self.reservations.pop(index % len(self.reservations))
            self.cache.release(size, tier)

        @rule(keys=KEYS)
        def match_is_pure_and_restorable(self, keys):
            before = (self.cache.ledger.used_bytes.copy(), self.cache.tree.num_nodes)
            result = self.cache.match(keys)
            assert (self.cache.ledger.used_bytes, self.cache.tree.num_nodes) == before
            assert_restorable(self.cache, keys, result)

        @invariant()
        def invariants_hold(self):
            self.cache.check_invariants()

        @invariant()
        def pinned_prefixes_survive(self):
            for lease in self.leases:
                again = self.cache.match(lease.page_keys)
                assert again.num_kv_pages >= lease.match.num_reused_pages
                assert_restorable(self.cache, lease.page_keys, lease.match)

        def teardown(self):
            for lease in self.leases:
                self.cache.abort_request(lease)
            for size, tier in self.reservations:
                self.cache.release(size, tier)
            assert all(v == 0 for v in self.cache.ledger.reserved_bytes.values())
            assert all(v == 0 for v in self.cache.ledger.protected_bytes.values())  # I10 with no pins
            self.cache.check_invariants()  # I5: all reference counts back to zero
            assert all(node.lock_count == 0 for node in self.cache.tree.iter_nodes())

    CacheMachine.__name__ = f"CacheMachine_{policy_name}"
    return CacheMachine


@pytest.mark.parametrize("policy_name", available_policies())
def test_random_operation_sequences_keep_invariants(policy_name):
    run = machine_for(policy_name).TestCase("runTest")
    run.settings = settings(settings.default, stateful_step_count=50)  # profile's examples x 50 steps
    run.runTest()
