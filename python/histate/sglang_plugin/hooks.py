"""Installing a group of HiState's SGLang hooks once per process, and proving each one took.

SGLang's `HookRegistry` patches a target each time a hook is registered and applied, so a group
(the scheduler's capture hooks, the GDN backend's, the chunk planning, the ServerArgs hooks) must be
registered once per process however many caches the process builds. Each group is named;
`install_once` remembers the names it installed.

Fail-closed: `HookRegistry.apply_hooks` only logs a target it cannot resolve (and skips, silently,
a target some earlier registration already patched), so a renamed SGLang method would leave HiState
half-installed, e.g. capture slots the scheduler allocates with no backend hook to fill them. With
the first patch of the upstream series applied (upstream/series/0001: `apply_hooks(strict=True,
targets=...)`), SGLang itself names the targets it could not patch and drops their hooks; without it
(stock 0.5.23) the private cleanup `_forget` does that here.
`install_once` therefore resolves every target before registering anything, and after applying
checks that each target now names a different object than before (the wrapper HookRegistry builds).
Any target that is missing or unchanged fails the whole group with one RuntimeError naming the group
and every such target; the group is then not recorded as installed, and asking for it again raises
the same error.

Every target must be listed for its group in `hook_points.REGISTRY_HOOKS` (the one table of what the
plugin replaces, with SGLang's file:line), and its parameters must still be the ones listed there: a
hook written for other parameters would fail with a TypeError in the scheduler loop instead of here.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from .hook_points import parameter_mismatch, registry_hook, resolve_target

_installed: set = set()
_failed: dict = {}  # group -> the error message it failed with


def is_installed(group: str) -> bool:
    return group in _installed


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]


def _forget(unpatched: Sequence[str], functions: Sequence[Callable]) -> None:
    """Take our registrations of targets that did not get patched back out of the registry, so that
    later `apply_hooks` calls (other groups, other plugins) do not retry and log them again. Uses
    HookRegistry's `_hooks` and `_patched` (SGLang 0.5.23, plugins/hook_registry.py): a target already
    in `_patched` was patched by someone else and is left alone."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    registry = getattr(HookRegistry, "_hooks", None)
    patched = getattr(HookRegistry, "_patched", set())
    if registry is None:
        return
    for target in unpatched:
        if target in patched or target not in registry:
            continue
        kept = [entry for entry in registry[target] if entry[1] not in functions]
        if kept:
            registry[target] = kept
        else:
            del registry[target]


def _has_strict_apply(registry: Any) -> bool:
    """Whether this SGLang's `HookRegistry.apply_hooks` fails closed on request (`strict=`, `targets=`:
    upstream/series 0001). Stock 0.5.23 has neither: then the group is checked here after applying."""
    import inspect

    parameters = inspect.signature(registry.apply_hooks).parameters
    return "strict" in parameters and "targets" in parameters


def _check_listed(group: str, hooks: Sequence[tuple[str, Callable, str]]) -> None:
    """A programming error, not an SGLang difference: every hook must be in the table, as listed."""
    for target, _, kind in hooks:
        try:
            point = registry_hook(target)
        except KeyError:
            raise ValueError(f"hook target {target!r} is not listed in hook_points.REGISTRY_HOOKS") from None
        if (point.owner, point.how) != (group, kind):
            raise ValueError(f"hook target {target!r} is listed as {point.how} in group {point.owner!r}, "
                             f"installed as {kind} in group {group!r}")


def install_once(group: str, hooks: Sequence[tuple[str, Callable, str]]) -> None:
    """Register `hooks` ((target, function, "BEFORE" | "AFTER" | "AROUND")) and apply them, the first
    time `group` is installed in this process; raise RuntimeError naming the group and every target
    that could not be patched."""
    if group in _installed:
        return
    if group in _failed:
        raise RuntimeError(_failed[group])
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kinds = [HookType[kind] for _, _, kind in hooks]  # a bad kind is a KeyError before anything is registered
    _check_listed(group, hooks)
    originals: dict = {}
    problems: dict = {}
    for target, _, _ in hooks:
        try:
            originals[target] = resolve_target(target)
        except Exception as error:  # ImportError, AttributeError, ValueError: the name is gone
            problems[target] = f"not found ({_describe(error)})"
            continue
        mismatch = parameter_mismatch(registry_hook(target), originals[target])
        if mismatch:
            problems[target] = mismatch
    if not problems:  # all or nothing: a group with a missing target registers none of its hooks
        for (target, function, _), kind in zip(hooks, kinds):
            HookRegistry.register(target, function, kind)
        strict = _has_strict_apply(HookRegistry)
        if strict:  # upstream/series 0001: SGLang names what it could not patch and drops those hooks
            try:
                HookRegistry.apply_hooks(strict=True, targets=[target for target, _, _ in hooks])
            except Exception as error:  # HookApplyError
                for target, cause in getattr(error, "failures", {}).items():
                    problems[target] = f"not patched (HookRegistry: {_describe(cause)})"
                if not problems:
                    raise
        else:
            HookRegistry.apply_hooks()
        for target, _, _ in hooks:
            if target in problems:
                continue
            try:
                now = resolve_target(target)
            except Exception as error:
                problems[target] = f"not found after patching ({_describe(error)})"
                continue
            if now is originals[target]:
                problems[target] = ("not patched (HookRegistry left it unchanged: it failed to apply, or an "
                                    "earlier registration had already patched this target)")
        if problems and not strict:
            _forget(list(problems), [function for _, function, _ in hooks])
    if problems:
        listed = "; ".join(f"{target} {why}" for target, why in problems.items())
        message = (f"HiState cannot install its SGLang hook group {group!r}: {listed}. This SGLang differs "
                   f"from the 0.5.23 HiState was built for; refusing to run without these hooks")
        _failed[group] = message
        raise RuntimeError(message)
    _installed.add(group)
