"""The host write policy HiState runs SGLang's HiCache with when the operator chose none.

SGLang's default, write_through, keeps a host copy of every KV page the device holds; write_back copies a
page to the host only when the device evicts it. Where the host is not much larger than the device, the
mirror's copies crowd out what only the host could hold. Measured (simulated, docs/results.md "write_back
against write_through as the host grows": the base row's 45 GiB device with a 48 to 96 GiB host, seeds
0-2, both schedulers; and the gpu30 row): write_back was faster at p95 on every seed up to a host 1.78x
the device, and mixed or level from 2.13x. So write_back when the host KV pool is at most
WRITE_BACK_MAX_HOST_TO_DEVICE times the device pool, and only where its other conditions hold:
  * an SSD tier: HiState's state writes at creation need one (sglang_plugin/state_writes.py); without it
    write_back keeps each checkpoint on the device until the device evicts it (`histate-writeback-via-host`),
    which that measurement did not cover;
  * no L3: the fleet's L3 gets a terminal bundle when its backup is queued, which write_back defers until
    the device evicts it (the plugin refuses `--histate-l3` with write_back).

Pure: sizes in, a policy name out. The server decides from its pools' agreed sizes
(sglang_plugin/write_policy.py), the simulator from its capacities (`ReplayConfig.rules`), with this one
function.
"""
from __future__ import annotations

WRITE_THROUGH = "write_through"
WRITE_BACK = "write_back"

WRITE_BACK_MAX_HOST_TO_DEVICE = 1.8
"""Between the last host size that gained on every seed (1.78x the device) and the first that did not (2.13x)."""


def auto_host_write_policy(device_bytes: int, host_kv_bytes: int, *, has_ssd: bool, has_l3: bool) -> str:
    """write_back or write_through for a device pool of `device_bytes` (KV and states) and a host KV
    pool of `host_kv_bytes`."""
    if device_bytes <= 0:
        raise ValueError(f"device_bytes must be > 0, got {device_bytes}")
    if not has_ssd or has_l3:
        return WRITE_THROUGH
    return WRITE_BACK if host_kv_bytes <= WRITE_BACK_MAX_HOST_TO_DEVICE * device_bytes else WRITE_THROUGH
