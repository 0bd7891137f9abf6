"""HiState's SGLang 0.5.23 integration: the only package of `histate` that imports sglang.

Loaded by SGLang through the `sglang.srt.plugins` entry point (`plugin.register`). Modules:
  config           HiStateConfig: --histate-* flags / HISTATE_* env vars (pure, no sglang)
  server_settings  settings --enable-histate implies, flags it rejects (pure, no sglang)
  cli_hooks        ServerArgs hooks that add, stash and apply the flags
  plugin           the entry point: declares hooks and the "histate" radix-cache backend
Importing this package imports nothing from SGLang; submodules that need it import it.
"""
