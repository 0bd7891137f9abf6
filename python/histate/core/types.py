"""Small value types shared by every layer: tiers, item kinds, match results, data-movement ops.

Owns no behaviour. Pure: imports only the standard library.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable, Optional


class Tier(enum.IntEnum):
    """Storage tiers, fastest first. SGLang calls them device / host / storage (L1 / L2 / L3)."""

    GPU = 0
    CPU = 1
    SSD = 2

    # Tiers key every ledger and heap dict on the hot path; Enum.__hash__ is a Python-level call,
    # int's is not, and it agrees with int equality (Tier.GPU == 0).
    __hash__ = int.__hash__


ALL_TIERS = (Tier.GPU, Tier.CPU, Tier.SSD)

GPU_BIT, CPU_BIT, SSD_BIT = 1 << Tier.GPU, 1 << Tier.CPU, 1 << Tier.SSD
"""Tier bits of `Node.kv_mask` / `Node.ckpt_mask` (every executor's node view uses the same bits)."""

SGLANG_TIER_NAMES = {Tier.GPU: "device", Tier.CPU: "host", Tier.SSD: "storage"}
"""SGLang's names for the tiers (HiCache L1 / L2 / L3); metrics and logs of the plugin use them."""


def tier_bit(tier: Tier) -> int:
    return 1 << int(tier)


_TIERS_OF_MASK = tuple(tuple(t for t in ALL_TIERS if mask & (1 << int(t))) for mask in range(1 << len(ALL_TIERS)))


def tiers_in(mask: int) -> tuple:
    """Tiers whose bit is set in `mask`, fastest first (a table lookup: this is on every hot path)."""
    return _TIERS_OF_MASK[mask]


def fastest_tier(mask: int) -> Optional[Tier]:
    for t in ALL_TIERS:
        if mask & (1 << int(t)):
            return t
    return None


class ItemKind(enum.Enum):
    """The two kinds of cached data. KV grows with the prefix; a checkpoint is one fixed-size state."""

    KV = "kv"
    CHECKPOINT = "checkpoint"

    __hash__ = object.__hash__  # members are singletons and compare by identity: a C-level hash


class UnitKind(enum.Enum):
    """Eviction units (paper §3.3): an intermediate checkpoint alone, or a terminal bundle
    (the last KV segment of a trajectory plus its terminal checkpoint)."""

    CHECKPOINT = "checkpoint"
    BUNDLE = "bundle"

    __hash__ = object.__hash__  # as ItemKind


class HiStateError(Exception):
    """Base class of every error HiState raises on purpose."""


class InvariantViolation(HiStateError):
    """A numbered invariant of docs/invariants.md does not hold; the message names it."""


class ConfigError(HiStateError, ValueError):
    """A configuration value is out of range; the message names the field."""


@dataclass(frozen=True, slots=True)
class MatchResult:
    """DESIGN.md hit accounting for one request.

    m = `num_kv_pages` (KV resident in some tier), c = `num_reused_pages` (deepest checkpoint <= m).
    Only c counts as reuse: KV beyond the last checkpoint cannot be used without the state.
    """

    num_kv_pages: int
    num_reused_pages: int
    kv_bytes_by_tier: dict = field(default_factory=dict)  # Tier -> bytes restored for [0, c)
    checkpoint_tier: Optional[Tier] = None
    checkpoint_size_bytes: int = 0
    is_terminal_hit: bool = False  # the checkpoint at c ends a trajectory (append-style hit)
    num_held_kv_pages: Optional[int] = None
    """KV pages the tree holds on the request's path before the match is floored to the policy's block
    (vLLM's block granularity); None: the same as `num_kv_pages`. Pages between the two are held but
    unusable: miss attribution calls them page_boundary (core/misses.py)."""
    end_offset_pages: Optional[int] = None
    """Where the request left the cached tree, in pages before the end of the most recently used
    trajectory below that point: 0 = at its end (an append), k = k pages before it; None when farther
    than the near-end window or nothing matched. The evidence behind the learned reuse-position prior."""

    @property
    def held_kv_pages(self) -> int:
        """`num_held_kv_pages`, or `num_kv_pages` when the match was not floored to a block."""
        return self.num_kv_pages if self.num_held_kv_pages is None else self.num_held_kv_pages


@dataclass(frozen=True, slots=True)
class TierOp:
    """One data movement decided by the core, for executors that hold real bytes.

    action: "put" (new data, src None), "move", "copy" (src keeps its copy), "drop" (dst None).
    """

    action: str
    kind: ItemKind
    page_keys: tuple
    depth_pages: int
    src: Optional[Tier]
    dst: Optional[Tier]
    size_bytes: int


PageKey = Hashable
