"""Each server's network link to the shared L3 store (cluster mode): measured latency, assumed fleet bandwidth.

A link is a FIFO channel in the engine (engine.py `Engine(l3_link=...)`): a restore from L3 costs
one operation's latency plus bytes / bandwidth on it and then crosses H2D, like an SSD read; the
puts a server makes after a request are background work on it (one operation's latency per object
group written, plus bytes / bandwidth).

Calibration (`benchmark/l3_loopback.py`, one master + one store service on 127.0.0.1, TCP, 2-core
CI box, medians of 9): get = 0.42 ms + size / 0.57 GB/s, put = 0.42 ms + size / 0.46 GB/s. The
per-operation latency is the software path a fleet has too (RPC to the master, transfer set-up), so
the default op latency is that measurement. The loopback bandwidth is not a network's: it is two
busy cores copying through the kernel's TCP stack. A fleet's per-server link is an assumption,
`FLEET_L3_LINK_GBPS`, and every cluster result that reads from L3 says which link it ran with.
`LOOPBACK_L3_LINK` is the measured link, used when the simulator reproduces the loopback cluster.
"""
from __future__ import annotations

from dataclasses import dataclass

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class L3LinkSpec:
    bandwidth_bytes_per_s: float
    op_latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.op_latency_s < 0:
            raise ValueError(f"L3 link needs bandwidth > 0 and latency >= 0: {self}")


MEASURED_L3_OP_LATENCY_MS = 0.42
"""Measured on loopback (module docstring): per get/put operation, independent of size."""
MEASURED_LOOPBACK_GET_GBPS = 0.57 * 8
"""Measured on loopback: 0.57 GB/s of gets, CPU-bound TCP copies on a 2-core box."""
FLEET_L3_LINK_GBPS = 100.0
"""ASSUMED, not measured here: one 100 Gbit/s NIC per server, the common RDMA NIC of a Mooncake
deployment."""
LOOPBACK_L3_LINK = L3LinkSpec(MEASURED_LOOPBACK_GET_GBPS * GBIT, MEASURED_L3_OP_LATENCY_MS / 1e3)
FLEET_L3_LINK = L3LinkSpec(FLEET_L3_LINK_GBPS * GBIT, MEASURED_L3_OP_LATENCY_MS / 1e3)
