"""Each server's network link to the shared L3 store (cluster mode), and its PLACEHOLDER defaults.

A link is a FIFO channel in the engine (engine.py `Engine(l3_link=...)`): a restore from L3 costs
one operation's latency plus bytes / bandwidth on it and then crosses H2D, like an SSD read; the
puts a server makes after a request are background work on it (one operation's latency per object
group written, plus bytes / bandwidth).

The numbers below are NOT calibrated. They stand in until the loopback cluster measurements
(Mooncake Transfer Engine between two SGLang servers on one host; the engineer building the
loopback cluster owns them) give a measured put/get bandwidth and per-operation latency. Replace
`PLACEHOLDER_L3_LINK` with those numbers, cite the measurement here, and drop the word placeholder.
Until then every cluster-mode result that reads from L3 is labelled with these values.
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


PLACEHOLDER_L3_LINK_GBPS = 100.0
"""PLACEHOLDER (uncalibrated): one 100 Gbit/s NIC per server, the common RDMA NIC of a Mooncake
deployment; the loopback cluster measurement replaces it (module docstring)."""
PLACEHOLDER_L3_OP_LATENCY_MS = 1.0
"""PLACEHOLDER (uncalibrated): one master round trip + transfer set-up per batched operation."""
PLACEHOLDER_L3_LINK = L3LinkSpec(PLACEHOLDER_L3_LINK_GBPS * GBIT, PLACEHOLDER_L3_OP_LATENCY_MS / 1e3)
