"""Every eviction takes the lowest eq. 7 score of its pool at that moment, checked by brute force over
the whole tree -- including the evictions inside one `make_room` pass, where the re-ranks that earlier
evictions cause are deferred to the end of the pass (issue 11's batch eviction).

The lazy heaps are exact only if every change that can lower a unit's score re-offers the unit. This
test caught one that did not: a checkpoint appearing at a node lowered the cost of the checkpointed
units below it behind checkpoint-less nodes, which were not re-offered (`units.checkpoint_neighbours`).
The learned parameters (q, the near-end prior) also move scores, globally, on every match; re-keying
every heap on each move would cost a pass over all units per request, so they are frozen here and their
drift is a documented approximation (docs/design.md, "Victim heaps: what is exact").
"""
import random

import pytest

from histate.core import CacheObserver, ItemKind, PolicyState, Tier, UnitKind, make_cache, units_of

from .helpers import serve, tiny_config


class MinimumOracle(CacheObserver):
    """At each eviction: the victim's score against every evictable unit of the same pool."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.checked = 0
        self.in_pass = 0  # evictions while re-ranks from earlier evictions of the pass were pending

    def on_unit_evicted(self, node, unit, tier, now_s, terms) -> None:
        evictor = self.cache.evictor
        state, ledger = evictor.state, self.cache.ledger
        pool = ledger.pool_of(tier, ItemKind.KV if unit is UnitKind.BUNDLE else ItemKind.CHECKPOINT)
        scores = []
        for other in self.cache.tree.iter_nodes():
            if other.lock_count or other.is_parked:  # pinned, or stuck until touched or unlocked (I7)
                continue
            for other_unit, t in units_of(other, evictor.partitioned):
                other_kind = ItemKind.KV if other_unit is UnitKind.BUNDLE else ItemKind.CHECKPOINT
                if ledger.has_tier(Tier(t)) and ledger.pool_of(Tier(t), other_kind) == pool:
                    scores.append(state.score(other, other_unit, 1 << t))
        victim = state.score(node, unit, 1 << tier)
        assert victim <= min(scores) + 1e-6, (node, unit, tier, victim, min(scores))
        self.checked += 1
        self.in_pass += bool(evictor._deferred)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tiers", [(60, 0, 0), (40, 80, 200)], ids=["gpu-only", "gpu-cpu-ssd"])
def test_every_eviction_takes_the_pools_lowest_score(seed, tiers, monkeypatch):
    monkeypatch.setattr(PolicyState, "observe_match", lambda self, *args: None)  # freeze q and the prior
    cache = make_cache("histate", tiny_config(*tiers))
    oracle = MinimumOracle(cache)
    cache.observer = oracle
    rng = random.Random(seed)
    contexts = [[(s, 0, i) for i in range(rng.randint(2, 10))] for s in range(6)]
    for turn in range(1, 160):
        s = rng.randrange(len(contexts))
        ctx = contexts[s]
        if rng.random() < 0.15:  # truncate / rewind inside the context
            ctx = ctx[:rng.randrange(1, len(ctx) + 1)]
        contexts[s] = ctx = ctx + [(s, turn, i) for i in range(rng.randint(1, 25))]
        serve(cache, ctx, float(turn))
        cache.check_invariants()
    assert oracle.checked > 50
    if tiers[1] and seed in (0, 1, 3):
        assert oracle.in_pass > 0  # these seeds evict with re-ranks deferred (so the test covers deferral)
