"""What a server puts in the shared L3 store after a request, with which placement hints, and what
it may restore from it.

L3 is a store shared by every server of a fleet (Mooncake Store in the server; `sim/l3.py` in the
simulator). No server controls it: the master evicts approximately-LRU objects, a store service
that dies takes its segment's objects with it. So the one decision a server makes is *what to
write*, and the one guarantee a reader needs is *which prefixes are whole*. Both live here, pure,
so the reference worker, the SGLang plugin's L3 layer and the simulator's cluster mode apply the
same rules to the same request stream.

Read rule (SGLang's `PoolHitPolicy.TRAILING_PAGES` for the Mamba pool, hicache_storage.py): a prefix
of p pages is restorable iff KV pages [0, p) are all present and the recurrent state keyed by page
p-1 (the state at the prefix's end) is present. KV without a state at its end is no resume point.

Write rule: after a request, its *terminal bundle* -- the KV pages [0, d) and the state at d, where
d is the deepest checkpoint the server holds on the request's path -- goes to L3, minus what this
server already wrote. Eq. 7 has already decided that state exists (L3 never receives a state
HiState's own tiers did not keep), and KV past it is not written (the read rule makes it useless).
Why only the deepest state: a session that moves to another server resumes from its latest turn's
end (the terminal-hit mass q of eq. 5 is most of an agent trace's reuse), and the KV of that bundle
is also every earlier turn's prefix. Interior checkpoints stay private: their eq. 7 value
(tau*C/M) is counted against this server's tiers, and in the simulator writing them through costs
L3 capacity nobody reads (4 servers, a failure: the moved sessions' first TTFT 0.14 / 0.30 s with the
terminal bundle at 200 / 100 GB, 0.19 / 0.41 s writing every held state; on Weka 1.32 vs 2.14 s at
400 GB; docs/scaleout.md, simulated). The SGLang plugin applies the same rule to what HiState backs
up (sglang_plugin/l3_tier.py); the reference worker and the simulator's cluster mode call this
function.

What leaves L3 is ranked too, by the same eq. 7, in `core/l3_ledger.py`: each server keeps a ledger of
the bundles it wrote (or read) and deletes the lowest-ranked ones beyond its share of a fleet budget set
below the master's watermark, so the master's object LRU -- which drops a session's leading pages
first, written once and never read back by their holder, and with them every later bundle of the
session -- rarely fires. Writers confirm their `already_written` hints against what the store lists
before skipping a page (reference/l3_tier.py `_confirm_written`; the simulator the same).

Placement hints (Mooncake `ReplicateConfig`; the master may ignore or outlive them, so they are
hints, never correctness):
  * the deepest state and its page are soft-pinned with a TTL: the live session's latest state is
    the object most likely to be read next (eq. 7's recency term at its maximum). The plugin cannot
    pass pins through SGLang's MooncakeStore (it builds its own ReplicateConfig), so there the
    master's LRU alone decides;
  * pages of a prefix reached by more than one session (`shared_pages`) get `shared_replicas`
    copies: a system prompt lost with one segment costs every session;
  * a page's KV objects and its state share one group id (the page), so they leave together and
    the master never keeps a state whose KV is gone (which the read rule would make useless).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_PIN_TTL_S = 1800.0
"""Mooncake master's own default soft-pin TTL (`mooncake_master --help`: default_kv_soft_pin_ttl
1800000 ms); a pin outliving the session's next turn costs nothing the master cannot reclaim."""


@dataclass(frozen=True)
class L3WriteConfig:
    enabled: bool = True
    pin_ttl_s: float = DEFAULT_PIN_TTL_S
    shared_replicas: int = 1
    """Copies of a shared page; 1 on a store with one segment (the loopback cluster)."""

    def __post_init__(self) -> None:
        if self.pin_ttl_s < 0:
            raise ValueError(f"L3 pin TTL must be >= 0 s, got {self.pin_ttl_s}")
        if self.shared_replicas < 1:
            raise ValueError(f"L3 shared_replicas must be >= 1, got {self.shared_replicas}")


@dataclass(frozen=True)
class L3Put:
    """One page's objects to write: its KV and, when `with_state`, the state at its end."""

    page_index: int
    with_state: bool
    soft_pin: bool
    replicas: int
    group_id_page: int
    """Index of the page whose key names the group (the page itself: KV and state leave together)."""


def plan_l3_writes(num_pages: int, state_depths: Sequence[int], already_written: Callable[[int], bool],
                   shared_pages: int, config: L3WriteConfig,
                   state_already_written: Callable[[int], bool] = lambda page: False) -> list[L3Put]:
    """The puts for one finished request of `num_pages` full pages, in page order.

    `state_depths`: depths in pages (1..num_pages) at which this server holds a checkpoint of the
    request's path after the request; the deepest one ends the terminal bundle (a state at depth d is
    keyed by page d-1). `already_written(i)`: page i's KV is known to be in L3 from this server's own
    earlier puts, `state_already_written(i)` the same for the state keyed by page i. Both are hints:
    re-putting is harmless, while skipping a page the master has evicted leaves the bundle
    unrestorable, so a caller forgets the pages it reads back as missing. `shared_pages`: leading
    pages reached by another session too.
    """
    if not config.enabled or num_pages <= 0:
        return []
    depths = [d for d in state_depths if 0 < d <= num_pages]
    if not depths:
        return []
    terminal = max(depths)
    puts = []
    for page in range(terminal):
        is_end = page == terminal - 1
        if already_written(page) and (not is_end or state_already_written(page)):
            continue
        puts.append(L3Put(page_index=page, with_state=is_end, soft_pin=is_end,
                          replicas=config.shared_replicas if page < shared_pages else 1,
                          group_id_page=page))
    return puts


def restorable_pages(kv_present: Sequence[bool], state_present: Sequence[bool]) -> int:
    """Longest p such that KV pages [0, p) are present and the state keyed by page p-1 is present."""
    best = 0
    for p, kv in enumerate(kv_present, start=1):
        if not kv:
            break
        if p - 1 < len(state_present) and state_present[p - 1]:
            best = p
    return best
