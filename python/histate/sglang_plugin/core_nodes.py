"""SGLang tree nodes in the core's node shape: one persistent `CoreNode` per `UnifiedTreeNode`.

`histate.core` scores, refreshes and heaps nodes through one read/write shape (docs/core-api.md):
`parent`, `children`, `keys` (its length), `depth_pages`, `kv_mask` / `ckpt_mask` (GPU_BIT, CPU_BIT,
SSD_BIT), the access and creation times, and the victim heap's `version` / `is_alive` / `is_parked`.
`CoreNode` is that shape over an SGLang node: structure and the device / host bits are read through to
SGLang (its tree is the only tree; nothing is mirrored that SGLang could change behind our back), the
times, heap bookkeeping and SSD bits live here. The adapter is created on first use and stored on the
SGLang node (`_hs_core`), so it lives exactly as long as the node.

Units: SGLang edges are page-aligned but not checkpoint-grid aligned, so `keys` and `depth_pages` count
tokens and the cache's PolicyState is built with `node_unit_tokens=1`.

SSD bits are not read from the store (each TP rank has its own): they change only on events every
rank sees at the same point of the schedule (a storage backup acknowledged, an SSD eviction decided
from the agreed ranking, a restore whose result was agreed), so every rank scores the same tree.
"""
from __future__ import annotations

from typing import Any, Optional

from histate.core import CPU_BIT, GPU_BIT, SSD_BIT

FULL = 0  # sglang ComponentType.FULL
MAMBA = 2  # sglang ComponentType.MAMBA


class _Children:
    """A node's children as CoreNodes, built only when iterated (the core mostly tests truthiness)."""

    __slots__ = ("_children",)

    def __init__(self, children: dict):
        self._children = children

    def __bool__(self) -> bool:
        return bool(self._children)

    def __len__(self) -> int:
        return len(self._children)

    def values(self):
        return (core_of(child) for child in self._children.values())


class CoreNode:
    __slots__ = ("sg", "depth", "kv_access_s", "ckpt_access_s", "kv_created_s", "ckpt_created_s",
                 "ssd_kv", "ssd_state", "version", "is_alive", "is_parked", "offered", "prefix_hash",
                 "session_ref", "state_session_ref", "turn_end")

    def __init__(self, sg: Any, now_s: float = 0.0):
        self.sg = sg
        self.depth: Optional[int] = None  # tokens root -> end; fixed for life (splits cut keys from the front)
        self.kv_access_s = self.ckpt_access_s = now_s
        self.kv_created_s = self.ckpt_created_s = now_s
        self.ssd_kv = False  # this node's KV pages are on SSD (acknowledged backup)
        self.ssd_state = False  # the checkpoint at its end is on SSD
        self.version = 0
        self.is_alive = True
        self.is_parked = False
        self.offered: tuple = ()  # the units last offered to the heaps
        self.prefix_hash: Optional[int] = None  # H(depth) of prefix_keys.py, once miss attribution asked for it
        # HiState's own holds (core/sessions.py counts over CoreNodes, read by eq. 7's score): waiting turns
        # under --histate-tool-wait-prefetch (runtime.holds); SGLang's session references stay on `sg`.
        self.session_ref = 0
        self.state_session_ref = 0
        self.turn_end = None

    # --- structure (read through to SGLang) ------------------------------------------------------

    @property
    def parent(self) -> Optional["CoreNode"]:
        parent = self.sg.parent
        return None if parent is None else core_of(parent)

    @property
    def children(self) -> _Children:
        return _Children(self.sg.children)

    @property
    def keys(self) -> range:
        key = self.sg.key
        return range(0 if key is None else len(key))

    @property
    def depth_pages(self) -> int:
        """Tokens from the root to the end of this node (the core's depth, token-granular)."""
        if self.depth is None:
            parent = self.sg.parent
            self.depth = 0 if parent is None else core_of(parent).depth_pages + len(self.sg.key)
        return self.depth

    # --- tiers (device / host from SGLang, SSD from agreed events) --------------------------------

    @property
    def kv_mask(self) -> int:
        data = self.sg.component_data[FULL]
        return ((GPU_BIT if data.value is not None else 0) | (CPU_BIT if data.host_value is not None else 0)
                | (SSD_BIT if self.ssd_kv else 0))

    @property
    def ckpt_mask(self) -> int:
        if self.sg.parent is None:
            return 0
        data = self.sg.component_data[MAMBA]
        return ((GPU_BIT if data.value is not None else 0) | (CPU_BIT if data.host_value is not None else 0)
                | (SSD_BIT if self.ssd_state else 0))

    def __repr__(self) -> str:
        return f"CoreNode#{self.sg.id}[..{self.depth_pages}] kv={self.kv_mask:03b} ckpt={self.ckpt_mask:03b}"


def core_of(sg: Any) -> CoreNode:
    """The adapter of an SGLang node (created on first use, with time 0: callers stamp real times)."""
    node = getattr(sg, "_hs_core", None)
    if node is None:
        node = sg._hs_core = CoreNode(sg)
    return node


def has_device_state(sg: Any) -> bool:
    return sg.component_data[MAMBA].value is not None


def has_host_state(sg: Any) -> bool:
    return sg.component_data[MAMBA].host_value is not None
