"""Every hit type, served with its checkpoint in every tier, reproduces a cold prefill.

Each case builds a session's history, then serves unrelated "flood" sessions until histate.core has
moved the checkpoint the hit needs down to the target tier (asked with the side-effect-free
`cache.match`), then serves the hit and compares it with a cold run. Intermediate checkpoints start on
SSD when the SSD tier exists (histate's historical tier), so GPU and CPU cases run without one.

  append       history A1; hit A1 + response + message            (c = A1's terminal checkpoint)
  fork         history A1, A2 = A1 + ...; hit A1 + other message  (c = A1's, now historical)
  truncate     history A1 (long); hit A1 cut inside a page of its message that holds no checkpoint,
               + new message (c = a checkpoint captured inside A1's one prefill, before the cut; c < m)
  rewind-edit  history A1, A2 (long); hit A2 with one token edited in such a page + new message
"""
import random
import zlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from histate.core import Tier  # noqa: E402
from histate.reference.exactness import TOLERANCE, max_logit_diff  # noqa: E402
from histate.reference.executor import ReferenceExecutor  # noqa: E402
from histate.reference.page_keys import page_keys  # noqa: E402
from histate.reference.ssd import open_ssd  # noqa: E402

HIT_TYPES = ["append", "fork", "truncate", "rewind-edit"]
TIERS = [Tier.GPU, Tier.CPU, Tier.SSD]
# HiState keeps checkpoints on the device and SSD (the host holds KV); the exclusive variant moves them
# through the host, which keeps the host transport of a checkpoint under test.
POLICY_FOR_TIER = {Tier.GPU: "histate", Tier.CPU: "histate-exclusive", Tier.SSD: "histate"}
MAX_FLOOD_REQUESTS = 40


def _history(hit_type, msg):
    a1 = msg(150) + msg(250)
    if hit_type == "append":
        return [a1]
    if hit_type == "fork":
        return [a1, a1 + msg(80) + msg(200)]
    if hit_type == "truncate":
        return [a1 + msg(900)]  # one prefill of ~20 pages: the controller plans intermediate checkpoints
    if hit_type == "rewind-edit":
        return [a1, a1 + msg(60) + msg(900)]
    raise ValueError(hit_type)


def _inside_page(served, history_tokens):
    """A page of the last history request's new segment that holds no checkpoint but has one before it,
    so the hit's KV match (m) ends there and its checkpoint (c) lies strictly before it."""
    planned = sorted(served.planned_checkpoint_pages)
    last = len(history_tokens) // 64
    candidates = [p for p in range(planned[0] + 1, last) if p not in planned]
    assert candidates, f"no checkpoint-free page after {planned[0]} (planned {planned})"
    return candidates[len(candidates) // 2]


def _hit(hit_type, history, served, msg):
    if hit_type == "append":
        return history[0] + msg(60) + msg(150)
    if hit_type == "fork":
        return history[0] + msg(40) + msg(120)
    page = _inside_page(served[-1], history[-1])
    if hit_type == "truncate":
        return history[-1][: page * 64 + 17] + msg(100)
    edited = list(history[-1])
    edited[page * 64 + 5] ^= 1
    return edited + msg(100)


def _sink(executor, hit_keys, target, rng, now_s):
    """Serve flood sessions until the checkpoint the hit would use sits in `target`."""
    start = executor.cache.match(hit_keys)
    assert start.num_reused_pages > 0, "history left nothing to reuse"
    for _ in range(MAX_FLOOD_REQUESTS):
        match = executor.cache.match(hit_keys)
        if match.num_reused_pages != start.num_reused_pages:
            pytest.fail(f"checkpoint at page {start.num_reused_pages} was dropped before reaching {target.name}")
        if match.checkpoint_tier == target:
            return now_s
        if match.checkpoint_tier > target:
            pytest.fail(f"checkpoint is already in {match.checkpoint_tier.name}, below {target.name}")
        now_s += 10.0
        executor.serve([rng.randrange(512) for _ in range(520)], now_s)
        executor.check_mirror()
    pytest.fail(f"checkpoint did not reach {target.name} after {MAX_FLOOD_REQUESTS} flood requests")


@pytest.mark.parametrize("target", TIERS, ids=lambda t: t.name)
@pytest.mark.parametrize("hit_type", HIT_TYPES)
def test_hit_served_from_tier_matches_cold_prefill(hit_type, target, runners, cold_runs, tmp_path):
    numerics = "fp64"
    runner = runners(numerics)
    page_bytes = runner.geometry.kv_page_size_bytes
    capacity = {Tier.GPU: 28 * page_bytes, Tier.CPU: 28 * page_bytes}
    if target is Tier.SSD:
        capacity[Tier.SSD] = 400 * page_bytes
    executor = ReferenceExecutor(runner, POLICY_FOR_TIER[target], capacity, open_ssd(str(tmp_path), 400 * page_bytes))
    rng = random.Random(zlib.crc32(f"{hit_type}/{target.name}".encode()))
    def msg(n):
        return [rng.randrange(512) for _ in range(n)]

    history = _history(hit_type, msg)
    now_s, served_history = 0.0, []
    for tokens in history:
        now_s += 1.0
        served_history.append(executor.serve(tokens, now_s))
    hit = _hit(hit_type, history, served_history, msg)
    hit_keys = page_keys(hit[:-1], runner.geometry.page_num_tokens)
    now_s = _sink(executor, hit_keys, target, rng, now_s)

    cold = cold_runs(numerics, hit)
    served = executor.serve(hit, now_s + 1.0, cold.decode_tokens)
    executor.check_mirror()
    executor.cache.check_invariants()
    executor.close()

    assert served.checkpoint_tier == target and served.num_reused_pages > 0
    if hit_type in ("truncate", "rewind-edit"):
        assert served.num_reused_pages < served.num_kv_pages  # the hit lands inside cached KV
    print(f"{hit_type} {target.name}: m={served.num_kv_pages} c={served.num_reused_pages} "
          f"kv@match={ {t.name: n for t, n in served.kv_pages_by_tier_at_match.items()} }")
    diff = max_logit_diff(served, cold)
    assert diff <= TOLERANCE[numerics], f"{hit_type} from {target.name}: max |diff| {diff:.3e}"
