"""What `--enable-histate` means for SGLang's own flags: settings it implies and flags it rejects.

Owns the conflict table (one clear message per incompatible flag) and the translation of a
`HiStateConfig` into SGLang `ServerArgs` field values (radix backend, hierarchical cache,
unified device pool, the `dynamic` storage backend and its extra config). Works on any object
with SGLang's field names as attributes (the raw `ServerArgs` record before resolution, or an
argparse namespace), so it is testable without building a server. No sglang import.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Optional

from histate.core import DECODE_TRACK_INTERVAL_TOKENS, STATE_GRID_TOKENS

from .config import HiStateConfig, HiStateConfigError, parse_storage_section

SGLANG_MAMBA_TRACK_INTERVAL = DECODE_TRACK_INTERVAL_TOKENS  # SGLang's default --mamba-track-interval
RADIX_BACKEND_NAME = "histate"
STORAGE_BACKEND_NAME = "histate"
STORAGE_MODULE_PATH = "histate.sglang_plugin.storage_backend"
STORAGE_CLASS_NAME = "HiStateStorageBackend"
EXTRA_CONFIG_KEY = "histate"
"""Key of HiState's own section inside --hicache-storage-backend-extra-config."""


def _flag(raw: Any, name: str, default: Any = None) -> Any:
    return getattr(raw, name, default)


def _eviction_policy(raw: Any) -> str:
    return str(_flag(raw, "radix_eviction_policy") or "lru").lower()


# (predicate on the raw settings, message or a function of the raw settings giving it). Checked in order;
# the first match is reported.
_CONFLICTS: tuple[tuple[Callable[[Any], bool], Any], ...] = (
    (lambda r: bool(_flag(r, "enable_int8_mamba_checkpoint")),
     "--enable-histate cannot be combined with --enable-int8-mamba-checkpoint: SGLang 0.5.23's int8 "
     "checkpoints are device-only. HiState moves every checkpoint device -> host -> SSD through SGLang's "
     "host tier, which copies rows of the active state pool by the node's slot number, while an int8 "
     "checkpoint is a slot of a separate int8 pool (wrong bytes; sglang mem_cache/hybrid_cache/"
     "hybrid_pool_assembler.py:1298, unified_cache/components/mamba.py:876-885). SGLang refuses int8 "
     "checkpoints with --enable-hierarchical-cache itself (arg_groups/mamba_hook.py:82-87). Drop "
     "--enable-int8-mamba-checkpoint."),
    (lambda r: bool(_flag(r, "enable_unified_cache_external_linker")),
     "--enable-histate cannot be combined with --enable-unified-cache-external-linker: the "
     "external linker replaces the host tier that HiState's KV-first DRAM policy manages. "
     "Use --histate-ssd-dir for the SSD tier instead."),
    (lambda r: bool(_flag(r, "enable_kv_cache_sharding")),
     "--enable-histate cannot be combined with --enable-kv-cache-sharding: KV sharding needs "
     "SGLang's built-in cache with rotation bases, while HiState's cache runs on the Python "
     "tree core. Drop --enable-kv-cache-sharding."),
    (lambda r: _flag(r, "radix_cache_backend") not in (None, RADIX_BACKEND_NAME),
     "--enable-histate selects --radix-cache-backend histate itself; it cannot be combined with "
     "another --radix-cache-backend. Drop that flag."),
    (lambda r: bool(_flag(r, "disable_radix_cache")),
     "--enable-histate cannot be combined with --disable-radix-cache: HiState is a prefix cache."),
    (lambda r: bool(_flag(r, "enable_lmcache")),
     "--enable-histate cannot be combined with --enable-lmcache: both replace SGLang's tree cache."),
    (lambda r: bool(_flag(r, "enable_flexkv")),
     "--enable-histate cannot be combined with --enable-flexkv: both replace SGLang's tree cache."),
    (lambda r: _flag(r, "hicache_host_memory_mode", "cache") == "buffer_only",
     "--enable-histate needs --hicache-host-memory-mode cache: with buffer_only SGLang keeps no cached "
     "data in host DRAM (the tree holds no host copies and host eviction frees nothing; sglang "
     "mem_cache/unified_radix_cache.py:1437-1440), while HiState's host tier keeps reusable KV there and "
     "lands SSD-restored checkpoints there. Drop --hicache-host-memory-mode buffer_only (--hicache-size "
     "sets HiState's DRAM budget)."),
    (lambda r: _flag(r, "mamba_radix_cache_strategy") == "extra_buffer_lazy",
     "--enable-histate does not support --mamba-radix-cache-strategy extra_buffer_lazy yet: its "
     "on-demand track slots are not covered by HiState's checkpoint placement and tests. Use "
     "extra_buffer (or auto)."),
    (lambda r: _eviction_policy(r) != "lru",
     lambda r: f"--enable-histate cannot be combined with --radix-eviction-policy {_eviction_policy(r)}: HiState's "
               "ranking is the eviction policy (paper eq. 7, H = t_last + tau * C / M, over KV bundles and "
               "checkpoints on device, host and SSD), so SGLang's policy would not be applied. Drop "
               "--radix-eviction-policy; --histate-tau sets how much recompute cost outweighs recency."),
    (lambda r: _flag(r, "radix_eviction_policy_config") is not None,
     "--enable-histate cannot be combined with --radix-eviction-policy-config: it tunes SGLang's eviction "
     "policy, which HiState's ranking (eq. 7) replaces. Drop it; --histate-tau tunes HiState's ranking."),
    (lambda r: _flag(r, "hicache_storage_backend") not in (None, "dynamic"),
     "--enable-histate brings its own SSD backend; drop --hicache-storage-backend "
     "and give --histate-ssd-dir DIR instead."),
    # Modes no HiState test proves (docs/sglang.md, "What it rejects"); sglang paths are in the messages.
    (lambda r: bool(_flag(r, "enable_two_batch_overlap")),
     "--enable-histate: --enable-two-batch-overlap is not supported (two-batch overlap runs each batch as two "
     "child ForwardBatches built from SGLang's own fields, which do not carry HiState's in-pass capture list, so "
     "planned checkpoints would stay unfilled; sglang batch_overlap/two_batch_overlap.py:666-879); drop one of them"),
    (lambda r: _flag(r, "speculative_algorithm") is not None,
     lambda r: f"--enable-histate: --speculative-algorithm {_flag(r, 'speculative_algorithm')} is not supported "
               "(draft-extend and target-verify passes are not covered by HiState's in-pass captures, checkpoint "
               "placement or tests); drop one of them"),
    (lambda r: bool(_flag(r, "enable_dp_attention")),
     "--enable-histate: --enable-dp-attention is not supported (attention data parallelism is not covered by "
     "HiState's tests); drop one of them"),
    (lambda r: _int_flag(r, "attn_dp_size", 1) > 1,
     lambda r: f"--enable-histate: --attn-dp-size {_flag(r, 'attn_dp_size')} is not supported (attention data "
               "parallelism is not covered by HiState's tests); drop one of them"),
    (lambda r: _flag(r, "disaggregation_mode", "null") not in (None, "null"),
     lambda r: f"--enable-histate: --disaggregation-mode {_flag(r, 'disaggregation_mode')} is not supported (PD "
               "disaggregation moves KV and state between servers outside HiState's tiers and is not covered by its "
               "tests); drop one of them"),
    (lambda r: _int_flag(r, "pp_size", 1) > 1,
     lambda r: f"--enable-histate: --pp-size {_flag(r, 'pp_size')} is not supported (HiState's rank agreement rides "
               "on the tensor-parallel group's per-step all-reduce, and no HiState test runs pipeline stages); drop "
               "one of them"),
    (lambda r: _int_flag(r, "mamba_max_states_per_path", -1) != -1,
     lambda r: f"--enable-histate: --mamba-max-states-per-path {_flag(r, 'mamba_max_states_per_path')} is not "
               "supported (after each insert SGLang drops the shallowest device checkpoints past the cap, sglang "
               "mem_cache/unified_cache/components/mamba.py:255-320, overriding HiState's checkpoint placement and "
               "eq. 7 ranking, which decide which checkpoints stay); drop it"),
    (lambda r: _prefill_graph_backend(r)[0] == "full",
     lambda r: f"--enable-histate: {_prefill_graph_backend(r)[1]} is not supported (a full prefill CUDA graph "
               "replays the GDN extend inside the graph, where HiState's capture hooks do not run, so planned "
               "checkpoints would stay unfilled; the default breakable graph runs each GDN layer eagerly); use "
               "--cuda-graph-backend-prefill breakable or disabled"),
)


def _int_flag(raw: Any, name: str, default: int) -> int:
    value = _flag(raw, name, default)
    try:
        return int(default if value is None else value)
    except (TypeError, ValueError):
        return default  # SGLang's own validation reports a malformed value


def _prefill_graph_backend(raw: Any) -> tuple[Optional[str], str]:
    """The prefill CUDA-graph backend the user asked for, and the flag that asked: the
    --cuda-graph-config JSON wins over --cuda-graph-backend-prefill, as in SGLang's
    `parse_cuda_graph_config` (arg_groups/cuda_graph_hook.py:32-100)."""
    config = _flag(raw, "cuda_graph_config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            config = None  # SGLang reports malformed JSON itself
    if config is not None and not isinstance(config, dict) and hasattr(config, "to_dict"):
        config = config.to_dict()  # a CudaGraphConfig object (Engine(**kwargs))
    prefill = config.get("prefill") if isinstance(config, dict) else None
    if isinstance(prefill, dict) and prefill.get("backend"):
        backend = str(prefill["backend"])
        return backend, f"--cuda-graph-config prefill.backend {backend}"
    backend = _flag(raw, "cuda_graph_backend_prefill")
    return (str(backend), f"--cuda-graph-backend-prefill {backend}") if backend else (None, "")


def check_conflicts(raw: Any) -> None:
    """Raise HiStateConfigError naming the first SGLang flag that HiState cannot run with."""
    for predicate, message in _CONFLICTS:
        if predicate(raw):
            raise HiStateConfigError(message(raw) if callable(message) else message)


def ignored_settings(raw: Any) -> list[str]:
    """Warnings for SGLang settings HiState accepts but does not apply (logged once at start)."""
    notes = []
    if _flag(raw, "_radix_eviction_policy_explicitly_set", False) and _eviction_policy(raw) == "lru":
        notes.append("--radix-eviction-policy lru is not applied with --enable-histate: HiState's ranking "
                     "(eq. 7, H = t_last + tau * C / M) is the eviction policy on every tier")
    return notes


def load_extra_config(value: Optional[str]) -> dict:
    """Parse --hicache-storage-backend-extra-config (JSON, or '@file' .json/.toml/.yaml)."""
    if not value:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if not value.startswith("@"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise HiStateConfigError(f"--hicache-storage-backend-extra-config: invalid JSON ({e})") from None
    else:
        path = value[1:]
        ext = os.path.splitext(path)[1].lower()
        try:
            if ext == ".json":
                with open(path) as f:
                    parsed = json.load(f)
            elif ext == ".toml":
                import tomllib

                with open(path, "rb") as f:
                    parsed = tomllib.load(f)
            elif ext in (".yaml", ".yml"):
                import yaml

                with open(path) as f:
                    parsed = yaml.safe_load(f)
            else:
                raise HiStateConfigError(
                    f"--hicache-storage-backend-extra-config: {path}: unsupported extension {ext!r}"
                )
        except OSError as e:
            raise HiStateConfigError(f"--hicache-storage-backend-extra-config: cannot read {path}: {e}") from None
    if not isinstance(parsed, dict):
        raise HiStateConfigError("--hicache-storage-backend-extra-config: must be a JSON object")
    return parsed


MOONCAKE_MASTER_KEYS = ("master_server_address", "client_server_address")
MOONCAKE_ENV_VARS = ("MOONCAKE_MASTER", "MOONCAKE_CLIENT", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")


def mooncake_unavailable_reason() -> Optional[str]:
    """Why SGLang's MooncakeStore cannot be built here (None when `mooncake.store` imports)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as exc:  # ImportError, or a missing libibverbs.so.1 (OSError)
        return f"mooncake.store does not import ({exc}); install mooncake-transfer-engine"
    return None


def check_l3(extra: dict, config: HiStateConfig, environ: Optional[dict] = None) -> None:
    """--histate-l3 mooncake needs Mooncake importable and a master configured the way SGLang's
    MooncakeStore looks for one (extra config keys, else the config file variable, else MOONCAKE_*)."""
    if config.l3 != "mooncake":
        return
    name = "HISTATE_L3=mooncake" if config.sources.get("l3") == "env" else "--histate-l3 mooncake"
    reason = mooncake_unavailable_reason()
    if reason:
        raise HiStateConfigError(f"{name}: {reason}")
    environ = os.environ if environ is None else environ
    if not any(extra.get(k) for k in MOONCAKE_MASTER_KEYS) and not any(
            str(environ.get(v, "")).strip() for v in MOONCAKE_ENV_VARS):
        raise HiStateConfigError(
            f"{name}: no Mooncake master configured; give --hicache-storage-backend-extra-config "
            "'{\"master_server_address\": \"HOST:PORT\", ...}' or set MOONCAKE_MASTER (or MOONCAKE_CLIENT, "
            "or SGLANG_HICACHE_MOONCAKE_CONFIG_PATH), as for SGLang's mooncake backend")


def storage_extra_config(raw: Any, config: HiStateConfig) -> dict:
    """The user's extra config plus HiState's backend identity and its `histate` section."""
    extra = load_extra_config(_flag(raw, "hicache_storage_backend_extra_config"))
    ours = {"backend_name": STORAGE_BACKEND_NAME, "module_path": STORAGE_MODULE_PATH,
            "class_name": STORAGE_CLASS_NAME}
    for key, value in ours.items():
        if extra.get(key, value) != value:
            raise HiStateConfigError(
                f"--hicache-storage-backend-extra-config: {key}={extra[key]!r} conflicts with "
                f"HiState's SSD backend ({key}={value!r}); drop that key"
            )
    extra.update(ours)
    section = parse_storage_section(extra.get(EXTRA_CONFIG_KEY), option="--hicache-storage-backend-extra-config")
    section.update(ssd_dirs=list(config.ssd_dirs), ssd_size_bytes=config.ssd_size_bytes,
                   io_backend=config.ssd_backend)
    extra[EXTRA_CONFIG_KEY] = section
    if config.l3 != "off":
        section["l3"] = config.l3
        if config.l3_budget_bytes:  # resolve_config gives both or neither
            section.update(l3_budget_bytes=config.l3_budget_bytes, l3_servers=config.l3_servers)
        if config.l3_require_digests:
            section["l3_require_digests"] = True
        check_l3(extra, config)
        # KV pages move with host indices (batch_get_v1 / batch_set_v1): Mooncake reads and writes the
        # registered host pool zero-copy (cache_controller.py: `interface_v1` picks _page_get_zero_copy).
        extra["interface_v1"] = 1
    return extra


def implied_settings(raw: Any, config: HiStateConfig) -> dict[str, Any]:
    """SGLang field values that `config` requires (only fields that must change)."""
    if not config.enable:
        return {}
    wanted: dict[str, Any] = {
        "radix_cache_backend": RADIX_BACKEND_NAME,
        "enable_hierarchical_cache": True,
    }
    if _flag(raw, "mamba_track_interval", SGLANG_MAMBA_TRACK_INTERVAL) == SGLANG_MAMBA_TRACK_INTERVAL:
        # A finished request donates its last decode state on this grid; at SGLang's 256 the next turn,
        # which carries the output, recomputes up to 255 output tokens. The state grid (64) keeps it
        # under 64 for one state copy per 64 decode steps (docs/sglang.md, "Decode states"). SGLang
        # requires a multiple of the page (`validate_mamba_extra_buffer`, arg_groups/mamba_hook.py:138):
        # with --page-size 128 or 256 the grid is the page.
        wanted["mamba_track_interval"] = math.lcm(STATE_GRID_TOKENS, _flag(raw, "page_size") or 1)
    if config.device_pool == "unified":
        wanted["enable_unified_memory"] = True
    if config.has_ssd:
        wanted["hicache_storage_backend"] = "dynamic"
        wanted["hicache_storage_backend_extra_config"] = json.dumps(
            storage_extra_config(raw, config), sort_keys=True
        )
    elif _flag(raw, "hicache_storage_backend") == "dynamic":
        raise HiStateConfigError(
            "--hicache-storage-backend dynamic was given without --histate-ssd-dir: HiState's SSD "
            "backend needs at least one directory"
        )
    return {k: v for k, v in wanted.items() if _flag(raw, k) != v}


def apply_to_record(record: Any, config: HiStateConfig) -> dict[str, Any]:
    """Check conflicts and write the implied settings onto an unresolved record; returns them."""
    if not config.enable:
        return {}
    check_conflicts(record)
    if config.tool_wait_prefetch == "on" and _flag(record, "enable_session_radix_cache"):
        raise HiStateConfigError(
            "--histate-tool-wait-prefetch on cannot be combined with --enable-session-radix-cache: both hold a "
            "session's path through its wait (one from the client's sessions, one inferred by prefix) and no "
            "HiState test runs them together; drop one of them")
    if config.l3 != "off" and _flag(record, "hicache_write_policy", "write_through") == "write_back":
        raise HiStateConfigError(
            f"--histate-l3 {config.l3} cannot be combined with --hicache-write-policy write_back: the fleet's L3 "
            "gets a session's terminal bundle when its backup is queued, which write_back defers until the device "
            "evicts it, so another server could not resume the session meanwhile, and no HiState test covers it; "
            "use write_through with --histate-l3")
    changes = implied_settings(record, config)
    for name, value in changes.items():
        setattr(record, name, value)
    return changes
