"""The automatic host write policy (core/write_policy.py) and the simulator's `histate` that runs it.

Expectations are written out by hand from the rule's statement (write_back with an SSD tier, no L3, and a
host KV pool at most 1.8x the device pool), not computed with the module's constant."""
from __future__ import annotations

import pytest

from histate.core import make_policy, with_host_write_policy
from histate.core.write_policy import auto_host_write_policy
from histate.sim.replay import ReplayConfig

GiB = 1 << 30


@pytest.mark.parametrize("host_bytes, expected", [
    (48 * GiB, "write_back"),          # cpu48 next to a 45 GiB device: 1.07x
    (80 * GiB, "write_back"),          # 1.78x
    (81 * GiB, "write_back"),          # exactly 1.8x of 45 GiB
    (81 * GiB + 1, "write_through"),   # one byte over
    (96 * GiB, "write_through"),       # the base row: 2.13x
])
def test_write_back_up_to_one_point_eight_times_the_device(host_bytes, expected):
    assert auto_host_write_policy(45 * GiB, host_bytes, has_ssd=True, has_l3=False) == expected


def test_no_ssd_or_an_l3_keeps_write_through():
    assert auto_host_write_policy(45 * GiB, 48 * GiB, has_ssd=False, has_l3=False) == "write_through"
    assert auto_host_write_policy(45 * GiB, 48 * GiB, has_ssd=True, has_l3=True) == "write_through"


def test_a_device_of_no_bytes_is_refused():
    with pytest.raises(ValueError, match="device_bytes"):
        auto_host_write_policy(0, 1, has_ssd=True, has_l3=False)


def test_the_simulators_histate_is_the_write_back_server_on_a_short_host():
    short = ReplayConfig(cpu_cache_bytes=48 * GiB)
    rules = short.rules("histate")
    writeback = make_policy("histate-writeback")
    assert rules.name == "histate"
    assert rules.kv_write_through_tiers == writeback.kv_write_through_tiers == ()
    assert rules.host_reclaims_duplicates and rules.checkpoint_tiers == writeback.checkpoint_tiers
    # the default row (96 GiB host), an L3 fleet, no SSD, and every other policy keep their own rules
    assert type(ReplayConfig().rules("histate")) is type(make_policy("histate"))
    assert type(short.rules("histate", has_l3=True)) is type(make_policy("histate"))
    assert type(ReplayConfig(cpu_cache_bytes=48 * GiB, ssd_cache_bytes=0).rules("histate")) is type(make_policy("histate"))
    for name in ("histate-paper", "histate-no-depth", "histate-exclusive", "vllm-disk", "unlimited"):
        assert type(short.rules(name)) is type(make_policy(name)), name


def test_with_host_write_policy_leaves_subclasses_alone():
    """Only `histate` itself is the server; an ablation keeps the write policy its name says."""
    paper = make_policy("histate-paper")
    assert with_host_write_policy(paper, 45 * GiB, 1 * GiB, has_ssd=True, has_l3=False) is paper
