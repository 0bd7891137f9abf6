"""The test that ships with upstream/series 0003 ([server-args] plugin-declared arguments).

Written as it would sit in SGLang's own test tree (no HiState import): a toy plugin declares two flags
and the test drives SGLang's own `prepare_server_args`, `ServerArgs(**kwargs)`, `resolve_once` and
pickling on the patched copy that `make upstream-check` builds.
"""
from __future__ import annotations

import argparse
import pickle

import pytest

from sglang.srt.arg_groups import plugin_args
from sglang.srt.arg_groups.plugin_args import PluginArgs, plugin_config, register_plugin_args
from sglang.srt.server_args import ServerArgs, prepare_server_args

TITLE = "Toy plugin (upstream/series 0003 test)"


class ToyConfig:
    def __init__(self, enable: bool, budget: int, source: str):
        self.enable, self.budget, self.source = enable, budget, source


calls: list = []


def _add(group):
    group.add_argument("--toy-enable", action="store_true", default=False, help="turn the toy plugin on")
    group.add_argument("--toy-budget", default=None, help="a number of pages")


def _parse(namespace):
    calls.append(("parse", namespace is not None))
    raw = None if namespace is None else namespace.toy_budget
    if raw is not None and not str(raw).isdigit():
        raise ValueError(f"--toy-budget: {raw!r} is not a number of pages")
    enable = bool(namespace.toy_enable) if namespace is not None else False
    return ToyConfig(enable, int(raw or 7), "cli" if namespace is not None else "engine")


def _apply(server_args, config):
    calls.append(("apply", config.source))
    if config.enable and server_args.disable_radix_cache:
        raise ValueError("--toy-enable cannot be combined with --disable-radix-cache")
    if config.enable:
        server_args.chunked_prefill_size = config.budget * 64  # an implied SGLang setting


TOY = PluginArgs(name="toy", title=TITLE, add_arguments=_add, parse=_parse, apply=_apply)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(plugin_args, "_REGISTRY", {})
    calls.clear()
    register_plugin_args(TOY)
    return TOY


def _prepare(*argv):
    return prepare_server_args(["--model-path", "dummy", *argv])


def test_nothing_registered_leaves_the_record_as_stock_builds_it(monkeypatch):
    monkeypatch.setattr(plugin_args, "_REGISTRY", {})
    record = _prepare("--chunked-prefill-size", "512")
    assert record.chunked_prefill_size == 512
    assert not any(name.startswith("_plugin_arg") for name in vars(record))
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert TITLE not in [group.title for group in parser._action_groups]


def test_flags_appear_in_one_help_group(toy):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    group = next(g for g in parser._action_groups if g.title == TITLE)
    assert sorted(a.option_strings[0] for a in group._group_actions) == ["--toy-budget", "--toy-enable"]


def test_cli_values_are_parsed_applied_once_and_kept_through_resolution_and_pickling(toy):
    record = _prepare("--toy-enable", "--toy-budget", "3")
    config = plugin_config(record, "toy")
    assert (config.enable, config.budget, config.source) == (True, 3, "cli")
    assert record.chunked_prefill_size == 3 * 64  # written by apply while the record was input
    assert plugin_args.parsed_from_command_line(record)
    assert not hasattr(record, "toy_budget")  # the plugin's values are not ServerArgs fields
    record.resolve_once()  # dummy model: the pipeline returns early; apply must not run again
    assert calls == [("parse", True), ("apply", "cli")]
    copy = pickle.loads(pickle.dumps(record))
    assert plugin_config(copy, "toy").budget == 3 and plugin_config(copy, "other", "none") == "none"


def test_engine_records_parse_none_before_resolution_seals_them(toy):
    record = ServerArgs(model_path="dummy")
    assert plugin_config(record, "toy") is None
    record.resolve_once()
    config = plugin_config(record, "toy")
    assert (config.enable, config.budget, config.source) == (False, 7, "engine")
    assert calls == [("parse", False), ("apply", "engine")]
    assert not plugin_args.parsed_from_command_line(record)


def test_a_bad_value_on_the_command_line_is_one_line_and_exit_2(toy, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _prepare("--toy-budget", "many")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "sglang serve: error: --toy-budget: 'many' is not a number of pages")


def test_a_conflict_found_by_apply_is_one_line_on_the_command_line(toy, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _prepare("--toy-enable", "--disable-radix-cache")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "sglang serve: error: --toy-enable cannot be combined with --disable-radix-cache"
    assert not any("usage:" in line for line in err)  # not argparse's whole usage first


def test_on_the_engine_path_the_plugins_error_reaches_the_caller_and_the_record_is_spent(toy, monkeypatch):
    monkeypatch.setattr(plugin_args, "_REGISTRY", {})
    register_plugin_args(PluginArgs(name="toy", title=TITLE, add_arguments=_add,
                                    parse=lambda ns: ToyConfig(True, 7, "engine"), apply=_apply))
    record = ServerArgs(model_path="dummy", disable_radix_cache=True)
    with pytest.raises(ValueError, match="cannot be combined with --disable-radix-cache"):
        record.resolve_once()
    with pytest.raises(RuntimeError, match="resolution already failed"):
        record.resolve_once()


def test_a_name_is_owned_by_one_spec(toy):
    register_plugin_args(TOY)  # the same declaration again (register() runs in every process): a no-op
    with pytest.raises(ValueError, match="'toy' are already registered"):
        register_plugin_args(PluginArgs(name="toy", title="another", add_arguments=_add, parse=_parse))
