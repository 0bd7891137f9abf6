"""The shared L3 tier below every server's private SSD: a Mooncake Store (services for a loopback
cluster, HiState's framed-object client). The write/read rules are pure and live in core/l3_policy.py."""
