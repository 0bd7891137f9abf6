"""The one table of what HiState replaces in SGLang (hook_points.py) matches the installed SGLang.

Expectations are computed independently of `hook_points.signature_problems` (which uses inspect): the
file:line column is checked by reading SGLang's source text at that line and parsing the `def` with
`ast`, and the table's completeness is checked by walking the plugin's classes and SGLang's
HookRegistry, not by trusting the table.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

from histate.sglang_plugin import hook_points, hooks

ALL_POINTS = hook_points.REGISTRY_HOOKS + hook_points.OVERRIDES


def _sglang_root() -> pathlib.Path:
    import sglang

    return pathlib.Path(sglang.__file__).parent


_parsed: dict = {}


def _def_at(sglang_line: str) -> ast.FunctionDef:
    """The function SGLang's source defines at that line (the `def` line itself, as ast numbers it)."""
    path, _, line = sglang_line.partition(":")
    if path not in _parsed:
        _parsed[path] = {node.lineno: node for node in ast.walk(ast.parse((_sglang_root() / path).read_text()))
                         if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert int(line) in _parsed[path], f"{sglang_line} is not a def in the installed SGLang"
    return _parsed[path][int(line)]


@pytest.mark.parametrize("point", ALL_POINTS, ids=lambda p: p.target.rsplit(".", 2)[-2] + "." + p.target.rsplit(".", 1)[-1])
def test_the_listed_file_line_is_the_def_with_the_listed_parameters(point):
    node = _def_at(point.sglang_line)
    assert node.name == point.target.rsplit(".", 1)[-1]
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args]
    names += [args.vararg.arg] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs]
    names += [args.kwarg.arg] if args.kwarg else []
    assert tuple(names) == point.params


def test_the_installed_sglang_fits_every_hook_point():
    assert hook_points.signature_problems(ALL_POINTS) == []


def _plugin_classes():
    from histate.sglang_plugin.components import HiStateFullComponent, HiStateMambaComponent
    from histate.sglang_plugin.tree_cache import HiStateRadixCache
    from histate.sglang_plugin.tree_core import HiStateTreeCore

    return HiStateRadixCache, HiStateTreeCore, HiStateFullComponent, HiStateMambaComponent


_ANSWERS = {  # the methods of the protocols these patches add that HiState's cache answers, once applied
    "0002-scheduler-prefill-cut-grid": ("prefill_cut_grid", "on_prefill_cut_floored"),
    "0011-hybrid-pool-host-sizing-policy": ("host_pool_sizes",),
    "0012-scheduler-cache-chunk-limit": ("continuing_chunk_limiter",),
}


def _applied_patches() -> set:
    """The upstream/series patches the installed SGLang carries, each as the plugin detects it (on stock 0.5.23
    none; `make upstream-check` runs these tests on the patched copy)."""
    from sglang.srt.managers import tokenizer_manager

    from histate.sglang_plugin import components, host_stack, short_prefill, storage_policy, tree_core
    from histate.sglang_plugin.chunking import upstream_cut_grid
    from histate.sglang_plugin.cli_hooks import upstream_plugin_args

    detected = {
        "0002-scheduler-prefill-cut-grid": upstream_cut_grid(),
        "0003-server-args-plugin-declared-arguments": upstream_plugin_args() is not None,
        "0005-mem-cache-tree-core-observers": tree_core.OBSERVED_BY_SGLANG,
        "0006-mem-cache-eviction-ranker": components.RANKED_BY_SGLANG,
        "0007-mem-cache-insert-split-match-events": tree_core.WALK_EVENTS_BY_SGLANG,
        "0008-hicache-storage-tier-policy": storage_policy.STORAGE_POLICY_BY_SGLANG,
        "0009-mem-cache-session-release-events": tree_core.SESSION_EVENTS_BY_SGLANG,
        "0010-hicache-storage-restore-hold": storage_policy.RESTORE_HOLD_BY_SGLANG,
        "0011-hybrid-pool-host-sizing-policy": host_stack.SIZED_BY_SGLANG,
        "0012-scheduler-cache-chunk-limit": short_prefill.LIMITED_BY_SGLANG,
        "0013-plugins-request-validators-and-info-keys": hasattr(tokenizer_manager, "register_request_validator"),
    }
    assert set(detected) == set(hook_points.RETIRED_BY_PATCH)  # every patch that retires a point is detected
    return {patch for patch, applied in detected.items() if applied}


def _retired(applied: set) -> set:
    return set().union(*(hook_points.RETIRED_BY_PATCH[patch] for patch in applied))


def test_every_sglang_method_the_plugin_overrides_is_listed():
    found = set()
    for cls in _plugin_classes():
        ours = {name for k in cls.__mro__ if k.__module__.startswith("histate.")
                for name, value in vars(k).items() if callable(value) or isinstance(value, (classmethod, staticmethod))}
        for name in ours:
            if name.startswith("__") and name != "__init__":
                continue
            base = next((k for k in cls.__mro__ if k.__module__.startswith("sglang.") and name in vars(k)), None)
            if base is not None:
                found.add((cls.__name__, f"{base.__module__}.{base.__qualname__}.{name}"))
    applied = _applied_patches()
    listed = {(point.owner, point.target) for point in hook_points.OVERRIDES} - _retired(applied)
    listed |= {("HiStateRadixCache", f"sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.{name}")
               for patch, names in _ANSWERS.items() if patch in applied for name in names}
    assert found == listed


def test_every_registry_hook_the_plugin_installs_is_listed_and_every_listed_one_is_installed(sglang_plugins):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from histate.sglang_plugin.capture import install_scheduler_hooks
    from histate.sglang_plugin.checkpoint_hints import install as install_hint_check
    from histate.sglang_plugin.capture_forward import install_forward_hooks
    from histate.sglang_plugin.chunking import install_chunk_planning
    from histate.sglang_plugin.host_stack import install_host_policy
    from histate.sglang_plugin.miss_tracker import install_meta_info_hook
    from histate.sglang_plugin.restore_recheck import install_restore_recheck
    from histate.sglang_plugin.short_prefill import install_short_prefill_first

    for install in (install_scheduler_hooks, install_forward_hooks, install_chunk_planning, install_host_policy,
                    install_short_prefill_first, install_meta_info_hook, install_hint_check, install_restore_recheck):
        install()
    ours = {target for target, entries in HookRegistry._hooks.items()
            if any(getattr(entry[1], "__module__", "").startswith("histate.") for entry in entries)}
    retired = {target for _, target in _retired(_applied_patches())}
    assert ours == {point.target for point in hook_points.REGISTRY_HOOKS} - retired


@pytest.fixture
def no_groups_installed(isolated_hooks, monkeypatch):
    """As if no hook group were installed yet in this process (install_once checks a group once)."""
    monkeypatch.setattr(hooks, "_installed", set())
    monkeypatch.setattr(hooks, "_failed", {})
    return isolated_hooks


def _floor_around(original, *args, **kwargs):
    return original(*args, **kwargs)


def test_a_hook_whose_sglang_function_changed_parameters_is_refused_before_anything_is_registered(
        no_groups_installed, monkeypatch):
    from sglang.srt.managers.schedule_policy import PrefillAdder

    def floor_chunked_tokens(self, trunc_len):  # SGLang dropped `remaining`
        return trunc_len

    monkeypatch.setattr(PrefillAdder, "floor_chunked_tokens", floor_chunked_tokens)
    target = "sglang.srt.managers.schedule_policy.PrefillAdder.floor_chunked_tokens"
    registered_before = {k: list(v) for k, v in no_groups_installed._hooks.items()}
    with pytest.raises(RuntimeError) as error:
        hooks.install_once("chunking", [(target, _floor_around, "AROUND")])
    assert f"{target} takes ('self', 'trunc_len'), HiState's hook was written for ('self', 'trunc_len', 'remaining')" \
        in str(error.value)
    assert PrefillAdder.floor_chunked_tokens is floor_chunked_tokens
    assert {k: list(v) for k, v in no_groups_installed._hooks.items()} == registered_before
    problems = hook_points.signature_problems([hook_points.registry_hook(target)])
    assert len(problems) == 1 and "srt/managers/schedule_policy.py:863" in problems[0]


def test_a_hook_not_in_the_table_or_in_another_group_is_a_programming_error(no_groups_installed):
    with pytest.raises(ValueError, match="not listed in hook_points.REGISTRY_HOOKS"):
        hooks.install_once("chunking", [("sglang.srt.managers.schedule_policy.PrefillAdder.budget_state",
                                         _floor_around, "AROUND")])
    with pytest.raises(ValueError, match="listed as AROUND in group 'chunking', installed as AFTER in group 'capture'"):
        hooks.install_once("capture", [("sglang.srt.managers.schedule_policy.PrefillAdder.floor_chunked_tokens",
                                        _floor_around, "AFTER")])


def test_a_renamed_overridden_method_refuses_the_cache_with_one_line(monkeypatch):
    """SGLang renamed `_evict_device_start`: HiState's override would be dead code and SGLang's own walk
    would run with HiState's heaps half-installed; the cache refuses to build instead."""
    from sglang.srt.mem_cache.unified_cache.components.base import TreeComponent
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

    monkeypatch.delattr(FullComponent, "_evict_device_start")
    monkeypatch.delattr(TreeComponent, "_evict_device_start")  # renamed in the base class too
    monkeypatch.setattr(hook_points, "_overrides_checked", False)
    with pytest.raises(RuntimeError) as error:
        hook_points.check_overrides()
    message = str(error.value)
    assert "\n" not in message
    assert "FullComponent._evict_device_start (srt/mem_cache/unified_cache/components/full.py:209 in 0.5.23) " \
           "not found" in message
    assert "MambaComponent._evict_device_start" not in message  # only what changed is named


def test_every_point_an_upstream_patch_retires_is_listed_and_the_patch_exists():
    from pathlib import Path

    series = Path(__file__).resolve().parents[2] / "upstream" / "series"
    listed = {(p.owner, p.target) for p in hook_points.REGISTRY_HOOKS + hook_points.OVERRIDES}
    for patch, points in hook_points.RETIRED_BY_PATCH.items():
        assert (series / f"{patch}.patch").is_file(), patch
        assert points and points <= listed, (patch, points - listed)
    retired = [point for points in hook_points.RETIRED_BY_PATCH.values() for point in points]
    assert len(retired) == len(set(retired))  # one patch per point
