"""Synthetic agent workloads: multi-turn sessions with mutation events, seeded and deterministic.

Owns the generator behind the simulator's embedded default workload (`default_workload`) and the
paper's mutation microbenchmark (`mutation_microbenchmark`, paper §4.3). Both produce the same
`Workload` records as the trace loaders.

Context model. Each session has a context stream (tokens; page keys for its full pages). Turn r's
prompt is that stream after the turn's edit plus `append` new tokens; after the turn the output is
appended to the stream. New pages get fresh keys, so requests share exactly the pages of the
stream they have in common (prefix-chained keys). Edits (mutation kinds, chosen per turn r >= 1):

* TRUNCATION: cut the previous prompt at a uniformly chosen *internal* boundary (a multiple of
  `cut_granularity_num_tokens`, strictly inside the prompt), drop the rest (the previous output
  too) and append the new input: shares exactly cut / P pages with the previous request.
  (Paper §4.3: "cuts the preceding prompt at a uniformly sampled internal 256-token boundary and
  appends the next 8K-token input without restoring the discarded suffix".)
* REWIND_EDIT: go back to an earlier turn k (uniform in [0, r - 1]) and edit its appended message:
  cut at a uniform boundary strictly inside that message (or at its start when it holds none),
  append the new input: shares exactly cut / P pages with request k.
* FORK: continue from the end of an earlier turn k (uniform in [0, r - 2]; prompt k plus output k),
  abandoning the turns after it: shares all of request k's pages.
* COMPACTION: replace the context by a summary: keep the system prompt, add
  `compaction_summary_num_tokens` fresh tokens, append the new input: shares exactly
  system_prompt_num_tokens / P pages with every earlier request. A turn whose prompt would exceed
  `max_context_num_tokens` is compacted instead (agents compact near the window).

Randomness: one `random.Random` per session, seeded by (seed, session index) through a string, so
sessions do not depend on how many others are generated. Every turn draws the same seven uniform
variates in the same order whatever the configuration (common random numbers): raising a mutation
rate only turns more of the same turns into mutations, which keeps rate sweeps paired.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import asdict, dataclass
from typing import Optional

from .request import PAGE_NUM_TOKENS, PageKeyAllocator, Request, RequestFlag, Session, Workload, WorkloadStats

MUTATION_KINDS = (RequestFlag.TRUNCATION, RequestFlag.REWIND_EDIT, RequestFlag.FORK, RequestFlag.COMPACTION)


@dataclass(frozen=True)
class AgentWorkloadConfig:
    """Shape of a synthetic agent workload. Token ranges are inclusive uniform ranges."""

    num_sessions: int = 32
    num_turns: int = 12
    system_prompt_num_tokens: int = 4096          # identical in every session (shared prefix)
    first_input_num_tokens: tuple = (4096, 12288)  # first user message, after the system prompt
    append_num_tokens: tuple = (256, 4096)        # new input per later turn (tool result / message)
    output_num_tokens: tuple = (64, 512)
    tool_gap_s: tuple = (1.0, 30.0)               # log-uniform
    human_gap_probability: float = 0.15           # a turn waits for the user instead of a tool
    human_gap_s: tuple = (60.0, 1800.0)           # log-uniform
    session_start_spread_s: float = 60.0          # request 0 arrives uniform in [0, spread) after release
    truncation_rate: float = 0.03
    rewind_edit_rate: float = 0.03
    fork_rate: float = 0.02
    compaction_rate: float = 0.01
    cut_granularity_num_tokens: int = 256
    compaction_summary_num_tokens: int = 2048
    max_context_num_tokens: Optional[int] = 131072
    page_num_tokens: int = PAGE_NUM_TOKENS
    seed: int = 0
    # Each request that carries the whole system prompt names its end as a checkpoint position, as an
    # application using HiState's hints API would (docs/hints.md); the variates are unchanged.
    hint_system_prompt: bool = False

    def __post_init__(self) -> None:
        rates = (self.truncation_rate, self.rewind_edit_rate, self.fork_rate, self.compaction_rate)
        if any(r < 0 for r in rates) or sum(rates) > 1:
            raise ValueError(f"mutation rates must be >= 0 and sum to <= 1, got {rates}")
        if self.cut_granularity_num_tokens % self.page_num_tokens:
            raise ValueError(f"cut_granularity_num_tokens ({self.cut_granularity_num_tokens}) must be a "
                             f"multiple of page_num_tokens ({self.page_num_tokens})")
        if self.system_prompt_num_tokens % self.page_num_tokens:
            raise ValueError("system_prompt_num_tokens must be a multiple of page_num_tokens")
        for name in ("first_input_num_tokens", "append_num_tokens", "output_num_tokens", "tool_gap_s",
                     "human_gap_s"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be a range (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
        if self.num_sessions < 0 or self.num_turns < 1:
            raise ValueError("num_sessions must be >= 0 and num_turns >= 1")
        if self.first_input_num_tokens[0] < 1 or self.append_num_tokens[0] < 1:
            raise ValueError("every prompt must add at least one token")


def default_workload(seed: int = 0) -> Workload:
    """The embedded default (no trace given): 32 sessions x 12 turns, ~400 requests, every mutation kind."""
    return agent_workload(AgentWorkloadConfig(seed=seed), name="synthetic:agent-default")


def demo_workload(seed: int = 0, hint_system_prompt: bool = False, system_prompt_num_tokens: int = 4096) -> Workload:
    """`histate replay`'s embedded workload: 96 sessions x 16 turns with 8-32K-token first prompts and
    0.5-8K-token appends (~1,500 requests, ~72M input tokens), enough that 24 live sessions overflow
    the paper preset's 45 GiB GPU pool, so policies differ. `hint_system_prompt`: requests name the
    system prompt's end as a checkpoint position (`--checkpoint-hints system-prompt`);
    `system_prompt_num_tokens`: its length (`--system-prompt-tokens`)."""
    config = AgentWorkloadConfig(num_sessions=96, num_turns=16, first_input_num_tokens=(8192, 32768),
                                 append_num_tokens=(512, 8192), seed=seed, hint_system_prompt=hint_system_prompt,
                                 system_prompt_num_tokens=system_prompt_num_tokens)
    return agent_workload(config, name="synthetic:agent-demo")


def mutation_microbenchmark(mutation_rate: float, *, num_sessions: int = 48, num_turns: int = 16,
                            turn_input_num_tokens: int = 8192, output_num_tokens: int = 256,
                            gap_s: float = 180.0, cut_granularity_num_tokens: int = 256,
                            seed: int = 0) -> Workload:
    """Paper §4.3: sessions of 16 turns, 8K new input + 256 output tokens per turn, 3-minute gaps;
    each turn after the first is, with probability `mutation_rate`, a TRUNCATION of the preceding
    prompt. The paper replays 24 concurrent sessions for 90 minutes; a session lasts about 48
    minutes, so the default of 48 sessions (two generations of 24 live ones) fills that window;
    the live-session limit is the replay driver's. No shared system prompt, no context limit.
    """
    config = AgentWorkloadConfig(
        num_sessions=num_sessions, num_turns=num_turns, system_prompt_num_tokens=0,
        first_input_num_tokens=(turn_input_num_tokens, turn_input_num_tokens),
        append_num_tokens=(turn_input_num_tokens, turn_input_num_tokens),
        output_num_tokens=(output_num_tokens, output_num_tokens), tool_gap_s=(gap_s, gap_s),
        human_gap_probability=0.0, session_start_spread_s=gap_s, truncation_rate=mutation_rate,
        rewind_edit_rate=0.0, fork_rate=0.0, compaction_rate=0.0,
        cut_granularity_num_tokens=cut_granularity_num_tokens, max_context_num_tokens=None, seed=seed)
    return agent_workload(config, name=f"synthetic:mutation-{mutation_rate:g}")


def agent_workload(config: AgentWorkloadConfig, name: str = "synthetic:agent") -> Workload:
    keys, uids = PageKeyAllocator(), itertools.count()
    system_keys = tuple(keys.fresh(config.system_prompt_num_tokens // config.page_num_tokens))
    stats = WorkloadStats(mutations={kind.name: 0 for kind in MUTATION_KINDS})
    sessions = []
    for index in range(config.num_sessions):
        session = _SessionGenerator(config, index, keys, uids, system_keys, stats).run()
        sessions.append(session)
        stats.sessions += 1
    return Workload(name=name, sessions=sessions, stats=stats, page_num_tokens=config.page_num_tokens,
                    params=asdict(config))


@dataclass(frozen=True, slots=True)
class _Context:
    """An immutable context stream: keys of its full pages and its length in tokens."""

    keys: tuple
    num_tokens: int


@dataclass(frozen=True, slots=True)
class _Turn:
    start: "_Context"        # context before this turn's new input (after its edit)
    prompt: "_Context"
    end: "_Context"          # prompt + output


class _SessionGenerator:
    def __init__(self, config: AgentWorkloadConfig, index: int, keys: PageKeyAllocator, uids,
                 system_keys: tuple, stats: WorkloadStats) -> None:
        self.config, self.index, self.keys, self.uids, self.stats = config, index, keys, uids, stats
        self.page = config.page_num_tokens
        self.system = _Context(system_keys, config.system_prompt_num_tokens)
        self.rng = random.Random(f"histate-agent:{config.seed}:{index}")
        self.session_id = f"agent{index:04d}"

    def extend(self, ctx: _Context, num_tokens: int) -> _Context:
        total = ctx.num_tokens + num_tokens
        new_pages = total // self.page - len(ctx.keys)
        return _Context(ctx.keys + tuple(self.keys.fresh(new_pages)), total)

    def cut(self, ctx: _Context, num_tokens: int) -> _Context:
        return _Context(ctx.keys[:num_tokens // self.page], num_tokens)

    def run(self) -> Session:
        cfg, rng = self.config, self.rng
        turns: list = []
        requests = []
        for r in range(cfg.num_turns):
            # Same variates in the same order every turn (common random numbers across configs).
            u_kind, u_cut, u_target = rng.random(), rng.random(), rng.random()
            append = _uniform_int(rng.random(), *(cfg.first_input_num_tokens if r == 0 else cfg.append_num_tokens))
            output = _uniform_int(rng.random(), *cfg.output_num_tokens)
            human = rng.random() < cfg.human_gap_probability
            u_gap = rng.random()
            start_gap = rng.random() * cfg.session_start_spread_s
            if r == 0:
                kind, start = RequestFlag.NONE, self.system
            else:
                kind = self._pick_kind(u_kind, r, turns)
                start = self._edit(kind, turns, u_cut, u_target)
                if cfg.max_context_num_tokens is not None and (
                        start.num_tokens + append > cfg.max_context_num_tokens):
                    kind = RequestFlag.COMPACTION
                    start = self._edit(kind, turns, u_cut, u_target)
            prompt = self.extend(start, append)
            end = self.extend(prompt, output)
            turns.append(_Turn(start, prompt, end))
            if r == 0:
                gap_s = start_gap
            else:
                lo, hi = cfg.human_gap_s if human else cfg.tool_gap_s
                gap_s = _log_uniform(u_gap, lo, hi)
            flags = RequestFlag.NONE
            if kind:
                flags = kind | RequestFlag.MUTATION
                self.stats.mutations[kind.name] += 1
                if kind is RequestFlag.COMPACTION:
                    self.stats.compactions += 1
            requests.append(Request(
                uid=next(self.uids), session_id=self.session_id, index=r, input_num_tokens=prompt.num_tokens,
                output_num_tokens=output, page_keys=prompt.keys, gap_before_s=gap_s, flags=flags,
                output_page_keys=end.keys[len(prompt.keys):], checkpoint_hint_tokens=self._hints(prompt)))
            self.stats.requests += 1
            self.stats.input_tokens += prompt.num_tokens
            self.stats.output_tokens += output
        return Session(session_id=self.session_id, requests=tuple(requests))

    def _hints(self, prompt: _Context) -> tuple:
        """The system prompt's end, when this prompt carries all of it and more (a truncation may cut
        inside it; an application names only the prefix it knows is stable)."""
        system = self.system
        if not (self.config.hint_system_prompt and system.num_tokens
                and prompt.num_tokens > system.num_tokens and prompt.keys[:len(system.keys)] == system.keys):
            return ()
        return (system.num_tokens,)

    def _pick_kind(self, u: float, r: int, turns: list) -> RequestFlag:
        cfg = self.config
        threshold = 0.0
        for kind, rate in zip(MUTATION_KINDS, (cfg.truncation_rate, cfg.rewind_edit_rate, cfg.fork_rate,
                                               cfg.compaction_rate)):
            threshold += rate
            if u < threshold:
                return kind if self._possible(kind, r, turns) else RequestFlag.NONE
        return RequestFlag.NONE

    def _possible(self, kind: RequestFlag, r: int, turns: list) -> bool:
        g = self.config.cut_granularity_num_tokens
        if kind is RequestFlag.TRUNCATION:
            return turns[-1].prompt.num_tokens > g        # at least one internal boundary
        if kind is RequestFlag.FORK:
            return r >= 2                                  # an earlier turn other than the last
        return True

    def _edit(self, kind: RequestFlag, turns: list, u_cut: float, u_target: float) -> _Context:
        """The context the new input is appended to, after this turn's edit."""
        g = self.config.cut_granularity_num_tokens
        if kind is RequestFlag.NONE:
            return turns[-1].end
        if kind is RequestFlag.TRUNCATION:
            prompt = turns[-1].prompt
            num_boundaries = (prompt.num_tokens - 1) // g           # g, 2g, ... strictly inside
            return self.cut(prompt, g * (1 + int(u_cut * num_boundaries)))
        if kind is RequestFlag.REWIND_EDIT:
            turn = turns[int(u_target * len(turns))]
            lo, hi = turn.start.num_tokens, turn.prompt.num_tokens  # the turn's appended message
            first = lo // g + 1                                     # boundaries b with lo < b < hi
            last = (hi - 1) // g
            if last < first:                                        # message shorter than g: rewind to its start
                return turn.start
            return self.cut(turn.prompt, g * (first + int(u_cut * (last - first + 1))))
        if kind is RequestFlag.FORK:
            return turns[int(u_target * (len(turns) - 1))].end
        summary = self.config.compaction_summary_num_tokens
        return self.extend(self.system, summary)


def _uniform_int(u: float, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi] from one uniform variate (randint's draw count varies)."""
    return lo + min(hi - lo, int(u * (hi - lo + 1)))


def _log_uniform(u: float, lo: float, hi: float) -> float:
    if lo <= 0 or lo == hi:
        return lo + u * (hi - lo)
    return math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))


__all__ = ["AgentWorkloadConfig", "MUTATION_KINDS", "agent_workload", "default_workload",
           "mutation_microbenchmark"]
