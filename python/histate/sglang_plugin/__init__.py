"""HiState's SGLang 0.5.23 integration: the only package of `histate` that imports sglang.

Loaded by SGLang through the `sglang.srt.plugins` entry point (`plugin.register`). Modules:
  config           HiStateConfig: --histate-* flags / HISTATE_* env vars (pure, no sglang)
  server_settings  settings --enable-histate implies, flags it rejects (pure, no sglang)
  cli_hooks        ServerArgs hooks that add, stash and apply the flags
  plugin           the entry point: declares hooks and the "histate" radix-cache backend
  tree_cache       HiStateRadixCache (UnifiedRadixCache subclass) and the backend factory
  runtime          per-cache policy state: clock, core policy, EMAs, interval plans
  components       FULL / MAMBA component overrides (unified eviction walk, SSD validator)
  eviction         unified ranking of checkpoints and bundles with the core's eq. 7 score
  node_view        SGLang nodes in the shape histate.core scores
  tree_core        SGLang's Python tree core plus change notifications (backend "histate")
  host_stack       host DRAM sizing: KV first, bounded state staging (register_stack_strategy)
  storage_backend  the `dynamic` HiCache storage backend over histate.storage
  metrics          Prometheus series next to SGLang's own
Importing this package imports nothing from SGLang; submodules that need it import it.
"""
