"""Exactness harness: a tiny random-weight Qwen3.5 whose KV and recurrent states flow through HiState.

  model          the tiny Qwen3.5 (transformers, CPU) and the shapes of its cached state
  gdr            chunked / recurrent gated delta rule; the chunked form hands out states at chosen
                 64-token boundaries (several checkpoints from one prefill)
  gdn_kernels    runs transformers' GDN layers on those kernels (fp32 or fp64) and captures states
  hybrid_cache   KV pages + a checkpoint <-> transformers' hybrid DynamicCache
  runner         prefill / decode / cold runs with fixed numerics
  tokenizer      one character per token id (text prompts and streamed text for `histate serve`)
  page_keys      prefix-chained page keys
  tier_stores    per-tier stores (GPU pool slots, CPU buffers, SSD objects via histate.storage)
  executor       ReferenceExecutor: serves requests with histate.core deciding what lives where
  workloads      seeded agent workloads (append, fork, truncate, rewind-edit, returns after demotion)
  exactness      the comparison with a cold prefill and its tolerances (docs/exactness.md)

Needs the `reference` extra (torch, transformers) and sgl-kernel-ext (`histate_kernels`).
"""
