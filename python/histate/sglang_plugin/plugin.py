"""Entry point `sglang.srt.plugins: histate` (python/pyproject.toml) -- what SGLang runs at start.

SGLang calls `register()` through `sglang.srt.plugins.load_plugins()` in every process it starts
(launcher before argv parsing, Engine, each spawned scheduler), then `HookRegistry.apply_hooks()`.
`register()` must therefore be cheap and idempotent. It only declares:
  * the ServerArgs hooks that add and apply `--enable-histate` / `--histate-*` (cli_hooks);
  * a resolution-step wrapper that rejects non-hybrid models once the model config is known;
  * the radix-cache backend "histate" (factory imported lazily, in the scheduler).
Everything heavier (host sizing hooks, stack strategy, metrics) is installed by the factory, in
the scheduler process, and only when HiState is actually selected.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable

logger = logging.getLogger(__name__)

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_registered = False


def _check_hybrid_model(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution-step wrapper, run once the model config and the page size are resolved
    (`handle_hicache`, after the page-size default; arg_groups/pipeline.py): HiState needs
    recurrent state, and intervals the user gave must sit on this server's state grid."""
    from .cli_hooks import config_of, report_config_error
    from .config import HiStateConfigError

    config = config_of(server_args)
    if config.enable:
        from sglang.srt.arg_groups.model_override_base import model_config_of
        from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state

        model_config = model_config_of(server_args)
        try:
            if not uses_ssm_state(model_config):
                arch = getattr(model_config.hf_config, "architectures", None) or ["?"]
                raise HiStateConfigError(
                    f"--enable-histate needs a hybrid model with recurrent (Mamba / Gated-DeltaNet) "
                    f"layers; {arch[0]} has none. Drop --enable-histate for this model."
                )
            config.intervals_pages(state_grid_tokens(server_args))
        except HiStateConfigError as error:
            report_config_error(server_args, error)
    previous(server_args)


def state_grid_tokens(server_args: Any) -> int:
    """Where SGLang can keep a checkpoint: lcm(the model's state chunk, page size), as
    `runtime_context.mamba_checkpoint_grid` computes it for the cache (runtime_context.py:1966-1971;
    the cache re-checks with its own tree page, which DCP can widen)."""
    from sglang.srt.arg_groups.overrides import mamba_cache_chunk_size, resolved_view

    return math.lcm(mamba_cache_chunk_size(server_args), resolved_view(server_args).page_size)


def _lazy_factory(ctx: Any) -> Any:
    from .tree_cache import histate_cache_factory

    return histate_cache_factory(ctx)


def register() -> None:
    """Declare HiState's hooks and its radix-cache backend (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import cli_hooks
    from .server_settings import RADIX_BACKEND_NAME

    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", cli_hooks.add_cli_args_after, HookType.AFTER)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", cli_hooks.from_cli_args_around, HookType.AROUND)
    HookRegistry.register(f"{_SERVER_ARGS}.resolve_once", cli_hooks.resolve_once_before, HookType.BEFORE)
    register_resolution_hook("handle_hicache")(_check_hybrid_model)
    if RADIX_BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(RADIX_BACKEND_NAME, _lazy_factory)
    _registered = True
    logger.debug("HiState plugin registered")
