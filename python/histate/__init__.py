"""HiState: a prefix-cache manager for hybrid (attention + recurrent) LLMs.

Subpackages, dependencies pointing one way (everything -> core):
  core           pure policy engine (no torch, sglang, I/O or wall clock)
  sim            trace replay simulator (loaders, workloads, cost model, reports)
  storage        SSD checkpoint / cold-KV store (NIXL POSIX, plain-file fallback)
  reference      exactness harness on a tiny random-weight Qwen3.5 (torch, transformers)
  sglang_plugin  the SGLang 0.5.23 integration; the only package that imports sglang
"""

__version__ = "0.1.0"
