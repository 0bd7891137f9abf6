"""Plugin loading, flags, env vars and conflicts, through SGLang's real ServerArgs machinery."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from histate.sglang_plugin.cli_hooks import stashed_config
from histate.sglang_plugin.config import (
    DEFAULT_INTERVALS_TOKENS,
    OPTIONS,
    HiStateConfigError,
    parse_intervals_tokens,
    parse_size_bytes,
    resolve_config,
)
from histate.sglang_plugin.server_settings import STORAGE_CLASS_NAME, STORAGE_MODULE_PATH

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ALL_FLAGS = [o.flag for o in OPTIONS]


def _prepare(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", "dummy", *argv])


def _one_line_error(capsys, run) -> str:
    """`run()` must end like an argparse error: SystemExit(2) and one error line, the last one
    on stderr (SGLang's own log lines may come before it); returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert errors == lines[-1:] and errors[0].startswith("sglang serve: error: "), lines
    return errors[0]


def _cli_error(capsys, argv) -> str:
    return _one_line_error(capsys, lambda: _prepare(argv))


def test_entry_point_is_declared_in_the_sglang_group():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("histate") == "histate.sglang_plugin.plugin:register"


def _launch_server(*argv):
    """`python -m sglang.launch_server ARGV` in a fresh process, plugin found via its entry point."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "sglang_cpu", "stubs.py"), "sglang.launch_server", *argv],
        capture_output=True, text=True, timeout=180, cwd=HERE,
    )


def test_launch_server_help_lists_every_histate_flag():
    proc = _launch_server("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HiState (sglang-histate plugin" in proc.stdout
    for flag in ALL_FLAGS:
        assert flag in proc.stdout, f"{flag} missing from --help"
    text = " ".join(proc.stdout.split())  # argparse wraps help lines
    assert "SSD budget of each rank" in text and "0 = 90 percent of the free space, split between the TP x PP ranks" in text  # --histate-ssd-size, as docs/sglang.md says
    assert "it replaces --radix-eviction-policy (a value other than lru is refused)" in text  # --enable-histate
    assert "This ranking is HiState's eviction policy (it replaces --radix-eviction-policy)" in text  # --histate-tau
    assert "under shortest-prefill-first it replaces SGLang's unbounded chunk cap" in text  # --histate-short-prefill-first


def test_launch_server_bad_flag_is_one_line_and_exit_2():
    """What a user sees: no traceback, one line naming the flag, status 2 (like argparse)."""
    proc = _launch_server("--model-path", "dummy", "--enable-histate", "--histate-intervals", "100")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["sglang serve: error: --histate-intervals: interval 100 must be a positive multiple "
                      "of 64 tokens (the recurrent-state grid)"]


def test_enable_histate_resolves_sglang_settings(sglang_plugins, tmp_path):
    ssd = [str(tmp_path / "a"), str(tmp_path / "b")]
    sa = _prepare(["--enable-histate", "--histate-ssd-dir", *ssd, "--histate-ssd-size", "2GiB",
                   "--histate-intervals", "1024,2048", "4096", "--histate-tau", "30"])
    assert sa.radix_cache_backend == "histate"
    assert sa.enable_hierarchical_cache is True
    assert sa.enable_unified_memory is True
    assert sa.hicache_storage_backend == "dynamic"
    extra = json.loads(sa.hicache_storage_backend_extra_config)
    assert extra["module_path"] == STORAGE_MODULE_PATH and extra["class_name"] == STORAGE_CLASS_NAME
    assert extra["histate"] == {"ssd_dirs": ssd, "ssd_size_bytes": 2 * 2**30, "io_backend": "auto"}
    cfg = stashed_config(sa)
    assert (cfg.enable, cfg.intervals_tokens, cfg.tau_s) == (True, (1024, 2048, 4096), 30.0)
    assert cfg.sources["tau_s"] == "cli" and cfg.sources["host_state_slots"] == "default"
    sa.resolve_once()  # the hook must not write after resolution started
    child = pickle.loads(pickle.dumps(sa))  # what spawn() does on the way to the scheduler
    assert stashed_config(child) == cfg
    assert child.radix_cache_backend == "histate"


def test_decode_states_are_tracked_on_the_state_grid_unless_the_user_chose_an_interval(sglang_plugins):
    """A finished request donates its last decode state on --mamba-track-interval; HiState sets it to the
    64-token state grid (SGLang's default 256 makes the next turn recompute up to 255 output tokens)."""
    assert _prepare([]).mamba_track_interval == 256  # stock default, untouched without --enable-histate
    assert _prepare(["--enable-histate"]).mamba_track_interval == 64
    assert _prepare(["--enable-histate", "--mamba-track-interval", "512"]).mamba_track_interval == 512


def test_static_device_pool_keeps_sglang_split_and_user_extra_config(sglang_plugins, tmp_path):
    sa = _prepare(["--enable-histate", "--histate-device-pool", "static",
                   "--histate-ssd-dir", str(tmp_path),
                   "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 512}'])
    assert sa.enable_unified_memory is False
    extra = json.loads(sa.hicache_storage_backend_extra_config)
    assert extra["prefetch_threshold"] == 512 and extra["class_name"] == STORAGE_CLASS_NAME


def test_session_radix_cache_is_accepted(sglang_plugins):
    """--enable-session-radix-cache works with HiState (test_session_radix.py): the flag reaches SGLang
    unchanged, next to HiState's own settings."""
    sa = _prepare(["--enable-histate", "--enable-session-radix-cache"])
    assert sa.enable_session_radix_cache is True and sa.radix_cache_backend == "histate"


def test_default_eviction_policy_is_accepted_and_an_explicit_lru_is_warned_about(sglang_plugins):
    """HiState's ranking replaces --radix-eviction-policy: SGLang's default (lru, implicit in every launch)
    passes silently; an explicit lru is accepted with one warning that it is not applied. (A handler on
    the plugin's logger: `prepare_server_args` resets the root handlers, server_args.py:703-708.)"""
    import logging

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler = Collect()
    cli_logger = logging.getLogger("histate.sglang_plugin.cli_hooks")
    cli_logger.addHandler(handler)
    try:
        sa = _prepare(["--enable-histate"])
        sa.resolve_once()
        assert sa.radix_eviction_policy == "lru" and handler.messages == []
        sa = _prepare(["--enable-histate", "--radix-eviction-policy", "lru"])
        sa.resolve_once()  # the resolution-time pass must not warn again
        assert handler.messages == [
            "--radix-eviction-policy lru is not applied with --enable-histate: HiState's ranking "
            "(eq. 7, H = t_last + tau * C / M) is the eviction policy on every tier"]
        handler.messages.clear()
        _prepare(["--radix-eviction-policy", "lru"])  # without HiState: SGLang's business, no word from us
        assert handler.messages == []
    finally:
        cli_logger.removeHandler(handler)


def test_engine_path_refuses_another_eviction_policy(sglang_plugins, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("HISTATE_ENABLE", "1")
    with pytest.raises(HiStateConfigError, match="--radix-eviction-policy priority: HiState's ranking"):
        ServerArgs(model_path="dummy", radix_eviction_policy="priority").resolve_once()


def test_without_the_flag_nothing_changes(sglang_plugins):
    sa = _prepare([])
    assert sa.radix_cache_backend is None
    assert sa.enable_hierarchical_cache is False
    assert sa.hicache_storage_backend is None
    assert stashed_config(sa).enable is False


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--enable-int8-mamba-checkpoint"], "--enable-int8-mamba-checkpoint: SGLang 0.5.23's int8 checkpoints are "
                                             "device-only"),
        (["--enable-unified-cache-external-linker"], "--enable-unified-cache-external-linker"),
        (["--enable-kv-cache-sharding"], "--enable-kv-cache-sharding"),
        (["--radix-cache-backend", "other"], "--radix-cache-backend"),
        (["--disable-radix-cache"], "--disable-radix-cache"),
        (["--hicache-host-memory-mode", "buffer_only"], "--hicache-host-memory-mode cache: with buffer_only SGLang "
                                                        "keeps no cached data in host DRAM"),
        (["--hicache-storage-backend", "file"], "--hicache-storage-backend"),
        (["--mamba-radix-cache-strategy", "extra_buffer_lazy"], "--mamba-radix-cache-strategy extra_buffer_lazy"),
        (["--radix-eviction-policy", "lfu"], "--radix-eviction-policy lfu: HiState's ranking is the eviction policy"),
        (["--radix-eviction-policy", "slru"], "--radix-eviction-policy slru"),
        (["--radix-eviction-policy", "priority"], "--radix-eviction-policy priority"),
        (["--radix-eviction-policy=tlru"], "--radix-eviction-policy tlru"),
        (["--radix-eviction-policy-config", '{"protected_threshold": 4}'], "--radix-eviction-policy-config"),
    ],
)
def test_incompatible_flags_are_rejected_with_one_message(sglang_plugins, capsys, argv, flag):
    line = _cli_error(capsys, ["--enable-histate", *argv])
    assert line.startswith("sglang serve: error: --enable-histate") and flag in line


def test_tool_wait_with_client_sessions_is_refused_in_one_line(sglang_plugins, capsys):
    line = _cli_error(capsys, ["--enable-histate", "--histate-tool-wait-prefetch", "on", "--enable-session-radix-cache"])
    assert line.startswith("sglang serve: error: --histate-tool-wait-prefetch on cannot be combined with "
                           "--enable-session-radix-cache") and "\n" not in line


def test_write_back_with_the_fleet_l3_is_refused_in_one_line(sglang_plugins, capsys, tmp_path):
    line = _cli_error(capsys, ["--enable-histate", "--histate-ssd-dir", str(tmp_path), "--histate-l3", "mooncake",
                               "--hicache-write-policy", "write_back"])
    assert line.startswith("sglang serve: error: --histate-l3 mooncake cannot be combined with "
                           "--hicache-write-policy write_back") and "\n" not in line


def test_write_back_alone_is_accepted(sglang_plugins):
    sa = _prepare(["--enable-histate", "--hicache-write-policy", "write_back"])
    assert sa.hicache_write_policy == "write_back" and sa.enable_hierarchical_cache


def test_conflicting_extra_config_key_is_rejected(sglang_plugins, capsys, tmp_path):
    line = _cli_error(capsys, ["--enable-histate", "--histate-ssd-dir", str(tmp_path),
                               "--hicache-storage-backend-extra-config", '{"class_name": "Other"}'])
    assert "class_name" in line


@pytest.mark.parametrize("argv, flag", [
    (["--histate-tau", "5"], "--histate-tau"),
    (["--histate-ssd-dir", "/tmp/x"], "--histate-ssd-dir"),
    (["--histate-chunk-align", "off"], "--histate-chunk-align"),
    (["--histate-tool-wait-prefetch", "on"], "--histate-tool-wait-prefetch"),
])
def test_histate_flags_need_enable_histate(sglang_plugins, capsys, argv, flag):
    assert _cli_error(capsys, argv) == f"sglang serve: error: {flag} needs --enable-histate (HiState is off)"


def test_histate_env_vars_without_enable_are_ignored(sglang_plugins, monkeypatch):
    """Env vars may be set for a whole host; only flags on this command line are checked."""
    monkeypatch.setenv("HISTATE_TAU", "5")
    assert stashed_config(_prepare([])).enable is False


def test_a_bad_choice_is_one_line_not_sglangs_usage(sglang_plugins, capsys):
    line = _cli_error(capsys, ["--enable-histate", "--histate-chunk-align", "sometimes"])
    assert line == "sglang serve: error: --histate-chunk-align: 'sometimes' is not one of grid, off"


def test_engine_kwargs_path_reads_env_vars(sglang_plugins, monkeypatch, tmp_path):
    """Engine(**kwargs) builds ServerArgs directly; the resolve_once hook applies HISTATE_* vars."""
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("HISTATE_ENABLE", "1")
    monkeypatch.setenv("HISTATE_SSD_DIR", f"{tmp_path}/x,{tmp_path}/y")
    monkeypatch.setenv("HISTATE_TAU", "12.5")
    monkeypatch.setenv("HISTATE_DEVICE_POOL", "static")
    sa = ServerArgs(model_path="dummy")
    sa.resolve_once()
    assert sa.radix_cache_backend == "histate" and sa.enable_hierarchical_cache is True
    assert sa.enable_unified_memory is False
    cfg = stashed_config(sa)
    assert cfg.ssd_dirs == (f"{tmp_path}/x", f"{tmp_path}/y") and cfg.tau_s == 12.5
    assert cfg.sources["tau_s"] == "env"


def test_engine_path_raises_conflicts_for_the_caller(sglang_plugins, monkeypatch):
    """`Engine(**kwargs)` is a Python API: its errors are exceptions, not process exits."""
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("HISTATE_ENABLE", "true")
    sa = ServerArgs(model_path="dummy", enable_int8_mamba_checkpoint=True)
    with pytest.raises(HiStateConfigError, match="--enable-int8-mamba-checkpoint"):
        sa.resolve_once()


def test_cli_flag_beats_env_var(sglang_plugins, monkeypatch):
    monkeypatch.setenv("HISTATE_TAU", "5")
    monkeypatch.setenv("HISTATE_HOST_STATE_SLOTS", "7")
    sa = _prepare(["--enable-histate", "--histate-tau", "9"])
    assert stashed_config(sa).tau_s == 9.0 and stashed_config(sa).host_state_slots == 7


def test_bad_values_name_their_flag_or_env_var(sglang_plugins, capsys, monkeypatch):
    assert "--histate-intervals: interval 100" in _cli_error(capsys, ["--enable-histate", "--histate-intervals", "100"])
    assert "--histate-ssd-size: cannot parse" in _cli_error(
        capsys, ["--enable-histate", "--histate-ssd-dir", "/tmp/x", "--histate-ssd-size", "lots"])
    assert "needs --histate-ssd-dir" in _cli_error(capsys, ["--enable-histate", "--histate-ssd-size", "1GB"])
    monkeypatch.setenv("HISTATE_TAU", "-1")
    with pytest.raises(HiStateConfigError, match="HISTATE_TAU"):
        resolve_config({}, os.environ)


def test_size_and_interval_parsers():
    assert parse_size_bytes("150GiB", option="x") == 150 * 2**30
    assert parse_size_bytes("200", option="x") == 200 * 10**9
    assert parse_size_bytes("1.5 MiB", option="x") == 3 * 2**19
    assert parse_size_bytes("0", option="x") == 0
    assert parse_intervals_tokens(["4096,1024", "1024 2048"], option="x") == (1024, 2048, 4096)
    assert DEFAULT_INTERVALS_TOKENS == (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    with pytest.raises(HiStateConfigError):
        parse_intervals_tokens("", option="x")
    with pytest.raises(HiStateConfigError):
        parse_size_bytes("12 parsecs", option="x")


def test_given_intervals_must_sit_on_the_state_grid():
    cfg = resolve_config({"enable": True, "intervals_tokens": "256,512"}, {})
    assert cfg.intervals_pages(64) == (4, 8)
    assert cfg.intervals_pages(256) == (1, 2)
    with pytest.raises(HiStateConfigError, match=r"^--histate-intervals: \[256\] are not multiples of this "
                                                 r"server's 512-token state grid"):
        cfg.intervals_pages(512)
    from_env = resolve_config({"enable": True}, {"HISTATE_INTERVALS": "384"})
    with pytest.raises(HiStateConfigError, match="^HISTATE_INTERVALS: "):
        from_env.intervals_pages(256)


def test_default_intervals_off_the_state_grid_are_dropped():
    """R4: `--page-size 256` or a Mamba2-style 256-token state chunk makes the grid 256 tokens;
    the default 128-token interval is left out instead of failing the server."""
    cfg = resolve_config({"enable": True}, {})
    assert cfg.intervals_pages(64) == (2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert cfg.intervals_pages(256) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert cfg.intervals_pages(1024) == (1, 2, 4, 8, 16, 32)
    with pytest.raises(HiStateConfigError, match="no default interval is a multiple"):
        cfg.intervals_pages(65536)


def _write_config(path, config: dict) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
         "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}


def test_non_hybrid_model_is_rejected_once_its_config_is_known(sglang_plugins, capsys, tmp_path):
    """The resolution-step check reads the model's HF config (config.json only, no weights)."""
    from sglang.srt.server_args import prepare_server_args

    llama = _write_config(tmp_path / "llama", LLAMA)
    record = prepare_server_args(["--model-path", llama, "--enable-histate", "--device", "cpu", "--skip-tokenizer-init"])
    assert "LlamaForCausalLM has none" in _one_line_error(capsys, record.resolve_once)


def test_non_hybrid_model_on_the_engine_path_raises(sglang_plugins, monkeypatch, tmp_path):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("HISTATE_ENABLE", "1")
    record = ServerArgs(model_path=_write_config(tmp_path / "llama", LLAMA), device="cpu", skip_tokenizer_init=True)
    with pytest.raises(HiStateConfigError, match="LlamaForCausalLM has none"):
        record.resolve_once()


def _hybrid_model(tmp_path, **extra) -> str:
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=1000).to_dict()
    return _write_config(tmp_path / "qwen35", {**config, "architectures": ["Qwen3_5ForCausalLM"], **extra})


# Resolution on a CPU: SGLang refuses the extra buffer and the overlap scheduler for Mamba there,
# and the unified pool's page-major KV layout has no CPU attention backend.
CPU_RESOLVABLE = ["--device", "cpu", "--skip-tokenizer-init", "--mamba-radix-cache-strategy", "no_buffer",
                  "--disable-overlap-schedule", "--histate-device-pool", "static"]


def test_hybrid_model_resolves_with_default_intervals_on_a_256_token_grid(sglang_plugins, tmp_path):
    """A Mamba2-style `mamba_chunk_size` of 256 makes the state grid 256 tokens: the default
    intervals (from 128) resolve; the 128 one is dropped when the cache is built."""
    from sglang.srt.server_args import prepare_server_args

    from histate.sglang_plugin.plugin import state_grid_tokens

    record = prepare_server_args(["--model-path", _hybrid_model(tmp_path, mamba_chunk_size=256),
                                  "--enable-histate", *CPU_RESOLVABLE])
    record.resolve_once()
    assert state_grid_tokens(record) == 256
    assert stashed_config(record).intervals_pages(256)[0] == 1


def test_given_intervals_off_the_grid_fail_at_the_argument_phase(sglang_plugins, capsys, tmp_path):
    from sglang.srt.server_args import prepare_server_args

    record = prepare_server_args(["--model-path", _hybrid_model(tmp_path, mamba_chunk_size=256), "--enable-histate",
                                  "--histate-intervals", "128", "1024", *CPU_RESOLVABLE])
    assert _one_line_error(capsys, record.resolve_once) == (
        "sglang serve: error: --histate-intervals: [128] are not multiples of this server's 256-token state "
        "grid (lcm of --page-size and the model's state chunk); use multiples of 256")


def test_docs_list_every_flag_and_env_var():
    docs = os.path.join(HERE, os.pardir, os.pardir, "docs", "sglang.md")
    with open(docs) as f:
        text = f.read()
    for opt in OPTIONS:
        assert opt.flag in text and opt.env in text, f"docs/sglang.md misses {opt.flag} / {opt.env}"


@pytest.mark.parametrize("page_size", [128, 256])
def test_pages_wider_than_the_state_grid_resolve(sglang_plugins, tmp_path, monkeypatch, page_size):
    """SGLang requires `--mamba-track-interval` to be a multiple of the page
    (`validate_mamba_extra_buffer`, arg_groups/mamba_hook.py:138). HiState sets the decode track
    interval to the state grid, lcm(64, page): before the fix it set 64 and `--page-size 128` or 256
    died with an empty AssertionError. (The extra buffer is CUDA-only; its platform check is answered
    here as on a GPU host.)"""
    import sglang.srt.arg_groups.mamba_hook as mamba_hook
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setattr(mamba_hook, "_platform_supports_mamba_cache_extra_buffer", lambda: True)
    record = prepare_server_args(["--model-path", _hybrid_model(tmp_path), "--enable-histate", "--device", "cpu",
                                  "--skip-tokenizer-init", "--histate-device-pool", "static",
                                  "--page-size", str(page_size)])
    record.resolve_once()
    assert record.mamba_track_interval == page_size and record.page_size == page_size
