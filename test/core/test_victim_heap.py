"""VictimHeap (core/victims.py): a look ahead leaves the heap as it found it.

The SSD tier looks ahead on the host heap every step the host is nearly full (`SsdTier.demote`, through
`TierVictims.peek`). It used to put what it saw back as new entries, behind every entry of the same
score: under a clock that does not move (every unit last used at the same time: ties everywhere) the
unit the look ahead saw was never the one evicted, and test_hicache_tiers'
`test_the_ssd_takes_the_kv_the_host_evicts_and_serves_it_back` kept its first prompt on the host 1
run in ~10, depending on how many steps the backup threads' timing gave it.
"""
from histate.core.types import UnitKind
from histate.core.victims import VictimHeap


class _Node:
    def __init__(self, name: str):
        self.name, self.version, self.is_alive, self.is_parked = name, 0, True, False

    def __repr__(self) -> str:
        return self.name


def _rank_all_equal(node, unit, tier_index):
    return 1.0


def _drain(heap: VictimHeap) -> list:
    out = []
    while (victim := heap.pop_lowest(_rank_all_equal)) is not None:
        out.append(victim[0].name)
    return out


def test_a_look_ahead_keeps_the_order_of_equal_scores():
    heap = VictimHeap()
    a, b, c = _Node("a"), _Node("b"), _Node("c")
    for node in (a, b, c):
        heap.push(node, UnitKind.BUNDLE, 1, 1.0)
    seen = heap.peek_lowest(_rank_all_equal, None, lambda node, unit: node is b)
    assert [node.name for node, _ in seen] == ["a", "b"]
    assert _drain(heap) == ["a", "b", "c"]  # before: c, a, b


def test_a_look_ahead_keeps_every_entry_and_its_score():
    heap = VictimHeap()
    nodes = [_Node(str(i)) for i in range(6)]
    for i, node in enumerate(nodes):
        heap.push(node, UnitKind.BUNDLE, 1, float(i % 3))
    before = sorted(heap.entries, key=lambda e: (e[0], e[1]))
    changes = heap.changes
    heap.peek_lowest(lambda n, u, t: float(int(n.name) % 3), None, lambda node, unit: node is nodes[4])
    assert sorted(heap.entries, key=lambda e: (e[0], e[1])) == before and heap.changes > changes
