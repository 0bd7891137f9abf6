"""Session bootstrap for the SGLang plugin tests (CPU only, real SGLang classes).

* Skips this directory when SGLang is not installed (`make venv` installs it --no-deps).
* Installs the triton/torchvision stubs (test and benchmark only; see sglang_cpu/stubs.py) before anything
  imports sglang, pins torch to one thread, and loads SGLang's plugins once per session
  (importing SGLang alone takes seconds, so every test shares this one bootstrap).
* Clears HISTATE_* env vars around each test so the env-var path is tested explicitly.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("sglang") is None:  # pragma: no cover - environment without SGLang
    collect_ignore_glob = ["test_*.py"]
else:
    from sglang_cpu import stubs  # noqa: E402  (pytest puts the repository root on sys.path: test/ is a package)

    stubs.install()
    import torch  # noqa: E402

    torch.set_num_threads(1)


def _skip_without_mooncake():
    from histate.l3 import services

    reason = services.unavailable_reason()
    if reason:
        pytest.skip(f"loopback Mooncake unavailable: {reason}")


@pytest.fixture(scope="module")
def mooncake():
    """A loopback Mooncake master + store service shared by one test module (test_l3_*.py)."""
    from histate.l3 import services

    _skip_without_mooncake()
    with services.LoopbackMooncake(segment_size_bytes=32 * 2**20) as mc:
        yield mc


@pytest.fixture
def own_mooncake():
    """A master + store service for one test alone (the test kills the store service)."""
    from histate.l3 import services

    _skip_without_mooncake()
    with services.LoopbackMooncake(segment_size_bytes=16 * 2**20) as mc:
        yield mc


def pytest_configure(config):
    # SGLang warns about CUDA-only quantization backends and torch.jit deprecations at import.
    config.addinivalue_line("filterwarnings", "ignore:Only CUDA")
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:torch.jit")


@pytest.fixture
def isolated_hooks(monkeypatch):
    """SGLang's HookRegistry and HiState's installed/failed group records, copied for one test (what
    the test registers is gone after it); returns the registry."""
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry

    from histate.sglang_plugin import hooks

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list, {k: list(v) for k, v in HookRegistry._hooks.items()}))
    monkeypatch.setattr(HookRegistry, "_patched", set(HookRegistry._patched))
    monkeypatch.setattr(hooks, "_installed", set(hooks._installed))
    monkeypatch.setattr(hooks, "_failed", dict(hooks._failed))
    return HookRegistry


@pytest.fixture(scope="session")
def sglang_plugins():
    """Load SGLang's plugin entry points once (registers HiState's hooks and backend)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return True


@pytest.fixture(autouse=True)
def _clean_histate_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("HISTATE_"):
            monkeypatch.delenv(name)
    yield
