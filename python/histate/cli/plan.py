"""From flags to a run: the workload settings (flag, else preset, else the model's context), the
workload itself, the simulator's config, and every input checked before anything runs (shared by
`histate replay` and `histate bench`, so both read the same workload the same way)."""
from __future__ import annotations

from pathlib import Path

from histate.cli.arg_types import NONE
from histate.sim.presets import PRESETS

STDIN = Path("/dev/stdin")  # `--trace -`


def resolve_workload_settings(args, model_name: str) -> dict:
    """The workload settings of this run: each flag given, else the preset's value, else the native
    context of `model_name` (a simulator model spec; raises ValueError naming the flag for combinations
    that would be ignored)."""
    from histate.sim.costs import get_model

    preset = PRESETS[args.preset]
    if args.trace is None:
        ignored = [flag for flag, value in (("--max-context", args.max_context), ("--max-gap", args.max_gap))
                   if value is not None]
        if args.preset != "default":
            ignored.insert(0, f"--preset {args.preset}")
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: applies to --trace only (synthetic workloads set their own)")
    if args.mutation_rate is not None and args.synthetic != "mutation":
        raise ValueError("--mutation-rate: applies to --synthetic mutation only")
    if getattr(args, "checkpoint_hints", "off") != "off" and (args.trace is not None or args.synthetic == "mutation"):
        raise ValueError(f"--checkpoint-hints {args.checkpoint_hints}: applies to the synthetic agent workload only "
                         "(traces carry no application positions; the mutation workload has no system prompt)")
    system = getattr(args, "system_prompt_tokens", None)
    if system is not None and (args.trace is not None or args.synthetic == "mutation"):
        raise ValueError("--system-prompt-tokens: applies to the synthetic agent workload only")
    if system is not None and system % 64:
        raise ValueError(f"--system-prompt-tokens {system}: must be a multiple of the 64-token page")

    def pick(flag_value, preset_value):
        value = preset_value if flag_value is None else flag_value
        return None if value == NONE else value

    max_context = pick(args.max_context, preset.max_context_num_tokens)
    if max_context is None and args.trace is not None:
        max_context = get_model(model_name).native_context_num_tokens
    return {
        "preset": preset.name,
        "max_context_num_tokens": max_context,  # None: a synthetic workload, which sets its own
        "max_gap_s": pick(args.max_gap, preset.max_gap_s),
        "max_sessions": pick(args.max_sessions, preset.max_sessions),
        "session_sampling": pick(args.session_sampling, preset.session_sampling),
        "stagger_s": args.stagger,
    }


def load_workload(args, settings: dict):
    from histate.sim.traces import LoadOptions, load_trace
    from histate.sim.workloads import demo_workload, mutation_microbenchmark

    if args.synthetic == "mutation":
        rate = 0.05 if args.mutation_rate is None else args.mutation_rate
        return mutation_microbenchmark(rate, seed=args.seed)
    trace = args.trace
    if trace is None:
        return demo_workload(seed=args.seed, hint_system_prompt=getattr(args, "checkpoint_hints", "off") != "off",
                             system_prompt_num_tokens=getattr(args, "system_prompt_tokens", None) or 4096)
    if str(trace) == "-":
        trace = STDIN  # the loaders read pipes as they come (histate.sim.traces)
    if not trace.exists():
        raise FileNotFoundError(f"--trace {trace}: no such file or directory")
    options = LoadOptions(max_context_num_tokens=settings["max_context_num_tokens"], max_gap_s=settings["max_gap_s"],
                          progress=not args.no_progress)
    return load_trace(trace, args.format, options)


def build_config(args, settings: dict, page_num_tokens: int):
    from dataclasses import replace

    from histate.core import ShortPrefillFirst
    from histate.sim.costs import CalibratedStepCost, PrefillProfile, get_hardware, get_model
    from histate.sim.replay import ReplayConfig

    model, hardware = get_model(args.model), get_hardware(args.hardware)  # unknown names fail here
    config = ReplayConfig(model=args.model, hardware=args.hardware, gpu_cache_bytes=args.gpu_gib,
                          cpu_cache_bytes=args.cpu_gib, ssd_cache_bytes=args.ssd_gib,
                          max_live_sessions=args.max_live_sessions, max_sessions=settings["max_sessions"],
                          session_sampling=settings["session_sampling"], stagger_s=settings["stagger_s"],
                          seed=args.seed, tau_s=args.tau, intervals_pages=args.intervals, engine_name=args.engine,
                          tool_wait=getattr(args, "tool_wait_prefetch", "off") == "on")
    if args.h2d_gbps is not None or args.ssd_gbps is not None:
        config = replace(config, hardware_spec=hardware.with_links(h2d_gb_s=args.h2d_gbps, ssd_gb_s=args.ssd_gbps))
    if getattr(args, "chunked_prefill_size", None) is not None:
        config = replace(config, engine=replace(config.engine, token_budget_per_step=args.chunked_prefill_size))
    if getattr(args, "enable_mixed_chunk", False):
        config = replace(config, engine=replace(config.engine, sglang_mixed_chunk=True))
    if getattr(args, "long_prefill_token_threshold", 0):
        config = replace(config, engine=replace(config.engine, long_prefill_token_threshold=args.long_prefill_token_threshold))
    if getattr(args, "short_prefill_first", None) is not None:
        rule = ShortPrefillFirst(max_yields=args.short_prefill_first)
        config = replace(config, engine=replace(config.engine, short_prefill_first=rule))
    if args.calibration:
        profile = PrefillProfile.from_csv(args.calibration)
        config = replace(config, step_cost=CalibratedStepCost(model, config.resolved_hardware(), profile))
    config.cache_config(page_num_tokens)  # validates the budgets and knobs (ConfigError names the field)
    return config


def plan_replay(args) -> tuple:
    """(settings, workload, config, admitted roots, roots drawn but emptied by the clip): everything
    a replay needs, with every input checked, before any policy runs. Raises ValueError / OSError
    with a one-line message naming the flag or file:line:field."""
    from histate.bench.scaling import scale_workload
    from histate.sim.replay import admission_order, sampled_roots
    from histate.sim.report import check_writable

    settings = resolve_workload_settings(args, args.model)
    check_writable(args.out)
    workload = scale_workload(load_workload(args, settings), args.token_scale)  # as bench scales it
    config = build_config(args, settings, workload.page_num_tokens)
    drawn, admitted = sampled_roots(workload, config), admission_order(workload, config)
    if not any(s.requests for root in admitted for s in root.iter_sessions()):
        raise ValueError(nothing_to_run(workload, settings, "replay"))
    return settings, workload, config, admitted, len(drawn) - len(admitted)


def nothing_to_run(workload, settings: dict, verb: str) -> str:
    """Why a workload has no request to run, for the one-line error."""
    over = workload.stats.requests_over_context
    if over:
        return (f"no requests to {verb}: {over:,} dropped by the max context of "
                f"{settings['max_context_num_tokens']:,} tokens (--max-context)")
    return f"no requests to {verb}: the workload has none (an empty trace?)"


def settings_record(args, settings: dict, workload, config, admitted: list, num_drawn_empty: int) -> dict:
    """summary.json's "settings": every value the run used, preset or flag, workload and system."""
    from dataclasses import asdict

    system = {k: v for k, v in asdict(config).items() if k not in ("engine", "step_cost", "hardware_spec")}
    return {**settings, "token_scale": args.token_scale, "seed": args.seed,
            "trace": str(args.trace) if args.trace else None,
            "format": args.format if args.trace else None, "workload": workload.name,
            "admitted_sessions": len(admitted), "drawn_empty_sessions": num_drawn_empty,
            "admitted_requests": sum(len(s.requests) for root in admitted for s in root.iter_sessions()),
            **system, "hardware_spec": asdict(config.resolved_hardware()), "engine": asdict(config.engine),
            "calibration": str(args.calibration) if args.calibration else None}
