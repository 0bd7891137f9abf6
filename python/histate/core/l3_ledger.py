"""What leaves the shared L3 store: each server ranks the bundles it wrote there by eq. 7 and deletes
the lowest-ranked ones to stay within its share of the fleet's L3 budget.

Why a server decides and not the master. Mooncake's master evicts approximately-LRU *objects* at its
high watermark (sim/l3.py). A bundle -- KV pages [0, d) and the state at d -- is many objects of
very different ages: its leading pages were written at the session's first turn and are never put
again (the writer skips what L3 already holds) nor read back by their writer (it holds them), so the
master drops them first, and with them every later bundle of the session (the read rule needs KV
[0, p)). On the Weka sessions after a failure that is the moved sessions' loss (docs/scaleout.md,
simulated). Ranked as *bundles*, the leading pages share the recency of the deepest bundle that
needs them and leave only with the last bundle of the ledger that needs them.

Score (paper eq. 7, the same rule the core ranks its own units with, policies/histate.py):

    H_b = t_b + tau * C_b / M_b

  * t_b: the last time this server wrote or read bundle b (an agreed event: the request that wrote
    or read it finished / was admitted at that time);
  * C_b: tokens a reader resuming at b's end recomputes once b is gone: the gap down to the deepest
    other bundle of this ledger on b's path (its prefix-chained keys name it), the whole depth if
    there is none;
  * M_b: what deleting b reclaims, in tokens of KV: its state (N_s tokens) plus the KV pages no other
    bundle of this ledger needs.
The lowest H leaves first; ties go to the shallower, then the older-recorded bundle.

Budget. Each server keeps its ledger within `budget_bytes`: its share of a fleet budget set below
the master's high watermark, so the master's LRU rarely fires. The share is the fleet budget / the
number of servers: under sticky routing at constant load per server each server owns about the same
number of sessions, and a share by write volume would need every server's volume, which no single
server's agreed events carry (the rule must be computable from one server's own events so that
every TP rank of that server takes the same decision).

Limits. A page written by two servers (a shared system prompt) sits in both ledgers; one server's
delete can break the other's bundle, which then reads as a miss and is re-put by its next write
(core/l3_policy.py: a missing object is a miss, never an error). Objects of a dead server are in no
ledger until a reader adopts the bundle it reads; the master's LRU is their backstop.

Pure: no I/O, no clock; the caller passes its agreed time and issues the deletes it is handed.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .config import DEFAULT_TAU_S


@dataclass(frozen=True)
class L3LedgerConfig:
    budget_bytes: int
    """This server's share of the fleet's L3 budget (module docstring)."""
    page_num_tokens: int
    kv_page_bytes: int
    """One page's KV objects (every layer, every TP rank's share this ledger writes)."""
    state_bytes: int
    """One state object at a page's end."""
    tau_s: float = DEFAULT_TAU_S

    def __post_init__(self) -> None:
        if self.budget_bytes < 0 or self.page_num_tokens <= 0 or self.kv_page_bytes <= 0 or self.state_bytes < 0:
            raise ValueError(f"L3LedgerConfig needs budget >= 0, page tokens > 0, page bytes > 0, state bytes >= 0: {self}")
        if self.tau_s < 0:
            raise ValueError(f"L3 ledger tau must be >= 0 s, got {self.tau_s}")

    @property
    def state_token_equiv(self) -> float:
        """N_s: the state's bytes in tokens of KV."""
        return self.state_bytes * self.page_num_tokens / self.kv_page_bytes


def fleet_share_bytes(fleet_budget_bytes: int, num_servers: int) -> int:
    """One server's share of the fleet budget (module docstring: an equal share)."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    return fleet_budget_bytes // num_servers


@dataclass(frozen=True)
class L3Deletes:
    """Objects to remove from L3, named by page key: KV pages and states (keyed by the page they end)."""

    kv_keys: tuple = ()
    state_keys: tuple = ()
    bundles: tuple = ()
    """The victims' terminal keys, lowest H first (diagnosis and tests)."""

    def __bool__(self) -> bool:
        return bool(self.kv_keys or self.state_keys)


@dataclass
class _Bundle:
    path: tuple        # page keys [0, d); the state is keyed by path[-1]
    last_s: float
    seq: int


@dataclass
class L3Ledger:
    """One server's bundles in L3 (module docstring). Feed it only events every TP rank agrees on."""

    config: L3LedgerConfig
    bundles: dict = field(default_factory=dict)    # terminal key -> _Bundle, in recording order
    page_refs: dict = field(default_factory=dict)  # page key -> bundles of this ledger that need it
    _seq: int = 0
    # A bundle's score depends only on the bundles that share a page with it, and prefix-chained keys
    # share a page only if they share their first one: scores are cached per bundle and dropped for
    # every bundle under the same first page when one of them comes or goes.
    _ranks: dict = field(default_factory=dict)     # terminal key -> (H, depth, seq)
    _trees: dict = field(default_factory=dict)     # first page key -> terminal keys of its bundles

    # --- what is in L3 -----------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return len(self.page_refs) * self.config.kv_page_bytes + len(self.bundles) * self.config.state_bytes

    def __contains__(self, terminal_key: Hashable) -> bool:
        return terminal_key in self.bundles

    def record(self, path_keys: Sequence[Hashable], now_s: float) -> None:
        """This server wrote (or read whole) the bundle KV `path_keys` + the state at its end."""
        if not path_keys:
            return
        end = path_keys[-1]
        bundle = self.bundles.get(end)
        if bundle is not None:
            self.touch(end, now_s)
            return
        self._seq += 1
        self.bundles[end] = _Bundle(tuple(path_keys), now_s, self._seq)
        for key in path_keys:
            self.page_refs[key] = self.page_refs.get(key, 0) + 1
        self._invalidate_tree(path_keys[0])
        self._trees.setdefault(path_keys[0], set()).add(end)

    def touch(self, terminal_key: Hashable, now_s: float) -> None:
        """A read resumed at this bundle's end: its recency is now."""
        bundle = self.bundles.get(terminal_key)
        if bundle is not None and now_s > bundle.last_s:
            bundle.last_s = now_s
            self._ranks.pop(terminal_key, None)

    def forget(self, terminal_key: Hashable) -> None:
        """The bundle is no longer whole in L3 (read back missing, or deleted): stop counting it."""
        bundle = self.bundles.pop(terminal_key, None)
        if bundle is None:
            return
        root = bundle.path[0]
        self._invalidate_tree(root)
        tree = self._trees[root]
        tree.discard(terminal_key)
        if not tree:
            del self._trees[root]
        for key in bundle.path:
            refs = self.page_refs[key] - 1
            if refs:
                self.page_refs[key] = refs
            else:
                del self.page_refs[key]

    def _invalidate_tree(self, root: Hashable) -> None:
        for end in self._trees.get(root, ()):
            self._ranks.pop(end, None)

    # --- eq. 7 ---------------------------------------------------------------------------------------

    def score_terms(self, terminal_key: Hashable) -> tuple:
        """(t_s, C_tokens, M_tokens, H) of one bundle (module docstring)."""
        cfg = self.config
        bundle = self.bundles[terminal_key]
        depth = len(bundle.path)
        below = max((i + 1 for i, key in enumerate(bundle.path[:-1]) if key in self.bundles), default=0)
        cost_tokens = float((depth - below) * cfg.page_num_tokens)
        own_pages = sum(1 for key in bundle.path if self.page_refs[key] == 1)
        reclaim_tokens = own_pages * cfg.page_num_tokens + cfg.state_token_equiv
        score = bundle.last_s + cfg.tau_s * cost_tokens / reclaim_tokens if reclaim_tokens > 0 else float("inf")
        return bundle.last_s, cost_tokens, reclaim_tokens, score

    def _victim(self, protect: Hashable) -> Hashable:
        best, best_rank = None, None
        for end, bundle in self.bundles.items():
            if end == protect:
                continue
            rank = self._ranks.get(end)
            if rank is None:
                rank = self._ranks[end] = (self.score_terms(end)[3], len(bundle.path), bundle.seq)
            if best_rank is None or rank < best_rank:
                best, best_rank = end, rank
        return best

    def plan_deletes(self, protect: Hashable = None) -> L3Deletes:
        """Drop the lowest-H bundles (never `protect`, the one just written) until the ledger fits its
        budget, and return the objects to remove: each victim's state, and the KV pages no remaining
        bundle needs. Scores are recomputed after every victim: a deletion changes its neighbours'
        C and M (the bundle below may now own pages; the one above has a longer gap)."""
        kv_keys, state_keys, victims = [], [], []
        while self.used_bytes > self.config.budget_bytes:
            victim = self._victim(protect)
            if victim is None:
                break
            path = self.bundles[victim].path
            self.forget(victim)
            victims.append(victim)
            state_keys.append(victim)
            kv_keys.extend(key for key in path if key not in self.page_refs)
        return L3Deletes(tuple(kv_keys), tuple(state_keys), tuple(victims))
