"""With the series applied, the plugin uses the public paths the patches add instead of its own
workarounds: each test here fails if the plugin silently kept its workaround."""
from __future__ import annotations

import sys
import types
from collections import defaultdict

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from histate.sglang_plugin import hook_points, hooks


@pytest.fixture
def probe_group(monkeypatch):
    """An isolated registry and group record, and a probe target outside the hook table."""
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(hooks, "_installed", set())
    monkeypatch.setattr(hooks, "_failed", {})
    monkeypatch.setattr(hooks, "_check_listed", lambda group, group_hooks: None)
    monkeypatch.setattr(hooks, "registry_hook", lambda target: hook_points.HookPoint(
        target, "probe", "probe", "probe", hook_points.parameter_names(hooks.resolve_target(target)), "probe"))
    monkeypatch.setattr(hooks, "_forget", lambda *a: pytest.fail("0001 applied: the private cleanup must not run"))

    class Probe:
        @staticmethod
        def helper(x):
            return x - 1

    module = types.ModuleType("upstream_hook_probe")
    module.Probe = Probe
    monkeypatch.setitem(sys.modules, module.__name__, module)


def _after(result, *args, **kwargs):
    return result * 10


def test_0001_a_group_that_fails_to_apply_is_refused_through_the_registrys_strict_mode(probe_group, monkeypatch):
    assert hooks._has_strict_apply(HookRegistry)

    def boom(cls, target, hook_list):
        raise TypeError("cannot patch")

    monkeypatch.setattr(HookRegistry, "_apply_target", classmethod(boom))
    with pytest.raises(RuntimeError, match=r"upstream_hook_probe\.Probe\.helper not patched \(HookRegistry: "
                                           r"TypeError: cannot patch\)"):
        hooks.install_once("probe", [("upstream_hook_probe.Probe.helper", _after, "AFTER")])
    assert "upstream_hook_probe.Probe.helper" not in HookRegistry._hooks  # SGLang dropped it, not the plugin


def test_0002_cuts_come_from_the_caches_grid_not_from_hooks():
    """The chunking hooks are not installed; SGLang's PrefillAdder reads the cache's grid."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from histate.sglang_plugin import chunking

    assert chunking.upstream_cut_grid()
    chunking.install_chunk_planning()
    assert not hooks.is_installed("chunking")
    assert not any(t.startswith("sglang.srt.managers.schedule_policy.PrefillAdder") and HookRegistry.is_patched(t)
                   for t in HookRegistry._hooks)
    assert "cache_cut_grid" in PrefillAdder.__init__.__code__.co_names
