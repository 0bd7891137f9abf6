"""SSD options that would silently disable or cripple the tier are one clear error at the argument phase,
naming the flag or env var (HiStateConfigError; SGLang's launcher prints it on one line, exit 2)."""
import json

import pytest

from histate.sglang_plugin.config import MIN_SSD_SIZE_BYTES, HiStateConfigError, resolve_config
from histate.sglang_plugin.server_settings import storage_extra_config


@pytest.mark.parametrize("cli, env, name", [
    ({"ssd_dirs": ["/tmp/x"], "ssd_size_bytes": "0.0000000001"}, {}, "--histate-ssd-size"),
    ({"ssd_dirs": ["/tmp/x"], "ssd_size_bytes": "100b"}, {}, "--histate-ssd-size"),
    ({"ssd_dirs": ["/tmp/x"], "ssd_size_bytes": "1MiB"}, {}, "--histate-ssd-size"),
    ({"ssd_dirs": ["/tmp/x"]}, {"HISTATE_SSD_SIZE": "63MiB"}, "HISTATE_SSD_SIZE"),
    ({"ssd_dirs": ["/tmp/x"], "ssd_size_bytes": "-5GB"}, {}, "--histate-ssd-size"),
    ({"ssd_dirs": ["/tmp/x"], "ssd_size_bytes": "nan"}, {}, "--histate-ssd-size"),
    ({"ssd_dirs": [""]}, {}, "--histate-ssd-dir"),
    ({"ssd_dirs": ["/tmp/a", "  "]}, {}, "--histate-ssd-dir"),
    ({}, {"HISTATE_SSD_DIR": "/a:b"}, "HISTATE_SSD_DIR"),
    ({"ssd_dirs": ["/a:b"]}, {}, "--histate-ssd-dir"),
    ({}, {"HISTATE_SSD_DIR": "/a,,/b"}, "HISTATE_SSD_DIR"),
    ({}, {"HISTATE_SSD_DIR": " , "}, "HISTATE_SSD_DIR"),
    ({"ssd_dirs": ["/tmp/x", "/tmp/x/"]}, {}, "--histate-ssd-dir"),
])
def test_values_that_disable_the_tier_are_refused(cli, env, name):
    with pytest.raises(HiStateConfigError) as err:
        resolve_config({"enable": True, **cli}, env)
    message = str(err.value)
    assert message.startswith(name) and "\n" not in message


@pytest.mark.parametrize("cli, env, dirs, size", [
    ({"ssd_dirs": ["/tmp/x"], "ssd_size_bytes": "0"}, {}, ("/tmp/x",), 0),  # 0 = sized from free space
    ({"ssd_dirs": ["/tmp/x"], "ssd_size_bytes": "64MiB"}, {}, ("/tmp/x",), MIN_SSD_SIZE_BYTES),
    ({}, {"HISTATE_SSD_DIR": "/tmp/a,/tmp/b", "HISTATE_SSD_SIZE": "1.5GB"}, ("/tmp/a", "/tmp/b"), 1_500_000_000),
    ({}, {"HISTATE_SSD_DIR": ""}, (), 0),  # empty env var = unset
])
def test_sensible_values_still_parse(cli, env, dirs, size):
    cfg = resolve_config({"enable": True, **cli}, env)
    assert cfg.ssd_dirs == dirs and cfg.ssd_size_bytes == size


class _Raw:
    def __init__(self, extra):
        self.hicache_storage_backend_extra_config = extra


@pytest.mark.parametrize("extra, word", [
    ({"histate": ["ssd_dirs", "/a"]}, "'histate'"),
    ({"histate": "x"}, "'histate'"),
    ({"histate": {"ssd_dirs": 3}}, "ssd_dirs"),
    ({"histate": {"no_such_key": 1}}, "no_such_key"),
])
def test_a_malformed_histate_section_is_one_clear_error(extra, word):
    cfg = resolve_config({"enable": True, "ssd_dirs": ["/tmp/x"]}, {})
    with pytest.raises(HiStateConfigError, match=word) as err:
        storage_extra_config(_Raw(json.dumps(extra)), cfg)
    message = str(err.value)
    assert message.startswith("--hicache-storage-backend-extra-config") and "\n" not in message
