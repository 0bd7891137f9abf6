"""Everything a process needs before `import sglang` to serve on this CPU (test and bench support).

Order matters: the import stubs (triton, torchvision, datasets; `sglang_cpu.stubs`) first, since
`import sglang` imports triton; then the `sgl_kernel` stand-in, which SGLang's CPU engine imports;
then the post-import patches.
"""
from __future__ import annotations


def install() -> None:
    from sglang_cpu import stubs

    from . import kernels, patches

    stubs.install()
    kernels.install()
    patches.install()
