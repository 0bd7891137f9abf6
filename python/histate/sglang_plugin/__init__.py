"""HiState's SGLang 0.5.23 integration: the only package of `histate` that imports sglang.

Loaded by SGLang through the `sglang.srt.plugins` entry point (`plugin.register`). Modules:
  config           HiStateConfig: --histate-* flags / HISTATE_* env vars (pure, no sglang)
  server_settings  settings --enable-histate implies, flags it rejects (pure, no sglang)
  cli_hooks        ServerArgs hooks that add, stash and apply the flags
  plugin           the entry point: declares hooks and the "histate" radix-cache backend
  tree_cache       HiStateRadixCache (UnifiedRadixCache subclass) and the backend factory
  runtime          the core's PolicyState over SGLang's tree: refresh, EMAs, admission, residence samples
  core_nodes       CoreNode: an SGLang node in the core's node shape (persistent adapter)
  eviction         the core's victim heaps on every tier, and which units SGLang's walks can evict
  components       FULL / MAMBA component overrides (device and host walks, checkpoint stamps)
  clock            the clock every TP/PP rank agrees on (piggybacked on SGLang's per-step all-reduce)
  tree_core        SGLang's Python tree core plus change notifications (backend "histate")
  host_stack       host DRAM sizing: KV first, bounded state staging (register_stack_strategy)
  storage_backend  the `dynamic` HiCache storage backend over histate.storage
  metrics          Prometheus series next to SGLang's own
Importing this package imports nothing from SGLang; submodules that need it import it.
"""
