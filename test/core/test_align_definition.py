"""One definition of vLLM's align mode (issue 28, item 4; core/policies/base.py `align_mode`).

By hand, on one request: prefill passes ending at pages 10, 20 and 25 (the prompt's last block
boundary), a 9-page vLLM block (576 tokens), a branch point at page 4, output reaching page 40:
  * align mode (vllm-marconi / -cpu / -disk): every pass end 10, 20, 25 and every block boundary the
    output crossed, 27 and 36; plus Marconi's branch point 4;
  * histate-align: the prompt half of the same rule, 10, 20, 25 (decode states stay the engine's: the
    last 64-token grid position of the output, page 40);
  * vllm-disk-turns (Marconi's turn boundaries): the prompt's end 25, the branch point 4, and the last
    block boundary of the output, 36; no interior pass end, no other crossing."""
from __future__ import annotations

from histate.core import make_policy
from histate.core.policies.base import AdmissionContext

from .helpers import tiny_config


def _ctx(config):
    return AdmissionContext(start_pages=2, kv_match_pages=4, end_pages=25, controller=None, config=config,
                            step_end_pages=(10, 20, 25), output_end_pages=40)


def test_every_align_policy_reads_the_same_rule():
    config = tiny_config(gpu_pages=64, block_pages=9)
    ctx = _ctx(config)
    for name in ("vllm-marconi", "vllm-cpu", "vllm-disk"):
        assert sorted(make_policy(name).admit(ctx)) == [4, 10, 20, 25, 27, 36], name
    assert sorted(make_policy("histate-align").prompt_states(ctx)) == [10, 20, 25]
    assert sorted(make_policy("histate-align").admit(ctx)) == [10, 20, 25, 40]
    assert sorted(make_policy("vllm-disk-turns").admit(ctx)) == [4, 25, 36]
