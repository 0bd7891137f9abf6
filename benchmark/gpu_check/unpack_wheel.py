"""Install a wheel by unpacking it, for when pip will not (no pip, or a tag this Python does not match).

SGLang 0.5.23's wheel is tagged cp311 (it ships Rust extensions for the server); on another Python,
pip refuses it, yet the Triton GDN kernels are plain Python + Triton. This unpacks the wheel's files
into site-packages, leaving out compiled extensions built for another interpreter, and keeps the
.dist-info so `importlib.metadata.version("sglang")` still answers. Stdlib only.

    python unpack_wheel.py WHEEL [WHEEL ...] [--if-missing]

--if-missing: skip a wheel whose top-level modules all import already (pure helper wheels).
"""
from __future__ import annotations

import importlib.util
import sys
import sysconfig
import zipfile
from pathlib import Path


def top_levels(names: list[str]) -> set[str]:
    """Importable top-level names: packages (folders) and single-file modules (.pth files and the like
    are not modules)."""
    tops = set()
    for name in names:
        first, sep, _ = name.partition("/")
        if first.endswith((".dist-info", ".data")):
            continue
        top = first if sep else (first[:-3] if first.endswith(".py") else "")
        if top.isidentifier():
            tops.add(top)
    return tops


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def unpack(wheel: Path, dest: Path, if_missing: bool) -> str:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        tops = top_levels(names)
        if if_missing and tops and all(importable(t) for t in tops):
            return f"{wheel.name}: already importable ({', '.join(sorted(tops))})"
        tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
        skipped = 0
        for name in names:
            if name.endswith((".so", ".pyd")) and tag not in name:
                skipped += 1  # an extension built for another interpreter cannot load here
                continue
            if name.split("/", 1)[0].endswith(".data"):
                continue  # scripts and headers: not needed to import the package
            archive.extract(name, dest)
    return f"{wheel.name}: unpacked into {dest}" + (f" ({skipped} extension modules for another Python left out)"
                                                     if skipped else "")


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if_missing = "--if-missing" in sys.argv[1:]
    dest = Path(sysconfig.get_paths()["purelib"])
    for wheel in args:
        print(unpack(Path(wheel), dest, if_missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
