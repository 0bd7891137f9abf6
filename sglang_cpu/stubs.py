"""Test-only bootstrap that lets SGLang 0.5.23 import on a CPU-only machine.

SGLang imports `triton` unconditionally (srt/utils/common.py) and, through its multimodal
configs, `torchvision.transforms`; neither is installable here (triton is ~1 GB, the reachable
torchvision wheels are CUDA builds). Its UnifiedRadixCache test kit imports HF `datasets`
(through `sglang.benchmark`), which a `--no-deps` install lacks. SGLang ships its own triton stub for Apple-Silicon MPS
(`sglang/_platform_stubs.py`, gated on darwin + MPS). We load that file by path (so
`sglang/__init__.py` does not run first), run its installer with the platform gate answered
"darwin/arm64/MPS", and add torchvision and datasets stubs built from the same mock-module class.

Shared by the tests and benchmark/sglang_ops.py; the plugin's production path never imports it.
Call `install()` before the first `import sglang`.
"""
from __future__ import annotations

import enum
import importlib.util
import os
import sys
import types
from unittest import mock

_STUBS_MODULE = "_histate_sglang_platform_stubs"


def _load_sglang_stub_file() -> types.ModuleType:
    if _STUBS_MODULE in sys.modules:
        return sys.modules[_STUBS_MODULE]
    spec = importlib.util.find_spec("sglang")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "_platform_stubs.py")
    file_spec = importlib.util.spec_from_file_location(_STUBS_MODULE, path)
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[_STUBS_MODULE] = module  # dataclasses look the module up while executing it
    file_spec.loader.exec_module(module)
    return module


def _torchvision_importable() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


class _MockPackageFinder:
    """Meta-path finder that answers every `<prefix>.*` import with a mock module."""

    def __init__(self, prefix: str, stubs: types.ModuleType):
        self.prefix = prefix
        self.stubs = stubs

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.prefix and not fullname.startswith(self.prefix + "."):
            return None
        if fullname in sys.modules:
            return getattr(sys.modules[fullname], "__spec__", None)
        module = self.stubs._MockModule(fullname)
        sys.modules[fullname] = module
        parent, _, child = fullname.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)
        return module.__spec__


def _install_triton(stubs: types.ModuleType) -> None:
    import torch

    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    apple = types.SimpleNamespace(platform="darwin", modules=sys.modules, meta_path=sys.meta_path)
    with (
        mock.patch.object(stubs, "sys", apple),
        mock.patch.object(stubs, "platform", types.SimpleNamespace(machine=lambda: "arm64")),
        mock.patch.object(torch.backends.mps, "is_available", return_value=True),
    ):
        stubs.install_platform_stubs()
    if "triton" not in sys.modules:
        raise ImportError("SGLang's triton stub did not install")


def _install_torchvision(stubs: types.ModuleType) -> None:
    if "torchvision" in sys.modules or _torchvision_importable():
        return
    sys.modules.pop("torchvision", None)
    sys.meta_path.insert(0, _MockPackageFinder("torchvision", stubs))
    torchvision = stubs._make_mock("torchvision")
    transforms = stubs._make_mock("torchvision.transforms")
    functional = stubs._make_mock("torchvision.transforms.functional")
    torchvision.transforms = transforms
    transforms.functional = functional

    class InterpolationMode(enum.Enum):  # read at import time by sglang and transformers
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    functional.InterpolationMode = InterpolationMode
    transforms.InterpolationMode = InterpolationMode
    torchvision.__version__ = "0.0.0"  # transformers compares versions


def _install_datasets(stubs: types.ModuleType) -> None:
    """HF `datasets`, imported by `sglang.benchmark` on the way to `sglang.test.test_utils` (which
    the UnifiedRadixCache test kit imports for its TestCase base); no test here loads a dataset."""
    if "datasets" in sys.modules or importlib.util.find_spec("datasets") is not None:
        return
    sys.meta_path.insert(0, _MockPackageFinder("datasets", stubs))


def install() -> None:
    """Install the triton, torchvision and datasets stubs (idempotent)."""
    stubs = _load_sglang_stub_file()
    _install_triton(stubs)
    _install_torchvision(stubs)
    _install_datasets(stubs)


def run_module_as_main(module: str, argv: list[str]) -> None:
    """`python -m module argv...` with the stubs installed (for subprocess tests)."""
    import runpy

    install()
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # python sglang_cpu/stubs.py <module> [args...]
    run_module_as_main(sys.argv[1], sys.argv[2:])
