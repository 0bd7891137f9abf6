"""What `--enable-histate` accepts is what a test proves; the rest is refused at start with one line.

Three parts, each through the path users take:
  * hooks: a HiState hook group either patches every target or refuses (hooks.install_once), and
    the ServerArgs hooks `register()` declares are installed that way;
  * models: hybrid models whose recurrent layers are not Qwen3-Next / Qwen3.5 Gated-DeltaNet on
    `GDNAttnBackend` are refused once the model config is read (the `handle_hicache` resolution step),
    from small HF configs (config.json only, no weights), like `python -m sglang.launch_server` does;
  * modes: two-batch overlap, speculative decoding, attention DP, PD disaggregation, a path cap on
    Mamba states and full prefill CUDA graphs are refused from the flags (`ServerArgs.from_cli_args`),
    or, when SGLang picks them itself, at the resolution step. Single-batch overlap and breakable prefill
    graphs (each GDN layer's extend runs eagerly, outside the graph) are accepted, with the evidence.
The table of all of them is in docs/sglang.md ("What it rejects").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from histate.sglang_plugin import hook_points, hooks, plugin
from histate.sglang_plugin.cli_hooks import upstream_plugin_args
from histate.sglang_plugin.config import HiStateConfigError

from .test_plugin_cli import _one_line_error

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Resolution on a CPU (as in test_plugin_cli.py): SGLang refuses the extra buffer and the overlap
# scheduler for Mamba there, and the unified pool's page-major KV layout has no CPU attention backend.
CPU_RESOLVABLE = ["--device", "cpu", "--skip-tokenizer-init", "--mamba-radix-cache-strategy", "no_buffer",
                  "--disable-overlap-schedule", "--histate-device-pool", "static"]


def _prepare(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(list(argv))


# --------------------------------------------------------------------------------------------------
# Hooks: every target of a group is patched, or the group refuses
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def registry(isolated_hooks, monkeypatch):
    """SGLang's HookRegistry and HiState's group records, isolated for one test, with a probe module
    whose methods the test hooks."""
    # The probe targets are not SGLang's, so they are not in hook_points' table: these tests are about
    # what the registry does, and test_hook_points.py about the table.
    monkeypatch.setattr(hooks, "_check_listed", lambda group, group_hooks: None)
    monkeypatch.setattr(hooks, "registry_hook", lambda target: hook_points.HookPoint(
        target, "probe", "probe", "probe", hook_points.parameter_names(hooks.resolve_target(target)), "probe"))

    class Probe:
        def method(self, x):
            return x + 1

        @classmethod
        def make(cls, x):
            return x * 2

        @staticmethod
        def helper(x):
            return x - 1

    module = types.ModuleType("histate_hook_probe")
    module.Probe = Probe
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return isolated_hooks


def _after(result, *args, **kwargs):
    return result * 10


def _around(original, *args, **kwargs):
    return original(*args, **kwargs) + 100


def test_a_good_group_installs_every_target(registry):
    from histate_hook_probe import Probe

    group = [("histate_hook_probe.Probe.method", _after, "AFTER"),
             ("histate_hook_probe.Probe.make", _around, "AROUND"),
             ("histate_hook_probe.Probe.helper", _after, "AFTER")]
    hooks.install_once("probe-good", group)
    assert hooks.is_installed("probe-good")
    assert (Probe().method(1), Probe.make(3), Probe.helper(5)) == (20, 106, 40)
    hooks.install_once("probe-good", group)  # once per process: not wrapped twice
    assert Probe().method(1) == 20


def test_a_renamed_target_refuses_the_whole_group_naming_every_missing_target(registry):
    """SGLang renamed a method (or moved a module): the group names each missing target and patches
    none of its targets, and it is not recorded as installed; asking again gives the same error."""
    from histate_hook_probe import Probe

    original = Probe.__dict__["method"]
    group = [("histate_hook_probe.Probe.method", _after, "AFTER"),
             ("histate_hook_probe.Probe.renamed_method", _after, "AFTER"),
             ("histate_hook_probe_gone.Thing.run", _around, "AROUND")]
    with pytest.raises(RuntimeError) as error:
        hooks.install_once("probe-renamed", group)
    message = str(error.value)
    assert "'probe-renamed'" in message and "\n" not in message
    assert "histate_hook_probe.Probe.renamed_method not found (AttributeError" in message
    assert "histate_hook_probe_gone.Thing.run not found" in message
    assert "histate_hook_probe.Probe.method " not in message  # the one that exists is not blamed
    assert not hooks.is_installed("probe-renamed")
    assert Probe.__dict__["method"] is original and Probe().method(1) == 2  # all or nothing
    assert not any(target.startswith("histate_hook_probe") for target in registry._hooks)
    with pytest.raises(RuntimeError, match="renamed_method"):
        hooks.install_once("probe-renamed", group)


def test_a_target_the_registry_leaves_unchanged_refuses_the_group(registry):
    """HookRegistry skips a target an earlier registration already patched (`_patched`), silently: a
    second group on the same target would never run. The check after applying catches it."""
    hooks.install_once("probe-first", [("histate_hook_probe.Probe.method", _after, "AFTER")])
    with pytest.raises(RuntimeError, match=r"'probe-second'.*histate_hook_probe\.Probe\.method not patched"):
        hooks.install_once("probe-second", [("histate_hook_probe.Probe.method", _around, "AROUND")])
    assert hooks.is_installed("probe-first") and not hooks.is_installed("probe-second")


def test_a_target_that_fails_to_apply_refuses_the_group(registry, monkeypatch):
    """`apply_hooks` only logs a target whose patching raises; install_once refuses it."""
    def boom(cls, target, hook_list):
        raise TypeError("cannot patch")

    monkeypatch.setattr(registry, "_apply_target", classmethod(boom))
    with pytest.raises(RuntimeError, match=r"histate_hook_probe\.Probe\.helper not patched"):
        hooks.install_once("probe-apply", [("histate_hook_probe.Probe.helper", _after, "AFTER")])
    assert "histate_hook_probe.Probe.helper" not in registry._hooks  # not retried by later apply_hooks


stock_server_args_path = pytest.mark.skipif(
    upstream_plugin_args() is not None,
    reason="upstream/series 0003 applied: the flags are declared to SGLang, no ServerArgs hook is installed "
           "(upstream/tests/test_plugin_takes_the_patched_paths.py::test_0003_... checks that path)")


@stock_server_args_path
def test_the_server_args_hooks_are_installed_as_a_verified_group(sglang_plugins):
    from sglang.srt.server_args import ServerArgs

    assert hooks.is_installed(plugin.SERVER_ARGS_GROUP)
    for target, _, _ in plugin.server_args_hooks():
        wrapper = hooks.resolve_target(target)
        assert getattr(wrapper, "__wrapped__", None) is not None, target
    assert ServerArgs.from_cli_args.__func__ is hooks.resolve_target(f"{plugin._SERVER_ARGS}.from_cli_args")


def _fresh_register(monkeypatch, server_args_path):
    from sglang.srt.arg_groups import resolution_hooks

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_registration_error", None)
    monkeypatch.setattr(plugin, "_SERVER_ARGS", server_args_path)
    monkeypatch.setattr(hooks, "_installed", set())
    monkeypatch.setattr(hooks, "_failed", {})
    monkeypatch.setattr(resolution_hooks, "_HOOKS", {k: list(v) for k, v in resolution_hooks._HOOKS.items()})
    return resolution_hooks


@stock_server_args_path
def test_register_refuses_to_start_histate_when_its_server_args_hooks_cannot_be_installed(
        sglang_plugins, monkeypatch, capsys, registry):
    """`load_plugins` only logs an exception from a plugin, so a process that asks for HiState exits
    with one line (SystemExit passes through); HiState then registers nothing else."""
    steps = _fresh_register(monkeypatch, "sglang.srt.server_args.RenamedServerArgs")
    before = {k: list(v) for k, v in steps._HOOKS.items()}
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server", "--model-path", "m", "--enable-histate"])
    line = _one_line_error(capsys, plugin.register)
    assert line.startswith("sglang serve: error: --enable-histate: HiState cannot install its SGLang hook group "
                           "'server_args': sglang.srt.server_args.RenamedServerArgs.add_cli_args not found")
    assert "RenamedServerArgs.from_cli_args" in line and "RenamedServerArgs.resolve_once" in line
    assert not hooks.is_installed(plugin.SERVER_ARGS_GROUP)
    assert steps._HOOKS == before  # no resolution step registered


@stock_server_args_path
def test_register_failure_without_histate_requested_is_an_error_sglang_logs(sglang_plugins, monkeypatch, registry):
    _fresh_register(monkeypatch, "sglang.srt.server_args.RenamedServerArgs")
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server", "--model-path", "m"])
    with pytest.raises(RuntimeError, match="HiState is not available in this process: HiState cannot install"):
        plugin.register()
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv("HISTATE_ENABLE", "1")  # the Engine(**kwargs) path asks through the env var
    with pytest.raises(SystemExit):
        plugin.register()


@pytest.mark.parametrize("argv, environ, asked", [
    (["--enable-histate"], {}, True),
    (["--histate-ssd-dir=/x"], {}, True),
    (["--model-path", "m"], {}, False),
    (["--model-path", "m"], {"HISTATE_ENABLE": "true"}, True),
    (["--model-path", "m"], {"HISTATE_ENABLE": "0"}, False),
])
def test_histate_requested(argv, environ, asked):
    assert plugin.histate_requested(argv, environ) is asked


# --------------------------------------------------------------------------------------------------
# Models: only Qwen3-Next / Qwen3.5 Gated-DeltaNet on GDNAttnBackend
# --------------------------------------------------------------------------------------------------

def _write_config(path, config: dict) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return str(path)


def _qwen35(tmp_path) -> str:
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=1000).to_dict()
    return _write_config(tmp_path / "qwen35", {**config, "architectures": ["Qwen3_5ForCausalLM"]})


def _qwen3_next(tmp_path) -> str:
    from sglang.srt.configs import Qwen3NextConfig

    config = Qwen3NextConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=1000, num_experts=2,
                             num_experts_per_tok=1, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32).to_dict()
    return _write_config(tmp_path / "qwen3next", {**config, "architectures": ["Qwen3NextForCausalLM"]})


def _nemotron_h(tmp_path) -> str:
    """NVIDIA Nemotron-H: Mamba2 layers ('M') between attention ('*') and MLP ('-') layers."""
    from sglang.srt.configs import NemotronHConfig

    config = NemotronHConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             hybrid_override_pattern="M*M-", num_attention_heads=4, head_dim=16, num_key_value_heads=2,
                             ssm_state_size=16, mamba_num_heads=4, mamba_n_groups=1, mamba_head_dim=16,
                             mamba_chunk_size=128, n_routed_experts=2, moe_intermediate_size=32,
                             moe_shared_expert_intermediate_size=32).to_dict()
    return _write_config(tmp_path / "nemotron_h", {**config, "architectures": ["NemotronHForCausalLM"]})


def _kimi_linear(tmp_path) -> str:
    """Moonshot Kimi-Linear: Kimi Delta Attention (KDA) layers 1 and 3, MLA attention layers 2 and 4."""
    from sglang.srt.configs import KimiLinearConfig

    config = KimiLinearConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
                              num_experts=2, num_experts_per_token=1,
                              linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                                                  "head_dim": 16, "short_conv_kernel_size": 4}).to_dict()
    return _write_config(tmp_path / "kimi_linear", {**config, "architectures": ["KimiLinearForCausalLM"]})


def _resolve(model_path, *extra):
    record = _prepare(["--model-path", model_path, "--enable-histate", *CPU_RESOLVABLE, *extra])
    record.resolve_once()
    return record


@pytest.mark.parametrize("make", [_qwen35, _qwen3_next], ids=["qwen3.5", "qwen3-next"])
def test_gated_deltanet_models_of_the_qwen3_next_family_are_accepted(sglang_plugins, tmp_path, make):
    from sglang.srt.arg_groups.model_override_base import model_config_of

    record = _resolve(make(tmp_path))
    assert record.radix_cache_backend == "histate"
    assert plugin.unsupported_recurrent_layers(model_config_of(record)) is None


@pytest.mark.parametrize("make, arch, layers", [
    (_nemotron_h, "NemotronHForCausalLM", "Mamba2 layers (Mamba2AttnBackend)"),
    (_kimi_linear, "KimiLinearForCausalLM", "Kimi Delta Attention layers (KDAAttnBackend)"),
], ids=["mamba2-nemotron-h", "kda-kimi-linear"])
def test_hybrid_models_without_gated_deltanet_are_refused_once_the_config_is_read(
        sglang_plugins, capsys, tmp_path, make, arch, layers):
    record = _prepare(["--model-path", make(tmp_path), "--enable-histate", *CPU_RESOLVABLE])
    line = _one_line_error(capsys, record.resolve_once)
    assert line == (
        f"sglang serve: error: --enable-histate: {arch} is not supported: its recurrent layers are {layers}, while "
        f"HiState captures checkpoints only from Gated-DeltaNet layers run by GDNAttnBackend (the Qwen3-Next / "
        f"Qwen3.5 family), so its capture slots would stay unfilled. Drop --enable-histate for this model.")


def test_a_refused_model_on_the_engine_path_raises(sglang_plugins, monkeypatch, tmp_path):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("HISTATE_ENABLE", "1")
    record = ServerArgs(model_path=_nemotron_h(tmp_path), device="cpu", skip_tokenizer_init=True,
                        mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True)
    monkeypatch.setenv("HISTATE_DEVICE_POOL", "static")
    with pytest.raises(HiStateConfigError, match="NemotronHForCausalLM is not supported: its recurrent layers are "
                                                 "Mamba2"):
        record.resolve_once()


def _model_config(hf_config, is_draft_model=False):
    """What SGLang's family predicates read of a ModelConfig (configs/hybrid_arch.py)."""
    from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_config

    return types.SimpleNamespace(hf_config=hf_config, is_draft_model=is_draft_model,
                                 linear_attn_registry_result=get_linear_attn_config(hf_config))


def _config(name, **kwargs):
    import sglang.srt.configs as configs

    return getattr(configs, name)(**kwargs)


@pytest.mark.parametrize("name, kwargs, layers", [
    ("FalconH1Config", {}, "Mamba2 layers (Mamba2AttnBackend)"),
    ("GraniteMoeHybridConfig", {"layer_types": ["mamba", "attention"], "num_hidden_layers": 2},
     "Mamba2 layers (Mamba2AttnBackend)"),
    ("Lfm2Config", {}, "short convolutions (ShortConvAttnBackend)"),
    ("BailingHybridConfig", {"use_kda": False}, "Lightning attention layers (LightningAttentionBackend)"),
    ("BailingHybridConfig", {"use_kda": True}, "Kimi Delta Attention layers (KDAAttnBackend)"),
    ("JetNemotronConfig", {}, "Jet-Nemotron JetBlocks"),
    ("GigaChat35Config", {}, "linear-attention layers of GigaChat35Config on GDNAttnBackend, not covered"),
])
def test_the_family_check_names_each_recurrent_kind_sglang_knows(sglang_plugins, name, kwargs, layers):
    """The same predicates SGLang's attention registry uses to pick the linear backend
    (layers/attention/attention_registry.py:392-560), on each family's own config class."""
    why = plugin.unsupported_recurrent_layers(_model_config(_config(name, **kwargs)))
    assert why is not None and why.startswith(layers), why


# --------------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--enable-two-batch-overlap"],
     "--enable-histate: --enable-two-batch-overlap is not supported (two-batch overlap runs each batch as two child "
     "ForwardBatches"),
    (["--speculative-algorithm", "EAGLE"], "--enable-histate: --speculative-algorithm EAGLE is not supported "
                                           "(draft-extend and target-verify passes"),
    (["--speculative-algorithm", "NEXTN"], "--enable-histate: --speculative-algorithm NEXTN is not supported"),
    (["--speculative-algorithm", "NGRAM"], "--enable-histate: --speculative-algorithm NGRAM is not supported"),
    (["--attn-dp-size", "2"], "--enable-histate: --attn-dp-size 2 is not supported"),
    (["--pp-size", "2"], "--enable-histate: --pp-size 2 is not supported (HiState's rank agreement rides"),
    (["--disaggregation-mode", "prefill"], "--enable-histate: --disaggregation-mode prefill is not supported"),
    (["--disaggregation-mode", "decode"], "--enable-histate: --disaggregation-mode decode is not supported"),
    (["--mamba-max-states-per-path", "4"], "--enable-histate: --mamba-max-states-per-path 4 is not supported "
                                           "(after each insert SGLang drops the shallowest device checkpoints"),
    (["--cuda-graph-backend-prefill", "full"], "--enable-histate: --cuda-graph-backend-prefill full is not supported "
                                               "(a full prefill CUDA graph replays the GDN extend inside the graph"),
    (["--cuda-graph-config", '{"prefill": {"backend": "full"}}'],
     "--enable-histate: --cuda-graph-config prefill.backend full is not supported"),
    (["--cuda-graph-backend-prefill", "breakable", "--cuda-graph-config", '{"prefill": {"backend": "full"}}'],
     "--enable-histate: --cuda-graph-config prefill.backend full is not supported"),  # the JSON wins, as in SGLang
])
def test_unproven_modes_are_refused_from_the_flags(sglang_plugins, capsys, argv, expected):
    line = _one_line_error(capsys, lambda: _prepare(["--model-path", "dummy", "--enable-histate", *argv]))
    assert line.startswith(f"sglang serve: error: {expected}"), line
    assert line.endswith(("drop one of them", "drop it", "breakable or disabled")), line


@pytest.mark.parametrize("argv", [
    ["--enable-single-batch-overlap"],
    ["--cuda-graph-backend-prefill", "breakable"],
    ["--cuda-graph-backend-prefill", "disabled"],
    ["--cuda-graph-backend-prefill", "full", "--cuda-graph-config", '{"prefill": {"backend": "breakable"}}'],
    ["--mamba-max-states-per-path", "-1"],
    ["--disaggregation-mode", "null"],
    ["--attn-dp-size", "1"],
], ids=lambda argv: " ".join(argv))
def test_proven_modes_and_explicit_defaults_are_accepted(sglang_plugins, argv):
    record = _prepare(["--model-path", "dummy", "--enable-histate", *argv])
    assert record.radix_cache_backend == "histate"


def test_the_deprecated_dp_attention_flag_is_refused(sglang_plugins, capsys):
    """`--enable-dp-attention` (SGLang's deprecated spelling of `--attn-dp-size`) logs a deprecation warning
    while argv is parsed, so stderr holds more than our line; ours is the last one."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _prepare(["--model-path", "dummy", "--enable-histate", "--dp-size", "2", "--enable-dp-attention"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "sglang serve: error: --enable-histate: --enable-dp-attention is not supported (attention data parallelism "
        "is not covered by HiState's tests); drop one of them")


def test_unproven_modes_on_the_engine_path_raise(sglang_plugins, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("HISTATE_ENABLE", "1")
    for kwargs, match in (({"enable_two_batch_overlap": True}, "--enable-two-batch-overlap is not supported"),
                          ({"speculative_algorithm": "EAGLE3"}, "--speculative-algorithm EAGLE3 is not supported"),
                          ({"cuda_graph_config": {"prefill": {"backend": "full"}}}, "prefill.backend full")):
        with pytest.raises(HiStateConfigError, match=match):
            ServerArgs(model_path="dummy", **kwargs).resolve_once()


def test_single_batch_overlap_does_not_split_batches_or_touch_gdn_models():
    """Accepted: `--enable-single-batch-overlap` only overlaps MoE dispatch/combine with GEMMs inside
    one batch (batch_overlap/single_batch_overlap.py, `SboFlags`; layers/moe/utils.py:506): no child
    batches, and SGLang's Qwen3-Next / Qwen3.5 models never read it."""
    import importlib.util

    def source(module):
        with open(importlib.util.find_spec(module).origin) as f:
            return f.read()

    sbo = source("sglang.srt.batch_overlap.single_batch_overlap")
    assert "ForwardBatch" not in sbo and "tbo_children" not in sbo
    for model in ("sglang.srt.models.qwen3_next", "sglang.srt.models.qwen3_5"):
        text = source(model)
        assert "single_batch_overlap" not in text and "is_sbo_enabled" not in text and "SboFlags" not in text


def test_breakable_prefill_graphs_run_the_gdn_extend_eagerly(sglang_plugins, tmp_path):
    """Accepted (SGLang's default prefill graph on CUDA, cuda_graph_config.py:119-123): in a breakable
    graph `RadixLinearAttention` runs a linear layer's extend through an eager break unless the backend
    supports in-graph extend (radix_linear_attention.py:97-120, 162-167), and only KDA does; on replay
    the runner builds the attention metadata eagerly from the serving batch (prefill_cuda_graph_runner.py:
    1294-1302), so HiState's init_forward_metadata, _convolve_prefill and _track_mamba_state_extend hooks
    run as in an eager pass. Resolved here with the breakable backend, which the check imports."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend

    assert "supports_prefill_graph_extend" not in vars(GDNAttnBackend)
    assert MambaAttnBackendBase.supports_prefill_graph_extend(object.__new__(GDNAttnBackend)) is False
    assert "supports_prefill_graph_extend" in vars(KDAAttnBackend)  # the one backend that captures its extend
    assert plugin.gdn_extend_runs_in_prefill_graph() is False
    record = _resolve(_qwen35(tmp_path), "--cuda-graph-backend-prefill", "breakable")
    assert resolved_view(record).cuda_graph_config.prefill.backend == "breakable"


def test_a_sglang_whose_gdn_extend_runs_inside_the_prefill_graph_is_refused(sglang_plugins, capsys, tmp_path,
                                                                             monkeypatch):
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    monkeypatch.setattr(GDNAttnBackend, "supports_prefill_graph_extend", lambda self: True, raising=False)
    record = _prepare(["--model-path", _qwen35(tmp_path), "--enable-histate", *CPU_RESOLVABLE,
                       "--cuda-graph-backend-prefill", "breakable"])
    assert _one_line_error(capsys, record.resolve_once).startswith(
        "sglang serve: error: --enable-histate: --cuda-graph-backend-prefill breakable is not supported with this "
        "SGLang (its GDNAttnBackend runs the extend inside the prefill graph")


def _declare_in_step(monkeypatch, step, **fields):
    """Wrap a resolution step so that it declares `fields` the way a model default or a derived setting
    would (e.g. Inkling's full prefill graph, `--dwdp-size` -> attn_dp_size)."""
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.arg_groups.overrides import declare_resolution

    monkeypatch.setattr(resolution_hooks, "_HOOKS", {k: list(v) for k, v in resolution_hooks._HOOKS.items()})

    def declare(server_args, previous):
        previous(server_args)
        values = {k: (v(server_args) if callable(v) else v) for k, v in fields.items()}
        declare_resolution(server_args, "test_accepted_configs", **values)

    resolution_hooks.register_resolution_hook(step)(declare)


def test_a_full_prefill_graph_sglang_picks_itself_is_refused_at_the_resolution_step(sglang_plugins, capsys, tmp_path,
                                                                                       monkeypatch):
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.model_executor.cuda_graph_config import Phase, with_phase

    _declare_in_step(monkeypatch, "handle_cuda_graph_config", cuda_graph_config=lambda sa: with_phase(
        resolved_view(sa).cuda_graph_config, Phase.PREFILL, backend="full"))
    record = _prepare(["--model-path", _qwen35(tmp_path), "--enable-histate", *CPU_RESOLVABLE])
    assert _one_line_error(capsys, record.resolve_once) == (
        "sglang serve: error: --enable-histate: a full prefill CUDA graph (cuda_graph_config.prefill.backend full) "
        "is not supported (its replay runs the GDN extend inside the graph, where HiState's capture hooks do not "
        "run, so planned checkpoints stay unfilled); use --cuda-graph-backend-prefill breakable or disabled")


def test_attention_dp_sglang_derives_is_refused_at_the_resolution_step(sglang_plugins, capsys, tmp_path, monkeypatch):
    _declare_in_step(monkeypatch, "handle_dwdp", attn_dp_size=2)
    record = _prepare(["--model-path", _qwen35(tmp_path), "--enable-histate", *CPU_RESOLVABLE])
    assert _one_line_error(capsys, record.resolve_once).startswith(
        "sglang serve: error: --enable-histate: attention data parallelism (attn_dp_size 2, from --attn-dp-size, "
        "--enable-dp-attention or --dwdp-size) is not supported")


def test_launch_server_refuses_a_mamba2_model_with_one_line(tmp_path):
    """The user's path end to end (one subprocess): `python -m sglang.launch_server` reads config.json,
    refuses before any weights load, one line, exit status 2."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "sglang_cpu", "stubs.py"), "sglang.launch_server",
         "--model-path", _nemotron_h(tmp_path), "--enable-histate", *CPU_RESOLVABLE],
        capture_output=True, text=True, timeout=180, cwd=HERE)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "sglang serve: error: --enable-histate: NemotronHForCausalLM is not supported: its recurrent layers are "
        "Mamba2 layers (Mamba2AttnBackend)"), proc.stderr[-2000:]
