"""SGLang tree nodes seen through the shape of `histate.core` nodes, so the core scores them.

The core's eviction terms (`histate.core.units`, `Policy.score`) read a node's `parent`,
`children`, `keys` (only its length), `depth_pages`, `kv_mask`, `ckpt_mask` (a bit per tier:
GPU=1, CPU=2, SSD=4), `kv_access_s` and `ckpt_access_s`. `NodeView` answers those from an SGLang
`UnifiedTreeNode` plus a few attributes HiState stamps onto it (access/creation times in seconds,
the memoised depth). Lengths are in tokens: the scoring config uses `page_num_tokens=1`, because
SGLang edges are page- but not checkpoint-grid-aligned.

Node stamps (plain attributes, absent on nodes SGLang created behind our back such as split
parents; readers fall back as documented on each accessor):
  _hs_kv_access_s, _hs_ckpt_access_s, _hs_kv_created_s, _hs_ckpt_created_s, _hs_depth, _hs_version
"""
from __future__ import annotations

from typing import Any, Callable, Optional

FULL = 0  # sglang ComponentType.FULL
MAMBA = 2  # sglang ComponentType.MAMBA
GPU_BIT, CPU_BIT, SSD_BIT = 1, 2, 4


def depth_tokens(node: Any) -> int:
    """Tokens from the root to the end of `node` (never changes: splits shorten keys from the front)."""
    depth = getattr(node, "_hs_depth", None)
    if depth is None:
        parent = node.parent
        depth = 0 if parent is None else depth_tokens(parent) + len(node.key)
        node._hs_depth = depth
    return depth


def kv_access_s(node: Any) -> float:
    """Last KV access; a split parent inherits its child's stamp (set in the split hook)."""
    return getattr(node, "_hs_kv_access_s", 0.0)


def ckpt_access_s(node: Any) -> float:
    return getattr(node, "_hs_ckpt_access_s", kv_access_s(node))


def has_device_state(node: Any) -> bool:
    return node.component_data[MAMBA].value is not None


def has_host_state(node: Any) -> bool:
    return node.component_data[MAMBA].host_value is not None


class ScoringContext:
    """The core's `ScoringContext` fields (what `Policy.score(ctx, ...)` reads) plus the SSD lookup
    the node views need."""

    __slots__ = ("tau_s", "page_num_tokens", "checkpoint_token_equiv", "terminal_prob", "near_end_probs",
                 "restore_cost", "demotion_tier", "state_on_ssd")

    def __init__(self, config: Any, terminal_prob: float, state_on_ssd: Callable[[Any], bool]):
        self.tau_s = config.tau_s
        self.page_num_tokens = config.page_num_tokens
        self.checkpoint_token_equiv = config.checkpoint_token_equiv
        self.terminal_prob = terminal_prob
        self.near_end_probs = ()  # the paper's uniform interior prior until the plugin uses PolicyState
        self.restore_cost, self.demotion_tier = (), ()  # every eviction charged its recompute (the paper)
        self.state_on_ssd = state_on_ssd


class ChildViews:
    """The children of a node as views, built only when iterated (the core mostly tests truthiness)."""

    __slots__ = ("_children", "_ctx")

    def __init__(self, children: dict, ctx: ScoringContext):
        self._children = children
        self._ctx = ctx

    def __bool__(self) -> bool:
        return bool(self._children)

    def __len__(self) -> int:
        return len(self._children)

    def __eq__(self, other: object) -> bool:  # core compares `node.children == {}`
        return isinstance(other, dict) and not other and not self._children

    def values(self):
        return (NodeView(c, self._ctx) for c in self._children.values())


class NodeView:
    """Read-only adapter: one SGLang node in the core's node shape (see module docstring)."""

    __slots__ = ("node", "ctx")

    def __init__(self, node: Any, ctx: ScoringContext):
        self.node = node
        self.ctx = ctx

    @property
    def parent(self) -> Optional["NodeView"]:
        parent = self.node.parent
        return None if parent is None else NodeView(parent, self.ctx)

    @property
    def children(self) -> "ChildViews":
        return ChildViews(self.node.children, self.ctx)

    @property
    def keys(self) -> range:
        return range(len(self.node.key) if self.node.key is not None else 0)

    @property
    def depth_pages(self) -> int:
        return depth_tokens(self.node)

    @property
    def kv_mask(self) -> int:
        data = self.node.component_data[FULL]
        return (GPU_BIT if data.value is not None else 0) | (CPU_BIT if data.host_value is not None else 0)

    @property
    def ckpt_mask(self) -> int:
        node = self.node
        if node.parent is None:
            return 0
        data = node.component_data[MAMBA]
        mask = (GPU_BIT if data.value is not None else 0) | (CPU_BIT if data.host_value is not None else 0)
        if self.ctx.state_on_ssd(node):
            mask |= SSD_BIT
        return mask

    @property
    def kv_access_s(self) -> float:
        return kv_access_s(self.node)

    @property
    def ckpt_access_s(self) -> float:
        return ckpt_access_s(self.node)
