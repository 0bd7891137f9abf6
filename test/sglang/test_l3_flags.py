"""`--histate-l3` through SGLang's real ServerArgs machinery: off by default, `mooncake` with a master
from SGLang's Mooncake configuration, refused (one line naming the flag) without one or without Mooncake.
No store is started here (test_l3_mooncake.py runs against one)."""
from __future__ import annotations

import json

import pytest

from histate.sglang_plugin.cli_hooks import stashed_config
from histate.sglang_plugin import server_settings
from histate.sglang_plugin.config import HiStateConfigError, resolve_config

MOONCAKE_VARS = ("MOONCAKE_MASTER", "MOONCAKE_CLIENT", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")


@pytest.fixture(autouse=True)
def _no_mooncake_env(monkeypatch):
    for name in MOONCAKE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(server_settings, "mooncake_unavailable_reason", lambda: None)


def _prepare(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", "dummy", *argv])


def _cli_error(capsys, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _prepare(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("sglang serve: error: "), lines
    return lines[-1]


def _extra(sa) -> dict:
    return json.loads(sa.hicache_storage_backend_extra_config)


def test_l3_is_off_by_default_and_changes_nothing(sglang_plugins, tmp_path):
    sa = _prepare(["--enable-histate", "--histate-ssd-dir", str(tmp_path)])
    extra = _extra(sa)
    assert stashed_config(sa).l3 == "off"
    assert "l3" not in extra["histate"] and "interface_v1" not in extra


def test_l3_mooncake_with_the_master_from_env(sglang_plugins, tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    sa = _prepare(["--enable-histate", "--histate-ssd-dir", str(tmp_path), "--histate-l3", "mooncake"])
    extra = _extra(sa)
    assert stashed_config(sa).l3 == "mooncake" and stashed_config(sa).sources["l3"] == "cli"
    assert extra["histate"]["l3"] == "mooncake"
    assert extra["interface_v1"] == 1  # KV pages with host indices: Mooncake's zero-copy path
    assert sa.hicache_storage_backend == "dynamic"


def test_l3_mooncake_with_the_master_from_the_extra_config(sglang_plugins, tmp_path):
    user = {"master_server_address": "127.0.0.1:50051", "extra_backend_tag": "fleet1",
            "enable_group_semantics": True}
    sa = _prepare(["--enable-histate", "--histate-ssd-dir", str(tmp_path), "--histate-l3", "mooncake",
                   "--hicache-storage-backend-extra-config", json.dumps(user)])
    extra = _extra(sa)
    assert {k: extra[k] for k in user} == user  # SGLang's own Mooncake keys reach MooncakeStore as given
    assert extra["histate"]["l3"] == "mooncake"


def test_l3_mooncake_without_a_master_is_refused_naming_the_flag(sglang_plugins, tmp_path, capsys):
    line = _cli_error(capsys, ["--enable-histate", "--histate-ssd-dir", str(tmp_path), "--histate-l3", "mooncake"])
    assert line.startswith("sglang serve: error: --histate-l3 mooncake: no Mooncake master configured")
    assert "MOONCAKE_MASTER" in line and "master_server_address" in line


def test_l3_mooncake_without_mooncake_is_refused_naming_the_flag(sglang_plugins, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    monkeypatch.setattr(server_settings, "mooncake_unavailable_reason",
                        lambda: "mooncake.store does not import (No module named 'mooncake')")
    line = _cli_error(capsys, ["--enable-histate", "--histate-ssd-dir", str(tmp_path), "--histate-l3", "mooncake"])
    assert line == ("sglang serve: error: --histate-l3 mooncake: mooncake.store does not import "
                    "(No module named 'mooncake')")


def test_l3_needs_an_ssd_dir_and_enable_histate(sglang_plugins, capsys, monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    assert "--histate-l3 needs --histate-ssd-dir" in _cli_error(capsys, ["--enable-histate", "--histate-l3",
                                                                         "mooncake"])
    assert _cli_error(capsys, ["--histate-l3", "mooncake"]) == \
        "sglang serve: error: --histate-l3 needs --enable-histate (HiState is off)"


def test_a_bad_l3_choice_is_one_line(sglang_plugins, capsys, tmp_path):
    line = _cli_error(capsys, ["--enable-histate", "--histate-ssd-dir", str(tmp_path), "--histate-l3", "redis"])
    assert line == "sglang serve: error: --histate-l3: 'redis' is not one of off, mooncake"


def test_engine_path_reads_histate_l3_and_raises_for_the_caller(sglang_plugins, tmp_path, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("HISTATE_ENABLE", "1")
    monkeypatch.setenv("HISTATE_SSD_DIR", str(tmp_path))
    monkeypatch.setenv("HISTATE_L3", "mooncake")
    with pytest.raises(HiStateConfigError, match="^HISTATE_L3=mooncake: no Mooncake master configured"):
        ServerArgs(model_path="dummy").resolve_once()
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    sa = ServerArgs(model_path="dummy")
    sa.resolve_once()
    assert _extra(sa)["histate"]["l3"] == "mooncake" and stashed_config(sa).sources["l3"] == "env"


def test_the_storage_section_checks_l3():
    from histate.sglang_plugin.config import parse_storage_section

    assert parse_storage_section({"l3": "mooncake"}, option="X") == {"l3": "mooncake"}
    with pytest.raises(HiStateConfigError, match="l3 must be one of off, mooncake"):
        parse_storage_section({"l3": "yes"}, option="X")
    with pytest.raises(HiStateConfigError, match="--histate-l3 needs --histate-ssd-dir"):
        resolve_config({"enable": True, "l3": "mooncake"}, {})


def _l3_argv(tmp_path, *more) -> list:
    return ["--enable-histate", "--histate-ssd-dir", str(tmp_path), "--histate-l3", "mooncake", *more]


def test_l3_budget_servers_and_digests_reach_the_storage_section(sglang_plugins, tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    sa = _prepare(_l3_argv(tmp_path, "--histate-l3-budget-gb", "1.5", "--histate-l3-servers", "4",
                           "--histate-l3-require-digests"))
    section = _extra(sa)["histate"]
    assert (section["l3_budget_bytes"], section["l3_servers"], section["l3_require_digests"]) == (1_500_000_000, 4, True)
    default = _extra(_prepare(_l3_argv(tmp_path)))["histate"]  # no deletes, stock objects used unverified
    assert not {"l3_budget_bytes", "l3_servers", "l3_require_digests"} & set(default)


@pytest.mark.parametrize("more, message", [
    (["--histate-l3-budget-gb", "0", "--histate-l3-servers", "2"],
     "--histate-l3-budget-gb: must be a finite number of GB > 0 (leave it out for no deletes), got '0'"),
    (["--histate-l3-budget-gb", "lots", "--histate-l3-servers", "2"],
     "--histate-l3-budget-gb: expected a number of GB, got 'lots'"),
    (["--histate-l3-budget-gb", "10", "--histate-l3-servers", "0"],
     "--histate-l3-servers: must be >= 1 (the number of servers sharing the L3 store), got 0"),
    (["--histate-l3-budget-gb", "10"],
     "--histate-l3-budget-gb needs --histate-l3-servers (a server's share is the fleet budget / the number of "
     "servers)"),
    (["--histate-l3-servers", "3"],
     "--histate-l3-servers needs --histate-l3-budget-gb (a server's share is the fleet budget / the number of "
     "servers)"),
])
def test_bad_l3_budget_flags_are_one_line(sglang_plugins, capsys, tmp_path, monkeypatch, more, message):
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    assert _cli_error(capsys, _l3_argv(tmp_path, *more)) == f"sglang serve: error: {message}"


def test_l3_budget_and_digest_flags_need_l3(sglang_plugins, capsys, tmp_path):
    for flag in (["--histate-l3-budget-gb", "10", "--histate-l3-servers", "2"], ["--histate-l3-require-digests"]):
        line = _cli_error(capsys, ["--enable-histate", "--histate-ssd-dir", str(tmp_path), *flag])
        assert line == f"sglang serve: error: {flag[0]} needs --histate-l3 mooncake"


def test_the_storage_section_checks_the_l3_budget():
    from histate.sglang_plugin.config import parse_storage_section

    assert parse_storage_section({"l3_budget_bytes": 10, "l3_servers": 2, "l3_require_digests": False},
                                 option="X") == {"l3_budget_bytes": 10, "l3_servers": 2, "l3_require_digests": False}
    with pytest.raises(HiStateConfigError, match="l3_servers must be an integer >= 1"):
        parse_storage_section({"l3_servers": 0}, option="X")
    with pytest.raises(HiStateConfigError, match="l3_require_digests must be true or false"):
        parse_storage_section({"l3_require_digests": "yes"}, option="X")
