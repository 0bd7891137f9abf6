"""OrphanObjects: SSD objects no node knows, deleted lowest frozen score first (ssd_tier.py)."""
from __future__ import annotations

from histate.sglang_plugin.orphans import UNKNOWN_SCORE, OrphanObjects


def test_groups_go_lowest_score_first_and_restart_objects_before_all():
    orphans = OrphanObjects()
    orphans.add(["kv/a", "kv/b"], 100, 5.0)
    orphans.add(["mamba/b"], 544, 3.0)
    orphans.add(["kv/old"], 7, UNKNOWN_SCORE)
    assert len(orphans) == 4 and orphans.lowest_score() == UNKNOWN_SCORE
    assert orphans.in_order() == [("kv/old", 7), ("mamba/b", 544), ("kv/a", 100), ("kv/b", 100)]
    assert orphans.pop_lowest() == (("kv/old",), 7)
    assert orphans.pop_lowest() == (("mamba/b",), 544)
    assert orphans.pop_lowest() == (("kv/a", "kv/b"), 100)
    assert orphans.pop_lowest() is None and orphans.lowest_score() is None and len(orphans) == 0


def test_a_claimed_key_is_never_handed_out():
    orphans = OrphanObjects()
    orphans.add(["kv/a", "kv/b"], 100, 1.0)
    orphans.add(["kv/c"], 100, 2.0)
    orphans.claim(["kv/a"])  # a live node wrote it again
    assert "kv/a" not in orphans and orphans.keys() == {"kv/b", "kv/c"}
    assert [k for k, _ in orphans.in_order()] == ["kv/b", "kv/c"]
    assert orphans.lowest_keys(1000, lambda key: True) == ["kv/b", "kv/c"]  # the store's thread: same
    assert orphans.pop_lowest() == (("kv/b",), 100)
    orphans.claim(["kv/c"])
    assert orphans.lowest_score() is None and orphans.pop_lowest() is None  # an emptied group is skipped


def test_a_key_orphaned_again_belongs_to_its_newest_group():
    orphans = OrphanObjects()
    orphans.add(["kv/a"], 100, 1.0)
    orphans.add(["kv/a"], 100, 9.0)  # cached anew, deleted again later: the newer score counts
    assert len(orphans) == 1
    assert orphans.lowest_score() == 9.0  # the older group owns nothing any more
    assert orphans.pop_lowest() == (("kv/a",), 100) and len(orphans) == 0


def _ranks_reduce(sets):
    """`agree_common_ids` on every rank of a simulated group, its collectives applied element-wise
    (MIN/MAX) across the ranks in lockstep; returns each rank's answer."""
    import threading

    from histate.sglang_plugin.orphans import agree_common_ids

    barrier, slots, answers = threading.Barrier(len(sets)), [None] * len(sets), [None] * len(sets)

    def run(rank):
        def reduce(values, minimum):
            slots[rank] = list(values)
            barrier.wait()
            combined = [min(col) if minimum else max(col) for col in zip(*slots)]
            assert all(len(s) == len(values) for s in slots)  # the same sizes on every rank
            barrier.wait()
            return combined

        answers[rank] = agree_common_ids(sets[rank], reduce)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(sets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def test_objects_held_by_every_rank_are_agreed_exactly():
    sets = [{5, 7, 9, 11}, {7, 9, 13}, {1, 7, 9, 11, 13}]
    for _ in range(5):  # any rank may propose (random nonce): the answer is the intersection
        assert _ranks_reduce(sets) == [{7, 9}] * 3
    assert _ranks_reduce([set(), {3}]) == [set(), set()]
    assert _ranks_reduce([{3, 4}]) == [{3, 4}]  # one rank: its own objects


def test_rank_free_ids_ignore_nothing_but_the_rank_suffix():
    from histate.sglang_plugin.orphans import rank_free_id

    assert rank_free_id("kv/abc") == rank_free_id("kv/abc") > 0
    assert rank_free_id("kv/abc") != rank_free_id("mamba/abc")


def test_the_store_threads_walk_takes_the_lowest_in_order_without_sorting():
    """`lowest_keys` (SGLang's backup thread) walks the heap through its positions; it must hand out
    exactly the prefix of the deletion order (`in_order`, a plain sort) that covers the bytes asked,
    skipping claimed keys and those `keep` refuses."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        orphans, refused = OrphanObjects(), set()
        for g in range(rng.randrange(1, 40)):
            keys = [f"kv/{g}-{i}" for i in range(rng.randrange(1, 4))]
            orphans.add(keys, rng.choice([10, 100]), rng.choice([UNKNOWN_SCORE, rng.random(), 0.5]))
            if rng.random() < 0.2:
                orphans.claim(keys[:1])
            if rng.random() < 0.2:
                refused.add(keys[-1])
        need = rng.randrange(1, 2000)
        want, covered = [], 0
        for key, size_bytes in orphans.in_order():
            if covered >= need:
                break
            if key not in refused:
                want.append(key)
                covered += size_bytes
        assert orphans.lowest_keys(need, lambda key: key not in refused) == want
