"""Plugin loading, flags, env vars and conflicts, through SGLang's real ServerArgs machinery."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

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


def test_entry_point_is_declared_in_the_sglang_group():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("histate") == "histate.sglang_plugin.plugin:register"


def test_launch_server_help_lists_every_histate_flag():
    """`python -m sglang.launch_server --help` in a fresh process, plugin found via its entry point."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "sglang_cpu", "stubs.py"), "sglang.launch_server", "--help"],
        capture_output=True, text=True, timeout=180, cwd=HERE,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HiState (sglang-histate plugin" in proc.stdout
    for flag in ALL_FLAGS:
        assert flag in proc.stdout, f"{flag} missing from --help"


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
    cfg = sa._histate_config
    assert (cfg.enable, cfg.intervals_tokens, cfg.tau_s) == (True, (1024, 2048, 4096), 30.0)
    assert cfg.sources["tau_s"] == "cli" and cfg.sources["host_state_slots"] == "default"
    sa.resolve_once()  # the hook must not write after resolution started
    child = pickle.loads(pickle.dumps(sa))  # what spawn() does on the way to the scheduler
    assert child._histate_config == cfg
    assert child.radix_cache_backend == "histate"


def test_static_device_pool_keeps_sglang_split_and_user_extra_config(sglang_plugins, tmp_path):
    sa = _prepare(["--enable-histate", "--histate-device-pool", "static",
                   "--histate-ssd-dir", str(tmp_path),
                   "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 512}'])
    assert sa.enable_unified_memory is False
    extra = json.loads(sa.hicache_storage_backend_extra_config)
    assert extra["prefetch_threshold"] == 512 and extra["class_name"] == STORAGE_CLASS_NAME


def test_without_the_flag_nothing_changes(sglang_plugins):
    sa = _prepare([])
    assert sa.radix_cache_backend is None
    assert sa.enable_hierarchical_cache is False
    assert sa.hicache_storage_backend is None
    assert sa._histate_config.enable is False


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--enable-int8-mamba-checkpoint"], "--enable-int8-mamba-checkpoint"),
        (["--enable-unified-cache-external-linker"], "--enable-unified-cache-external-linker"),
        (["--enable-kv-cache-sharding"], "--enable-kv-cache-sharding"),
        (["--radix-cache-backend", "other"], "--radix-cache-backend"),
        (["--disable-radix-cache"], "--disable-radix-cache"),
        (["--enable-session-radix-cache"], "--enable-session-radix-cache"),
        (["--hicache-host-memory-mode", "buffer_only"], "--hicache-host-memory-mode"),
        (["--hicache-storage-backend", "file"], "--hicache-storage-backend"),
        (["--hicache-write-policy", "write_back"], "--hicache-write-policy"),
    ],
)
def test_incompatible_flags_are_rejected_with_one_message(sglang_plugins, argv, flag):
    with pytest.raises(HiStateConfigError) as err:
        _prepare(["--enable-histate", *argv])
    message = str(err.value)
    assert message.startswith("--enable-histate") and flag in message
    assert "\n" not in message


def test_conflicting_extra_config_key_is_rejected(sglang_plugins, tmp_path):
    with pytest.raises(HiStateConfigError, match="class_name"):
        _prepare(["--enable-histate", "--histate-ssd-dir", str(tmp_path),
                  "--hicache-storage-backend-extra-config", '{"class_name": "Other"}'])


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
    cfg = sa._histate_config
    assert cfg.ssd_dirs == (f"{tmp_path}/x", f"{tmp_path}/y") and cfg.tau_s == 12.5
    assert cfg.sources["tau_s"] == "env"


def test_engine_path_rejects_conflicts_too(sglang_plugins, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("HISTATE_ENABLE", "true")
    sa = ServerArgs(model_path="dummy", enable_int8_mamba_checkpoint=True)
    with pytest.raises(HiStateConfigError, match="--enable-int8-mamba-checkpoint"):
        sa.resolve_once()


def test_cli_flag_beats_env_var(sglang_plugins, monkeypatch):
    monkeypatch.setenv("HISTATE_TAU", "5")
    monkeypatch.setenv("HISTATE_HOST_STATE_SLOTS", "7")
    sa = _prepare(["--enable-histate", "--histate-tau", "9"])
    assert sa._histate_config.tau_s == 9.0 and sa._histate_config.host_state_slots == 7


def test_bad_values_name_their_flag_or_env_var(sglang_plugins, monkeypatch):
    with pytest.raises(HiStateConfigError, match="--histate-intervals: interval 100"):
        _prepare(["--enable-histate", "--histate-intervals", "100"])
    with pytest.raises(HiStateConfigError, match="--histate-ssd-size: cannot parse"):
        _prepare(["--enable-histate", "--histate-ssd-dir", "/tmp/x", "--histate-ssd-size", "lots"])
    with pytest.raises(HiStateConfigError, match="needs --histate-ssd-dir"):
        _prepare(["--enable-histate", "--histate-ssd-size", "1GB"])
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


def test_intervals_must_sit_on_the_tree_page_grid():
    cfg = resolve_config({"intervals_tokens": "256,512"}, {})
    assert cfg.intervals_pages(64) == (4, 8)
    assert cfg.intervals_pages(256) == (1, 2)
    with pytest.raises(HiStateConfigError, match="not multiples of the tree page"):
        cfg.intervals_pages(512)


def _write_config(path, config: dict) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_non_hybrid_model_is_rejected_once_its_config_is_known(sglang_plugins, tmp_path):
    """The resolution-step check reads the model's HF config (config.json only, no weights)."""
    llama = _write_config(tmp_path / "llama", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"})
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(HiStateConfigError, match="LlamaForCausalLM has none"):
        prepare_server_args(["--model-path", llama, "--enable-histate", "--device", "cpu",
                             "--skip-tokenizer-init"]).resolve_once()


def test_hybrid_model_passes_the_check(sglang_plugins, tmp_path):
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=1000).to_dict()
    qwen = _write_config(tmp_path / "qwen35", {**config, "architectures": ["Qwen3_5ForCausalLM"]})
    from sglang.srt.server_args import prepare_server_args

    from histate.sglang_plugin.plugin import _check_hybrid_model

    server_args = prepare_server_args(["--model-path", qwen, "--enable-histate", "--device", "cpu",
                                       "--skip-tokenizer-init"])
    continued = []
    _check_hybrid_model(server_args, continued.append)  # the wrapped resolution step, called directly
    assert continued == [server_args]


def test_docs_list_every_flag_and_env_var():
    docs = os.path.join(HERE, os.pardir, os.pardir, "docs", "sglang.md")
    with open(docs) as f:
        text = f.read()
    for opt in OPTIONS:
        assert opt.flag in text and opt.env in text, f"docs/sglang.md misses {opt.flag} / {opt.env}"
