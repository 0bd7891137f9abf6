"""The reference worker's L3 deletes (reference/l3_tier.py + core/l3_ledger.py) on a loopback Mooncake:
the victim is the bundle eq. 7 ranks lowest, computed here by hand, and its objects then read as misses.

Ledger units (not the payloads' sizes; the ledger only needs consistent ones): a page is 10 tokens and
100 bytes, a state 200 bytes (N_s = 20 tokens), tau = 60 s.
  A1 = 4 pages written at t = 10, B = 2 pages at t = 50, A2 = A1 + 1 page at t = 100 (protected: just
  written). Bytes: 5 + 2 pages and 3 states = 1300 > the budget 1100.
  H(A1) = 10 + 60 * C/M with C = 4 pages = 40 tokens, M = its state only (A2 needs its pages) = 20
        = 130
  H(B)  = 50 + 60 * 20 / (2 * 10 + 20) = 80
  -> B leaves (its 2 KV pages and its state: 1300 - 400 = 900 <= 1100); an LRU of objects would have
  taken A1's state (t = 10) first.
"""
import random
import uuid

import pytest

from histate.core.l3_ledger import L3Ledger, L3LedgerConfig

pytest.importorskip("torch")
pytest.importorskip("histate_kernels")

from histate.l3.client import L3Client  # noqa: E402
from histate.reference.l3_tier import L3Tier, kv_object_name, state_object_name  # noqa: E402
from histate.reference.page_keys import page_keys  # noqa: E402


class _BytesCodec:
    """Payloads are the bytes the test hands in (the codec's framing is not under test here)."""

    @staticmethod
    def encode_kv_page(page) -> bytes:
        return page

    @staticmethod
    def encode_state(packed) -> bytes:
        return packed


def _write(tier: L3Tier, keys, now_s: float) -> None:
    tier.write_bundle(keys, [len(keys)], 0, lambda n: [b"kv-%d" % i for i in range(n)],
                      lambda depth: b"state-%d" % depth, _BytesCodec(), now_s)


def test_the_lowest_eq7_bundle_is_removed_and_reads_as_a_miss(mooncake):
    rng = random.Random(30)
    tokens_a = [rng.randrange(512) for _ in range(5 * 64 + 1)]
    tokens_b = [rng.randrange(512) for _ in range(2 * 64 + 1)]
    a2, b = page_keys(tokens_a[:-1], 64), page_keys(tokens_b[:-1], 64)
    a1 = a2[:4]
    assert len(a2) == 5 and len(b) == 2
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    tier = L3Tier(L3Client(mooncake.master_address, key_prefix=prefix),
                  ledger=L3Ledger(L3LedgerConfig(budget_bytes=1100, page_num_tokens=10, kv_page_bytes=100,
                                                 state_bytes=200, tau_s=60.0)))
    raw = L3Client(mooncake.master_address, key_prefix=prefix)
    try:
        _write(tier, a1, 10.0)
        _write(tier, b, 50.0)
        assert tier.stats.objects_deleted == 0     # 1000 bytes so far: within budget
        _write(tier, a2, 100.0)
        assert tier.stats.objects_deleted == 3 and tier.stats.object_delete_failures == 0
        gone = [kv_object_name(k) for k in b] + [state_object_name(b[-1])]
        kept = [kv_object_name(k) for k in a2] + [state_object_name(a1[-1]), state_object_name(a2[-1])]
        assert raw.exists_many(gone) == [False] * 3
        assert all(raw.get(name) is None for name in gone)
        assert raw.exists_many(kept) == [True] * len(kept)
        assert raw.get(state_object_name(a1[-1])) == b"state-4"
        # B's keys are no longer claimed: its next write re-puts it whole
        assert not (set(b) & (tier.known_kv | tier.known_state))
    finally:
        tier.client.close()
        raw.close()
