"""SGLang's own unified-radix-cache test kit as the tests of series 0005 and 0006 use it: a Full + Mamba cache
on the Python tree core (on CPU here), and one request's turn through it (match, finish, cache). In SGLang's
tree this would sit beside the kit (`sglang/test/kits/unified_radix_cache`)."""
from __future__ import annotations

import dataclasses
from array import array
from unittest import mock

from sglang.srt.managers.schedule_batch import FINISH_LENGTH
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.kits.unified_radix_cache import config as kit_config
from sglang.test.kits.unified_radix_cache import fixtures as kit_fixtures
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures


def build_kit(mamba_slots: int, kv_tokens: int) -> UnifiedRadixCacheFixtures:
    """The kit's fixtures with `cache`, `allocator` and `pool` built from its first Full + Mamba config."""
    kit = UnifiedRadixCacheFixtures()
    kit.cfg = dataclasses.replace(next(c for c in kit_config.CONFIGS if c.has_mamba and not c.has_swa),
                                  mamba_cache_size=mamba_slots, kv_size=kv_tokens)
    with mock.patch.object(kit_fixtures, "get_device", lambda: "cpu"):
        kit.cache, kit.allocator, kit.pool = kit_fixtures.build_fixture(kit.cfg, tree_core_backend="python")
    return kit


def build_python_core_cache(kit: UnifiedRadixCacheFixtures):
    """Another cache of the kit's config (nothing registered on it)."""
    with mock.patch.object(kit_fixtures, "get_device", lambda: "cpu"):
        cache, _, _ = kit_fixtures.build_fixture(kit.cfg, tree_core_backend="python")
    return cache


def turn(kit: UnifiedRadixCacheFixtures, tokens: list) -> None:
    """One request: matched, finished, its KV and state cached (as the scheduler releases it)."""
    req, _ = kit._make_inflight_req(kit.cache, kit.allocator, kit.pool, tokens, allocated=True)
    kit.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
    req.finished_reason = FINISH_LENGTH(length=0)
    release_kv_cache(req, kit.cache, checkpoint=True)
