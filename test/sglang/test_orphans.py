"""OrphanObjects: SSD objects no node knows, deleted lowest frozen score first (ssd_tier.py)."""
from __future__ import annotations

from histate.sglang_plugin.orphans import UNKNOWN_SCORE, OrphanObjects


def test_groups_go_lowest_score_first_and_restart_objects_before_all():
    orphans = OrphanObjects()
    orphans.add(["kv/a", "kv/b"], 100, 5.0)
    orphans.add(["mamba/b"], 544, 3.0)
    orphans.add(["kv/old"], 7, UNKNOWN_SCORE)
    assert len(orphans) == 4 and orphans.lowest_score() == UNKNOWN_SCORE
    orphans.refresh_snapshot()
    assert orphans.snapshot == (("kv/old", 7), ("mamba/b", 544), ("kv/a", 100), ("kv/b", 100))
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
    orphans.refresh_snapshot()
    assert [k for k, _ in orphans.snapshot] == ["kv/b", "kv/c"]
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
