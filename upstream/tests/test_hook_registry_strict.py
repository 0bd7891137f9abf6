"""The test that ships with upstream/series 0001 ([plugins] HookRegistry: fail closed on request).

Written as it would sit in SGLang's own test tree (no HiState import): it runs against the patched
copy of SGLang that `make upstream-check` builds (upstream/check.py puts that copy first on sys.path).
"""
from __future__ import annotations

import logging
import sys
import types

import pytest

from sglang.srt.plugins.hook_registry import HookApplyError, HookRegistry, HookType


@pytest.fixture
def probe(monkeypatch):
    """A module with a class to hook, and a registry emptied before and after."""

    class Probe:
        def method(self, x):
            return x + 1

        def other(self, x):
            return x + 2

    module = types.ModuleType("hook_probe")
    module.Probe = Probe
    monkeypatch.setitem(sys.modules, "hook_probe", module)
    HookRegistry.reset()
    yield Probe
    HookRegistry.reset()


def _times_ten(result, *args, **kwargs):
    return result * 10


def test_default_apply_still_logs_and_continues(probe, caplog):
    HookRegistry.register("hook_probe.Probe.method", _times_ten, HookType.AFTER)
    HookRegistry.register("hook_probe.Probe.gone", _times_ten, HookType.AFTER)
    with caplog.at_level(logging.ERROR):
        applied = HookRegistry.apply_hooks()
    assert applied == ["hook_probe.Probe.method"] and probe().method(1) == 20
    assert "Failed to apply hooks to hook_probe.Probe.gone" in caplog.text
    assert HookRegistry.is_patched("hook_probe.Probe.method") and not HookRegistry.is_patched("hook_probe.Probe.gone")


def test_strict_names_every_failed_target_and_drops_its_hooks(probe):
    HookRegistry.register("hook_probe.Probe.method", _times_ten, HookType.AFTER)
    HookRegistry.register("hook_probe.Probe.gone", _times_ten, HookType.AFTER)
    HookRegistry.register("hook_probe_missing.Thing.run", _times_ten, HookType.AFTER)
    with pytest.raises(HookApplyError) as error:
        HookRegistry.apply_hooks(strict=True)
    assert set(error.value.failures) == {"hook_probe.Probe.gone", "hook_probe_missing.Thing.run"}
    assert isinstance(error.value.failures["hook_probe.Probe.gone"], AttributeError)
    assert "hook_probe.Probe.gone" in str(error.value)
    assert probe().method(1) == 20  # the target that resolved was patched
    assert "hook_probe.Probe.gone" not in HookRegistry._hooks  # not retried by a later apply
    assert HookRegistry.apply_hooks(strict=True) == []


def test_targets_applies_only_the_group_asked_for(probe):
    HookRegistry.register("hook_probe.Probe.method", _times_ten, HookType.AFTER)
    HookRegistry.register("hook_probe.Probe.other", _times_ten, HookType.AFTER)
    assert HookRegistry.apply_hooks(strict=True, targets=["hook_probe.Probe.method"]) == ["hook_probe.Probe.method"]
    assert (probe().method(1), probe().other(1)) == (20, 3)  # the other one waits for its own apply
    assert HookRegistry.apply_hooks(strict=True, targets=["hook_probe.Probe.other"]) == ["hook_probe.Probe.other"]
    assert probe().other(1) == 30


def test_a_listed_target_without_a_hook_is_a_failure(probe):
    with pytest.raises(HookApplyError, match="no hook registered"):
        HookRegistry.apply_hooks(strict=True, targets=["hook_probe.Probe.method"])
