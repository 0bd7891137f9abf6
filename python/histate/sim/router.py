"""The router in front of cluster mode's servers: sglang-router / sgl-model-gateway routing policies.

`manual` (sgl-model-gateway `src/policies/manual.rs`, sgl-project/sglang): sticky routing by the
`X-SMG-Routing-Key` header. The gateway keeps a map routing key -> candidate workers (at most
`MAX_CANDIDATE_WORKERS` = 2); a known key goes to its first healthy candidate; a new key, or one
whose candidates are all unhealthy, gets a worker from `select_new_worker`, whose default
`ManualAssignmentMode::Random` draws uniformly among healthy workers (`min_load` is the other mode).
A worker's removal therefore moves only the keys mapped to it; adding workers moves none. Here the
routing key is the request's ROOT session id (subagents follow their root, as an agent harness
sets one header per conversation), and the uniform draw is replaced by rendezvous (highest random
weight) hashing of the key over the live workers: uniform like the draw, but deterministic per seed,
so two runs of a benchmark (with and without a failure) place every key identically.

`fixed`: `manual` with the new keys' draw replaced by a recorded placement -- routing key -> the
workers a live run (`histate cluster`, requests.csv) served it on, in order. It exists to replay a
live run's sessions on the same workers (benchmark/cluster_sim_vs_live.py): the live router's draw is
random (manual.rs `ManualAssignmentMode::Random`), so no seed reproduces it. A key's recorded
workers become its candidates the way manual.rs appends a newly selected worker to a key's
candidates: the first live one serves it; once the recorded ones are all dead the key is re-placed as
`manual` re-places it (rendezvous over the live workers; with 2 workers, the other one). Keys the
placement does not name fall back to `manual` outright. `request_placement` (request uid -> the
worker that served it live) goes one step further and replays every routing decision, retries and
failover included: which requests a kill catches in flight is HTTP, router and Python timing the
simulator does not model, so only the live run's own decisions put the same requests on the same
workers (a recorded worker that is dead in the simulation falls back as above).

`cache_aware` (sgl-model-gateway `src/policies/cache_aware.rs`): an approximate radix tree per worker
built from the requests the router sent there (never from the workers' real caches). If the load is
imbalanced, i.e. `max - min > balance_abs_threshold` AND `max > min * balance_rel_threshold` (loads =
requests in flight per worker), the least-loaded worker; otherwise the worker with the longest
prefix match if match / request length > `cache_threshold`, else the worker with the smallest tree.
The request is then inserted in the chosen worker's tree. Defaults: the command line's
(`--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5`, `src/main.rs`
default_value_t, as read in a public review of the gateway; the library's `CacheAwareConfig::default`
in `src/policies/mod.rs` is 0.5 / 32 / 1.1, verified): a deployment started from the CLI gets the
former. The tree here is over the simulator's page keys (64-token pages) instead of characters, and
is never trimmed (the gateway evicts LRU leaves past `max_tree_size`).
"""
from __future__ import annotations

import hashlib
from typing import Hashable, Mapping, Optional, Sequence

ROUTER_POLICIES = ("manual", "cache_aware", "fixed")
DEFAULT_CACHE_THRESHOLD = 0.3
DEFAULT_BALANCE_ABS_THRESHOLD = 64
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
MAX_CANDIDATE_WORKERS = 2


def rendezvous_owner(key: Hashable, workers: Sequence[int], seed: int = 0) -> int:
    """The worker with the highest hash weight for `key` (stable across processes: sha1, not hash())."""
    def weight(worker: int) -> bytes:
        return hashlib.sha1(f"{seed}\x00{key}\x00{worker}".encode()).digest()
    return max(workers, key=weight)


class ManualRouter:
    """Sticky by routing key (module docstring)."""

    name = "manual"

    def __init__(self, num_servers: int, seed: int = 0) -> None:
        self.live = list(range(num_servers))
        self.seed = seed
        self.candidates: dict = {}   # routing key -> [server], oldest first, at most 2

    def route(self, routing_key: Hashable, page_keys: Sequence, loads: Sequence[int], uid=None) -> int:
        chosen = self.candidates.setdefault(routing_key, [])
        for server in chosen:
            if server in self.live:
                return server
        server = rendezvous_owner(routing_key, self.live, self.seed)
        chosen.append(server)
        del chosen[:-MAX_CANDIDATE_WORKERS]
        return server

    def owner(self, routing_key: Hashable) -> Optional[int]:
        """Where the key goes now without placing it (None: never routed)."""
        return next((s for s in self.candidates.get(routing_key, ()) if s in self.live), None)

    def remove(self, server: int) -> None:
        self.live.remove(server)


class FixedRouter(ManualRouter):
    """`manual` with a recorded placement for new keys (module docstring)."""

    name = "fixed"

    def __init__(self, num_servers: int, placement: Mapping, seed: int = 0,
                 request_placement: Optional[Mapping] = None) -> None:
        super().__init__(num_servers, seed)
        self.request_placement = dict(request_placement or {})
        self.placement = {}
        for key, servers in placement.items():
            servers = (servers,) if isinstance(servers, int) else tuple(servers)
            bad = [s for s in servers if not 0 <= s < num_servers]
            if not servers or bad:
                raise ValueError(f"placement of {key!r}: servers {servers} not in 0..{num_servers - 1}")
            self.placement[key] = servers

    def route(self, routing_key: Hashable, page_keys: Sequence, loads: Sequence[int], uid=None) -> int:
        chosen = self.candidates.setdefault(routing_key, [])
        if self.request_placement.get(uid) in self.live:
            return self.request_placement[uid]
        for server in self.placement.get(routing_key, ()):
            if server not in chosen:
                chosen.append(server)   # the recorded workers, in the order the live run used them
        for server in chosen:
            if server in self.live:
                return server
        server = rendezvous_owner(routing_key, self.live, self.seed)
        chosen.append(server)
        return server


class CacheAwareRouter:
    """Approximate-tree routing with a load-balance fallback (module docstring). The per-worker
    tree is a set of page keys: keys are prefix-chained, so the longest match is the count of
    leading keys present."""

    name = "cache_aware"

    def __init__(self, num_servers: int, cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
                 balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD) -> None:
        self.live = list(range(num_servers))
        self.trees = {s: set() for s in self.live}
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def route(self, routing_key: Hashable, page_keys: Sequence, loads: Sequence[int], uid=None) -> int:
        live_loads = [loads[s] for s in self.live]
        lo, hi = min(live_loads), max(live_loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            server = min(self.live, key=lambda s: loads[s])
        else:
            best, best_len = self.live[0], -1
            for s in self.live:
                tree, n = self.trees[s], 0
                while n < len(page_keys) and page_keys[n] in tree:
                    n += 1
                if n > best_len:
                    best, best_len = s, n
            if page_keys and best_len / len(page_keys) > self.cache_threshold:
                server = best
            else:
                server = min(self.live, key=lambda s: len(self.trees[s]))
        self.trees[server].update(page_keys)
        return server

    def owner(self, routing_key: Hashable) -> Optional[int]:
        return None

    def remove(self, server: int) -> None:
        self.live.remove(server)
        self.trees.pop(server, None)


def make_router(name: str, num_servers: int, seed: int = 0, placement: Optional[Mapping] = None,
                request_placement: Optional[Mapping] = None):
    """The router `name`; `placement` (routing key -> server index, or the indices in the order a live
    run used them) is the `fixed` router's, and only its."""
    if (name == "fixed") != (placement is not None):
        raise ValueError("the fixed router needs a placement, and only it takes one")
    if name == "fixed":
        return FixedRouter(num_servers, placement, seed, request_placement)
    if name == "manual":
        return ManualRouter(num_servers, seed)
    if name == "cache_aware":
        return CacheAwareRouter(num_servers)
    raise ValueError(f"unknown router policy {name!r}; known: {', '.join(ROUTER_POLICIES)}")
