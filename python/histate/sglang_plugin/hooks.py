"""Installing a group of HiState's SGLang hooks once per process.

SGLang's `HookRegistry` patches a target each time a hook is registered and applied, so a group
(the scheduler's capture hooks, the GDN backend's, the chunk planning) must be registered once per
process however many caches the process builds. Each group is named; `install_once` remembers the
names it installed.
"""
from __future__ import annotations

from typing import Callable, Sequence

_installed: set = set()


def install_once(group: str, hooks: Sequence[tuple[str, Callable, str]]) -> None:
    """Register `hooks` ((target, function, "BEFORE" | "AFTER" | "AROUND")) and apply them, the first
    time `group` is installed in this process."""
    if group in _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, function, kind in hooks:
        HookRegistry.register(target, function, HookType[kind])
    HookRegistry.apply_hooks()
    _installed.add(group)
