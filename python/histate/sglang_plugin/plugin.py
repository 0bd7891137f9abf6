"""Entry point `sglang.srt.plugins: histate` (python/pyproject.toml) -- what SGLang runs at start.

SGLang calls `register()` through `sglang.srt.plugins.load_plugins()` in every process it starts
(launcher before argv parsing, Engine, each spawned scheduler), then `HookRegistry.apply_hooks()`.
`register()` must therefore be cheap and idempotent. It only declares:
  * the ServerArgs hooks that add and apply `--enable-histate` / `--histate-*` (cli_hooks), installed
    and verified as one group (hooks.install_once: every target must end up patched); on a SGLang
    with plugin-declared arguments (upstream/series 0003) the same flags are declared to it instead;
  * a resolution-step wrapper that, once the model config is known, refuses models and modes no test
    proves (non-hybrid models, recurrent layers other than Qwen3-Next / Qwen3.5 Gated-DeltaNet,
    attention DP, full prefill CUDA graphs) and checks the intervals against the state grid;
  * the radix-cache backend "histate" (factory imported lazily, in the scheduler).
Everything heavier (host sizing hooks, stack strategy, metrics) is installed by the factory, in
the scheduler process, and only when HiState is actually selected.

Fail-closed registration: `load_plugins` catches (and only logs) an exception from `register()`. So
when the ServerArgs hooks cannot be installed (SGLang renamed something), a process that asks for
HiState (`--enable-histate` / `--histate-*` on its command line, or `HISTATE_ENABLE`) ends with one
line and exit status 2 (SystemExit, which `load_plugins` does not catch); any other process gets a
RuntimeError that SGLang logs, and HiState registers nothing else (no backend, no resolution step).
"""
from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_RESOLUTION_STEP = "handle_hicache"
SERVER_ARGS_GROUP = "server_args"
_registered = False
_registration_error: Optional[str] = None

PROVEN_FAMILY = "Gated-DeltaNet layers run by GDNAttnBackend (the Qwen3-Next / Qwen3.5 family)"


def unsupported_recurrent_layers(model_config: Any) -> Optional[str]:
    """None when the model's recurrent layers are ones HiState's in-pass captures are implemented and
    tested for: Gated-DeltaNet layers of SGLang's Qwen3-Next / Qwen3.5 models (text, MoE and VL
    wrappers, whose text config is a `Qwen3NextConfig`), which SGLang runs on `GDNAttnBackend` through
    `RadixLinearAttention` (capture_forward.py hooks exactly that backend). Otherwise, what the layers
    are and which backend runs them, in the order SGLang's attention registry picks the backend
    (layers/attention/attention_registry.py:392-560). For those the scheduler would allocate capture
    slots that no hook fills."""
    from sglang.srt.configs import InklingMMConfig, InklingModelConfig, JetNemotronConfig, JetVLMConfig
    from sglang.srt.configs import Lfm2Config, Lfm2MoeConfig, Lfm2VlConfig, Qwen3NextConfig, ZayaConfig
    from sglang.srt.configs.hybrid_arch import (glm5_next_config, hybrid_gdn_config, hybrid_lightning_config,
                                                kimi_linear_config, linear_attn_model_spec, mamba2_config)

    if isinstance(model_config.hf_config, (InklingModelConfig, InklingMMConfig)):
        return "Inkling short convolutions (InklingShortConvAttnBackend)"
    gdn = hybrid_gdn_config(model_config)
    if gdn is not None:
        if isinstance(gdn, Qwen3NextConfig):  # Qwen3-Next, Qwen3.5 (dense, MoE, VL text configs)
            return None
        if isinstance(gdn, (JetNemotronConfig, JetVLMConfig)):
            return ("Jet-Nemotron JetBlocks, which call their own dynamic convolution and recurrent kernel instead "
                    "of GDNAttnBackend's extend (models/jet_nemotron.py:257-320)")
        return f"Gated-DeltaNet layers of {type(gdn).__name__}, not covered by HiState's tests"
    mamba = mamba2_config(model_config)
    if mamba is not None:
        if isinstance(mamba, (ZayaConfig, Lfm2Config, Lfm2MoeConfig, Lfm2VlConfig)):
            return "short convolutions (ShortConvAttnBackend)"
        return "Mamba2 layers (Mamba2AttnBackend)"
    if kimi_linear_config(model_config) is not None or glm5_next_config(model_config) is not None:
        return "Kimi Delta Attention layers (KDAAttnBackend)"
    if hybrid_lightning_config(model_config) is not None:
        return "Lightning attention layers (LightningAttentionBackend)"
    spec = linear_attn_model_spec(model_config)
    if spec is not None:
        backend = spec.backend_class_name.rsplit(".", 1)[-1]
        return f"linear-attention layers of {spec.config_class.__name__} on {backend}, not covered by HiState's tests"
    return "recurrent layers of a kind SGLang's backend registry does not name"


def gdn_extend_runs_in_prefill_graph() -> bool:
    """Whether a breakable prefill CUDA graph would run GDN's extend inside the graph. SGLang 0.5.23:
    no. `RadixLinearAttention` runs a linear layer's extend through an `eager_on_graph` break unless the
    backend's `supports_prefill_graph_extend()` holds (layers/radix_linear_attention.py:97-120, 162-167;
    hybrid_linear_attn_backend.py:1209-1216, 1285-1288), which only KDAAttnBackend overrides
    (kda_backend.py:624); GDNAttnBackend keeps MambaAttnBackendBase's False (hybrid_linear_attn_backend.py:
    121-128). Checked on the classes, so a SGLang that moves GDN's extend into the graph is refused."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    return GDNAttnBackend.supports_prefill_graph_extend is not MambaAttnBackendBase.supports_prefill_graph_extend


# Attention backends SGLang 0.5.23 lets run on the page-major KV layout that the unified device pool
# implies, for an MHA model without asymmetric K/V rows (the Qwen3.5 family): arg_groups/
# kv_cache_hook.py:793-826, checked there after this resolution step (pipeline.py:336) by an assert.
PAGE_MAJOR_ATTENTION_BACKENDS = frozenset({"triton", "fa3", "fa4", "flashinfer", "trtllm_mha"})


def check_device_pool(server_args: Any, device_pool: str) -> None:
    """The unified device pool (HiState's default) needs an attention backend that reads KV through
    SGLang's translator; refuse others here with one line rather than let SGLang's later assert end
    the launch with a traceback (torch_native, SGLang's CPU backend, is one: issue 27, R3)."""
    from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolved_view

    from .config import HiStateConfigError

    if device_pool != "unified":
        return
    backends = {b for b in attention_backends_of(resolved_view(server_args)) if b is not None}
    unsupported = sorted(backends - PAGE_MAJOR_ATTENTION_BACKENDS)
    if unsupported:
        raise HiStateConfigError(
            f"--enable-histate: its default device pool (--histate-device-pool unified) implies SGLang's page-major "
            f"KV layout, which the attention backend {', '.join(unsupported)} does not read; use --attention-backend "
            f"{'/'.join(sorted(PAGE_MAJOR_ATTENTION_BACKENDS))} or --histate-device-pool static")


def check_model_and_modes(server_args: Any) -> None:
    """What only the model config and the resolved settings show (raises HiStateConfigError)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state

    from .config import HiStateConfigError

    model_config = model_config_of(server_args)
    arch = (getattr(model_config.hf_config, "architectures", None) or ["?"])[0]
    if not uses_ssm_state(model_config):
        raise HiStateConfigError(
            f"--enable-histate needs a hybrid model with recurrent (Gated-DeltaNet) layers; {arch} has none. "
            f"Drop --enable-histate for this model.")
    layers = unsupported_recurrent_layers(model_config)
    if layers is not None:
        raise HiStateConfigError(
            f"--enable-histate: {arch} is not supported: its recurrent layers are {layers}, while HiState captures "
            f"checkpoints only from {PROVEN_FAMILY}, so its capture slots would stay unfilled. Drop --enable-histate "
            f"for this model.")
    view = resolved_view(server_args)
    attn_dp = int(getattr(view, "attn_dp_size", 1) or 1)
    if attn_dp > 1:  # --attn-dp-size, --enable-dp-attention or --dwdp-size, resolved by now
        raise HiStateConfigError(
            f"--enable-histate: attention data parallelism (attn_dp_size {attn_dp}, from --attn-dp-size, "
            f"--enable-dp-attention or --dwdp-size) is not supported (not covered by HiState's tests); drop one "
            f"of them")
    prefill = getattr(getattr(getattr(view, "cuda_graph_config", None), "prefill", None), "backend", None)
    if prefill == "full":
        raise HiStateConfigError(
            "--enable-histate: a full prefill CUDA graph (cuda_graph_config.prefill.backend full) is not supported "
            "(its replay runs the GDN extend inside the graph, where HiState's capture hooks do not run, so planned "
            "checkpoints stay unfilled); use --cuda-graph-backend-prefill breakable or disabled")
    if prefill == "breakable" and gdn_extend_runs_in_prefill_graph():
        raise HiStateConfigError(
            "--enable-histate: --cuda-graph-backend-prefill breakable is not supported with this SGLang (its "
            "GDNAttnBackend runs the extend inside the prefill graph, where HiState's capture hooks do not run); "
            "use --cuda-graph-backend-prefill disabled")


def _check_model(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution-step wrapper, run once the model config and the page size are resolved
    (`handle_hicache`, after the page-size default, the CUDA-graph and attention-DP settings;
    arg_groups/pipeline.py): the model and modes HiState supports (`check_model_and_modes`), and
    intervals the user gave must sit on this server's state grid."""
    from .cli_hooks import config_of, report_config_error
    from .config import HiStateConfigError

    config = config_of(server_args)
    if config.enable:
        try:
            check_model_and_modes(server_args)
            check_device_pool(server_args, config.device_pool)
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


def histate_requested(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether this process was asked for HiState: a HiState flag on its command line (as argparse
    will read it, `--flag=value` included) or a true `HISTATE_ENABLE`."""
    for arg in argv:
        name = str(arg).split("=", 1)[0]
        if name == "--enable-histate" or name.startswith("--histate-"):
            return True
    return str(environ.get("HISTATE_ENABLE", "")).strip().lower() in ("1", "true", "yes", "on")


def server_args_hooks() -> list:
    from . import cli_hooks

    return [
        (f"{_SERVER_ARGS}.add_cli_args", cli_hooks.add_cli_args_after, "AFTER"),
        (f"{_SERVER_ARGS}.from_cli_args", cli_hooks.from_cli_args_around, "AROUND"),
        (f"{_SERVER_ARGS}.resolve_once", cli_hooks.resolve_once_before, "BEFORE"),
    ]


def register() -> None:
    """Declare HiState's hooks and its radix-cache backend (idempotent; fail-closed, module docstring)."""
    global _registered, _registration_error
    if _registered:
        return
    _registered = True
    from .cli_hooks import plugin_args_spec, upstream_plugin_args
    from .hooks import install_once

    try:
        api = upstream_plugin_args()
        if api is not None:  # upstream/series 0003: SGLang owns the flags' whole path
            api.register_plugin_args(plugin_args_spec(api))
        else:
            install_once(SERVER_ARGS_GROUP, server_args_hooks())
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        register_resolution_hook(_RESOLUTION_STEP)(_check_model)
    except Exception as error:  # a renamed ServerArgs method or resolution step
        _registration_error = str(error).splitlines()[0]
        if histate_requested(sys.argv[1:], os.environ):
            from .cli_hooks import exit_with_usage_error

            exit_with_usage_error(f"--enable-histate: {_registration_error}")
        raise RuntimeError(f"HiState is not available in this process: {_registration_error}") from error
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from .server_settings import RADIX_BACKEND_NAME

    if RADIX_BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(RADIX_BACKEND_NAME, _lazy_factory)
    logger.debug("HiState plugin registered")
