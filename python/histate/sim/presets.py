"""Named workload presets of `histate replay --preset`: how a trace becomes the sessions a replay admits.

A preset fixes the workload side of a comparison (context clip, gap cap, how many sessions and how
they are drawn); the system side (model, GPU, budgets, live sessions) keeps `ReplayConfig`'s paper
defaults. Every value is printed by `--help` and written to summary.json, and any flag overrides
the preset's value for that field. Measurements behind the values: docs/results.md, "Workload
presets".

* `default`: the trace as recorded: the model's native context (`ModelSpec.native_context_num_tokens`,
  262,144 for Qwen3.5-9B), the trace's own think/tool gaps, every session.
* `paper`: the paper's Weka load (§4.1: 3,784 requests from 125 sessions in about 3 h). The paper
  states neither its context clip nor a gap rule, so both are calibrated on the dev traces to its
  numbers: 125 roots drawn from all roots (a root the clip empties takes its slot, as in a replayer
  that picks sessions from the dataset), a 110,000-token clip (10 seeds: 3,658 requests on average;
  a 128,000 clip gives ~4,500 and the native context ~7,700), think/tool gaps capped at 120 s
  (median simulated span 3.05 h, 0.36 requests/s against the paper's 0.35). A gap cap rather than a
  time scale: it keeps every gap below 120 s as recorded (the reuse distance the policies are
  compared on) and only shortens the idle tail.
* `paper-native`: the paper's sampling and gap cap at the model's native context (~7,700 requests,
  with the long-context pressure the paper preset clips away).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


@dataclass(frozen=True)
class WorkloadPreset:
    name: str
    max_context_num_tokens: Optional[int]   # None: the model's native context
    max_gap_s: Optional[float]              # None: the trace's own gaps
    max_sessions: Optional[int]             # None: every root session
    session_sampling: str                   # "all" roots (empty ones take a slot) or "non-empty"

    def describe(self) -> str:
        context = "native" if self.max_context_num_tokens is None else f"{self.max_context_num_tokens:,}"
        gap = "trace timing" if self.max_gap_s is None else f"gaps capped at {self.max_gap_s:g} s"
        sessions = "every session" if self.max_sessions is None else \
            f"{self.max_sessions} sessions drawn from {self.session_sampling} roots"
        return f"{self.name}: max context {context}, {gap}, {sessions}"

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {p.name: p for p in (
    WorkloadPreset("default", max_context_num_tokens=None, max_gap_s=None, max_sessions=None, session_sampling="all"),
    WorkloadPreset("paper", max_context_num_tokens=110_000, max_gap_s=120.0, max_sessions=125, session_sampling="all"),
    WorkloadPreset("paper-native", max_context_num_tokens=None, max_gap_s=120.0, max_sessions=125,
                   session_sampling="all"),
)}
