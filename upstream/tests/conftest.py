"""The CPU stand-ins SGLang needs to import without CUDA (test support only: sglang_cpu/stubs.py), as
test/sglang/conftest.py installs them. On SGLang's own CI, with a GPU, this file would not exist."""
from sglang_cpu import stubs

stubs.install()
