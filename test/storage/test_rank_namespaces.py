"""Several SGLang ranks share one --histate-ssd-dir: one namespace (subdirectory, lock, budget) per rank.

Uses SGLang's real HiCacheStorageConfig and the real `dynamic` backend class; SGLang is imported
through the CPU bootstrap the SGLang tests use (sglang_cpu/stubs.py; skipped where SGLang is not
installed).
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("sglang") is None:  # pragma: no cover - environment without SGLang
    pytest.skip("sglang not installed", allow_module_level=True)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
from sglang_cpu import stubs  # noqa: E402  (the repository root's CPU bootstrap)

stubs.install()
import torch  # noqa: E402

from histate.sglang_plugin.config import HiStateConfigError, resolve_config  # noqa: E402
from histate.sglang_plugin.server_settings import storage_extra_config  # noqa: E402

MiB = 1 << 20


def _storage_config(ssd_dir, tp_rank=0, tp_size=1, size="256MiB", dp_rank=0, **extra_section):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    config = resolve_config({"enable": True, "ssd_dirs": [str(ssd_dir)], "ssd_backend": "file",
                             "ssd_size_bytes": size}, {})
    extra = storage_extra_config(None, config)
    extra["histate"].update(extra_section)
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name="org/model", dp_rank=dp_rank,
                                extra_config=extra)


@pytest.fixture
def backends():
    from histate.sglang_plugin.storage_backend import HiStateStorageBackend

    made = []

    def make(*args, **kw):
        made.append(HiStateStorageBackend(_storage_config(*args, **kw), {}))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_two_tp_ranks_share_one_directory(tmp_path, backends):
    ssd = tmp_path / "ssd"
    rank0, rank1 = backends(ssd, tp_rank=0, tp_size=2), backends(ssd, tp_rank=1, tp_size=2)
    roots = {rank0.store.layout.roots[0], rank1.store.layout.roots[0]}
    assert len(roots) == 2 and all(os.path.dirname(r) == str(ssd) for r in roots)
    assert rank0.store.config.capacity_bytes == rank1.store.config.capacity_bytes == 256 * MiB  # per rank
    page0, page1 = torch.arange(64, dtype=torch.float32), torch.arange(64, dtype=torch.float32) + 1
    assert rank0.batch_set(["h"], [page0]) and rank1.batch_set(["h"], [page1])
    assert torch.equal(rank0.get("h", torch.zeros(64)), page0)
    assert torch.equal(rank1.get("h", torch.zeros(64)), page1)
    rank1.close()
    again = backends(ssd, tp_rank=1, tp_size=2)  # warm restart of one rank finds its own pages
    assert torch.equal(again.get("h", torch.zeros(64)), page1) and rank0.exists("h")


def test_replicas_with_one_rank_identity_take_separate_slots(tmp_path, backends):
    """Data-parallel replicas without attention DP have identical rank identities (SGLang passes
    dp_rank=0 for them); each still gets its own namespace instead of a lock error."""
    ssd = tmp_path / "ssd"
    first, second = backends(ssd), backends(ssd)
    assert first.store.layout.roots != second.store.layout.roots
    with_dp = backends(ssd, dp_rank=1)
    assert with_dp.store.layout.roots[0] not in first.store.layout.roots + second.store.layout.roots


def test_a_share_below_one_checkpoint_is_a_config_error(tmp_path, backends):
    with pytest.raises(HiStateConfigError, match="--histate-ssd-size"):
        backends(tmp_path / "ssd", ssd_size_bytes=4096)


@pytest.mark.parametrize("section, word", [
    ({"ssd_dirs": "/a"}, "ssd_dirs"),
    ({"ssd_size_bytes": "lots"}, "ssd_size_bytes"),
    ({"io_backend": "gds"}, "io_backend"),
    ({"unknown_knob": 1}, "unknown_knob"),
])
def test_a_malformed_section_is_one_clear_error(tmp_path, backends, section, word):
    with pytest.raises(HiStateConfigError, match=word) as err:
        backends(tmp_path / "ssd", **section)
    assert "\n" not in str(err.value)
