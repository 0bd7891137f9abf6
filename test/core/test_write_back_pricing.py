"""Eq. 4 under write_back: a checkpoint is priced by its stay on the device, where write_back keeps it.

Written through (`histate`), a new checkpoint goes to its home tier (the SSD) at creation, and T_state is
its residence there (Little's law on the SSD before any sample; a sample when its last copy goes). Under
write_back (`histate-writeback-via-host`, the plugin under `--hicache-write-policy write_back`) it stays on
the device until the device evicts it; pricing it by the SSD made a large SSD look like free checkpoints:
with a 10 TB SSD eq. 5 planned one every grid step, the device could not hold them, and gpu30 lost 0.7
points of hit rate to `no_checkpoint` misses (docs/results.md, "write_back with HiState").
"""
import pytest

from histate.core import HybridPrefixCache, PolicyState, Tier, make_policy

from .helpers import tiny_config


class _Node:
    def __init__(self, kv_created_s=0.0, ckpt_created_s=0.0):
        self.kv_created_s, self.ckpt_created_s = kv_created_s, ckpt_created_s


def _state(policy: str, ssd_pages: int, **kw) -> PolicyState:
    return PolicyState(make_policy(policy), tiny_config(100, 200, ssd_pages), **kw)


def test_written_through_states_are_priced_by_the_ssd_and_write_back_states_by_the_device():
    for policy, home in (("histate", Tier.SSD), ("histate-writeback-via-host", Tier.GPU)):
        state = _state(policy, 10_000)
        assert state.state_home_tier is home, policy
        # Little's law before any sample: 1,000 bytes into the device (capacity 6,400) and 1,000 into the
        # SSD (capacity 640,000) over 10 s: T_KV = 64 s; T_state = 6,400 s on the SSD, 64 s on the device.
        state.on_bytes_in(Tier.GPU, 500, 0.0)
        state.on_bytes_in(Tier.SSD, 500, 0.0)
        state.on_bytes_in(Tier.GPU, 500, 5.0)
        state.on_bytes_in(Tier.SSD, 500, 5.0)
        expected = 64.0 / 6400.0 if home is Tier.SSD else 1.0
        assert state.pressure_ratio(10.0) == pytest.approx(expected), policy


def test_the_plugin_passes_the_write_policy_in_place_of_the_policys():
    state = _state("histate", 10_000, checkpoint_write_through=False)
    assert state.state_home_tier is Tier.GPU and state.states_priced_on_device
    assert _state("histate-writeback-via-host", 10_000, checkpoint_write_through=None).states_priced_on_device
    # no SSD: a checkpoint lives on the device either way, sampled when its last copy goes
    state = PolicyState(make_policy("histate-writeback-via-host"), tiny_config(100, 200))
    assert state.state_home_tier is Tier.GPU and not state.states_priced_on_device


@pytest.mark.parametrize("policy, sampled_on", [("histate", "gone"), ("histate-writeback-via-host", "device exit")])
def test_t_state_is_sampled_where_the_checkpoint_leaves_its_placement(policy, sampled_on):
    state = _state(policy, 10_000)
    state.on_kv_left_gpu(_Node(kv_created_s=0.0), 100.0)  # T_KV = 100 s
    state.on_state_left_device(_Node(ckpt_created_s=0.0), 25.0)  # 25 s on the device
    state.on_state_gone(_Node(ckpt_created_s=0.0), 400.0)  # last copy gone after 400 s
    assert state.pressure_ratio(500.0) == pytest.approx(100.0 / (400.0 if sampled_on == "gone" else 25.0))


def _plans(policy: str, ssd_pages: int) -> list:
    """Every request's planned checkpoint pages: 6 sessions of 4 turns of 48 new pages, a 400-page device
    (about one session's context), a host of 2,000 pages: the device evicts, the SSD never fills."""
    cache = HybridPrefixCache(tiny_config(400, 2000, ssd_pages, supported_intervals_pages=(2, 4, 8, 16, 32)),
                              make_policy(policy))
    plans, now_s = [], 0.0
    for turn in range(4):
        for session in range(6):
            keys = [(session, i) for i in range(48 * (turn + 1))]
            now_s += 7.0
            lease = cache.begin_request(keys, now_s)
            positions = cache.plan_checkpoints(lease)
            plans.append(tuple(positions))
            cache.finish_request(lease, None, now_s, positions)
    if policy == "histate-writeback-via-host":
        # the device evicted checkpoints, and each exit was a T_state sample (none is gone: the host holds them)
        assert cache.state.controller.state_residence_s.value is not None
        assert cache.stats.num_checkpoint_failures == 0
    return plans


def test_the_ssds_size_does_not_change_what_write_back_plans():
    """While the SSD has room, its size is not a price under write_back: a checkpoint waits on the
    device. Written through it is (a 10^4 times larger SSD holds a checkpoint 10^4 times longer by
    Little's law), so the same comparison tells the two apart."""
    small, huge = 3_000, 30_000_000
    assert _plans("histate-writeback-via-host", small) == _plans("histate-writeback-via-host", huge)
    assert _plans("histate", small) != _plans("histate", huge)
