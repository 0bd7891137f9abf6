"""HiState's launch settings for SGLang: one frozen record, read from CLI flags or env vars.

Owns the flag/env-var table (`OPTIONS`), parsing of sizes and interval lists, and validation
with messages that name the flag. Pure Python (no sglang import) so it is cheap to import in
every SGLang process and trivially picklable: the record rides on `ServerArgs` as the
underscore attribute `_histate_config` from the launcher to the scheduler (spawned) processes.

Precedence, per option: CLI flag > environment variable > default. The env vars exist for the
`sglang.Engine(**kwargs)` path, which has no argparse namespace and rejects unknown kwargs.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

# Defaults and the state grid have one home, histate.core.config (read by the CLI, ReplayConfig and here).
from histate.core import (DEFAULT_INTERVALS_TOKENS, DEFAULT_MAX_YIELDS, DEFAULT_RESTORE_COST_TOKENS, DEFAULT_TAU_S,
                          STATE_GRID_TOKENS, Tier)

CONFIG_ATTR = "_histate_config"
"""Name of the underscore bookkeeping attribute on ServerArgs (pickled with the record)."""

DEVICE_POOL_CHOICES = ("unified", "static")
SSD_BACKEND_CHOICES = ("auto", "nixl", "file")
CHUNK_ALIGN_CHOICES = ("grid", "off")
L3_CHOICES = ("off", "mooncake")


class HiStateConfigError(ValueError):
    """A HiState flag or env var has an invalid value or conflicts with another SGLang flag."""


_SIZE_UNITS = {
    "": 10**9,  # a bare number is GB, like SGLang's --hicache-size
    "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
    "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}


def parse_size_bytes(text: str, *, option: str) -> int:
    """'150GiB' -> bytes. A bare number means GB (10^9), matching `--hicache-size`."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise HiStateConfigError(
            f"{option}: cannot parse size {text!r}; use e.g. 150GiB, 200GB or 200 (= GB)"
        )
    size_bytes = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size_bytes < 0:
        raise HiStateConfigError(f"{option}: size must be >= 0, got {text!r}")
    return size_bytes


def parse_intervals_tokens(text: Any, *, option: str) -> tuple[int, ...]:
    """'1024,2048 4096' (or a list) -> sorted unique token counts, each a multiple of 64."""
    items = text if isinstance(text, (list, tuple)) else [text]
    values: set[int] = set()
    for item in items:
        for part in re.split(r"[,\s]+", str(item).strip()):
            if not part:
                continue
            try:
                value = int(part)
            except ValueError:
                raise HiStateConfigError(f"{option}: {part!r} is not an integer token count") from None
            if value <= 0 or value % STATE_GRID_TOKENS:
                raise HiStateConfigError(
                    f"{option}: interval {value} must be a positive multiple of "
                    f"{STATE_GRID_TOKENS} tokens (the recurrent-state grid)"
                )
            values.add(value)
    if not values:
        raise HiStateConfigError(f"{option}: needs at least one interval")
    return tuple(sorted(values))


MIN_SSD_SIZE_BYTES = 64 * 2**20
"""Smallest non-zero SSD budget per rank: one recurrent checkpoint of the reference model
(Qwen3.5-9B, FP32 states: ~49 MiB) plus its header must fit, or every state write would fail."""


def parse_ssd_size_bytes(text: Any, *, option: str) -> int:
    """--histate-ssd-size: 0 (= sized from free space) or at least MIN_SSD_SIZE_BYTES per rank."""
    size_bytes = parse_size_bytes(text, option=option)
    if size_bytes == 0 and float(re.sub(r"[^0-9.]", "", str(text)) or 0) > 0:
        raise HiStateConfigError(f"{option}: {text!r} rounds to 0 bytes (0 would mean 'sized from free space'); "
                                 f"give at least {MIN_SSD_SIZE_BYTES // 2**20}MiB")
    if 0 < size_bytes < MIN_SSD_SIZE_BYTES:
        raise HiStateConfigError(f"{option}: {text!r} = {size_bytes} bytes is below the minimum of "
                                 f"{MIN_SSD_SIZE_BYTES // 2**20}MiB per rank (one checkpoint must fit); "
                                 f"give 0 for 'sized from free space'")
    return size_bytes


def parse_dirs(text: Any, *, option: str) -> tuple[str, ...]:
    """Directories from a list (CLI nargs) or a comma-separated env string. An empty entry, or one with
    ':' (a PATH-style list is not how this option is written), is an error, never silently dropped."""
    items = list(text) if isinstance(text, (list, tuple)) else str(text).split(",")
    dirs = []
    for item in items:
        entry = str(item).strip()
        if not entry:
            raise HiStateConfigError(f"{option}: empty directory in {items!r} (separate directories with commas "
                                     f"in the env var, spaces on the command line)")
        if ":" in entry:
            raise HiStateConfigError(f"{option}: {entry!r} contains ':'; list directories separated by commas "
                                     f"(a directory name with ':' is not supported)")
        dirs.append(os.path.abspath(os.path.expanduser(entry)))
    if len(set(dirs)) != len(dirs):
        raise HiStateConfigError(f"{option}: directory listed twice in {dirs}")
    return tuple(dirs)


def _section_dirs(value: Any, *, option: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, str) for d in value):
        raise HiStateConfigError(f"{option}: ssd_dirs must be a list of directory names, got {value!r}")
    return list(parse_dirs(value, option=f"{option}: ssd_dirs"))


def _section_size(value: Any, *, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HiStateConfigError(f"{option}: ssd_size_bytes must be an integer >= 0, got {value!r}")
    return value


def _section_backend(value: Any, *, option: str) -> str:
    if value not in SSD_BACKEND_CHOICES:
        raise HiStateConfigError(f"{option}: io_backend must be one of {', '.join(SSD_BACKEND_CHOICES)}, "
                                 f"got {value!r}")
    return value


def _section_l3(value: Any, *, option: str) -> str:
    if value not in L3_CHOICES:
        raise HiStateConfigError(f"{option}: l3 must be one of {', '.join(L3_CHOICES)}, got {value!r}")
    return value


def _section_positive_int(name: str) -> Callable[..., int]:
    def parse(value: Any, *, option: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HiStateConfigError(f"{option}: {name} must be an integer >= 1, got {value!r}")
        return value

    return parse


def _section_flag(name: str) -> Callable[..., bool]:
    def parse(value: Any, *, option: str) -> bool:
        if not isinstance(value, bool):
            raise HiStateConfigError(f"{option}: {name} must be true or false, got {value!r}")
        return value

    return parse


_SECTION_FIELDS: dict[str, Callable[..., Any]] = {
    "ssd_dirs": _section_dirs, "ssd_size_bytes": _section_size, "io_backend": _section_backend,
    "l3": _section_l3, "l3_budget_bytes": _section_positive_int("l3_budget_bytes"),
    "l3_servers": _section_positive_int("l3_servers"), "l3_require_digests": _section_flag("l3_require_digests"),
}


def parse_storage_section(section: Any, *, option: str) -> dict:
    """The `histate` section of the HiCache storage extra config, checked field by field (one clear error
    naming the field, never a TypeError from deep inside the backend)."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise HiStateConfigError(f"{option}: 'histate' must be an object with {', '.join(_SECTION_FIELDS)}, "
                                 f"got {type(section).__name__}")
    unknown = sorted(set(section) - set(_SECTION_FIELDS))
    if unknown:
        raise HiStateConfigError(f"{option}: unknown key(s) {unknown} in 'histate' "
                                 f"(known: {', '.join(_SECTION_FIELDS)})")
    return {key: _SECTION_FIELDS[key](value, option=option) for key, value in section.items()}


def _parse_bool(text: Any, *, option: str) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise HiStateConfigError(f"{option}: expected a boolean (1/0, true/false), got {text!r}")


def _parse_float(text: Any, *, option: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise HiStateConfigError(f"{option}: expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise HiStateConfigError(f"{option}: must be a finite number >= 0, got {text!r}")
    return value


def _parse_count(text: Any, *, option: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise HiStateConfigError(f"{option}: expected an integer, got {text!r}") from None
    if value < 0:
        raise HiStateConfigError(f"{option}: must be >= 0, got {value}")
    return value


def _parse_positive_count(text: Any, *, option: str) -> int:
    value = _parse_count(text, option=option)
    if value < 1:
        raise HiStateConfigError(f"{option}: must be >= 1 (0 would never let a short prefill go first; "
                                 f"leave --histate-short-prefill-first off instead), got {value}")
    return value


def parse_l3_budget_bytes(text: Any, *, option: str) -> int:
    """--histate-l3-budget-gb: the fleet's L3 budget in GB (10^9 bytes, as --hicache-size), > 0."""
    try:
        value_gb = float(text)
    except (TypeError, ValueError):
        raise HiStateConfigError(f"{option}: expected a number of GB, got {text!r}") from None
    budget_bytes = int(value_gb * 10**9) if math.isfinite(value_gb) else 0
    if budget_bytes < 1:
        raise HiStateConfigError(f"{option}: must be a finite number of GB > 0 (leave it out for no deletes), "
                                 f"got {text!r}")
    return budget_bytes


def _parse_l3_servers(text: Any, *, option: str) -> int:
    value = _parse_count(text, option=option)
    if value < 1:
        raise HiStateConfigError(f"{option}: must be >= 1 (the number of servers sharing the L3 store), got {value}")
    return value


def parse_restore_costs(text: Any, *, option: str) -> tuple[float, float]:
    """'0.0134,0.186' (or two CLI values) -> (host, SSD) restore costs in recompute-tokens per KV token."""
    items = text if isinstance(text, (list, tuple)) else re.split(r"[,\s]+", str(text).strip())
    items = [item for item in items if str(item).strip()]
    if len(items) != 2:
        raise HiStateConfigError(f"{option}: give two numbers, the host and the SSD restore cost, got {text!r}")
    host, ssd = (_parse_float(item, option=option) for item in items)
    return host, ssd


TOOL_WAIT_CHOICES = ("on", "off")


def _choice(choices: tuple[str, ...]) -> Callable[..., str]:
    def parse(text: Any, *, option: str) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise HiStateConfigError(f"{option}: {text!r} is not one of {', '.join(choices)}")
        return value

    return parse


@dataclass(frozen=True)
class Option:
    """One user-facing setting: its flag, env var, parser and help text (docs are generated from it)."""

    field: str
    flag: str
    env: str
    parse: Callable[..., Any]
    help: str
    metavar: Optional[str] = None
    nargs: Optional[str] = None
    is_switch: bool = False
    choices: Optional[tuple[str, ...]] = None


OPTIONS: tuple[Option, ...] = (
    Option("enable", "--enable-histate", "HISTATE_ENABLE", _parse_bool, is_switch=True,
           help="Turn HiState on: radix backend 'histate', hierarchical cache, HiState's host sizing "
                "and SSD checkpoint store. Hybrid attention + Gated-DeltaNet models only (Qwen3-Next / Qwen3.5 "
                "family; other hybrids are refused at start). HiState's ranking (eq. 7, H = t_last + tau * C / "
                "M, see --histate-tau) is the eviction policy on device, host and SSD: it replaces "
                "--radix-eviction-policy (a value other than lru is refused)."),
    Option("ssd_dirs", "--histate-ssd-dir", "HISTATE_SSD_DIR", parse_dirs, nargs="+", metavar="DIR",
           help="One or more directories for the SSD tier (historical checkpoints, cold KV pages). "
                "Env: comma-separated. Each rank stores in its own subdirectory; nothing else in DIR "
                "is touched. Without it HiState runs on device + host memory only."),
    Option("ssd_size_bytes", "--histate-ssd-size", "HISTATE_SSD_SIZE", parse_ssd_size_bytes, metavar="SIZE",
           help="SSD budget of each rank across its directories, e.g. 150GiB (a bare number is GB; like "
                "SGLang's file backend max_size, it is per rank); at least 64MiB. "
                "0 = 90 percent of the free space, split between the TP x PP ranks."),
    Option("intervals_tokens", "--histate-intervals", "HISTATE_INTERVALS", parse_intervals_tokens,
           nargs="+", metavar="TOKENS",
           help="Supported checkpoint intervals in tokens (multiples of 64), e.g. 1024,2048,4096. "
                "Adaptive interval control picks one per new segment (paper eq. 5). "
                "Default: 128 ... 32768 in powers of two; defaults off this server's state grid "
                "(lcm of the page size and the model's state chunk) are left out."),
    Option("tau_s", "--histate-tau", "HISTATE_TAU", _parse_float, metavar="SECONDS",
           help="Time scale of unified eviction, H = t_last + tau * C / M (paper eq. 7), in seconds: how "
                "much a unit's recompute cost C per reclaimed byte M outweighs its recency t_last. This "
                "ranking is HiState's eviction policy (it replaces --radix-eviction-policy)."),
    Option("host_state_slots", "--histate-host-state-slots", "HISTATE_HOST_STATE_SLOTS", _parse_count,
           metavar="N",
           help="Host (DRAM) staging slots for recurrent states; the rest of the host budget goes "
                "to KV. 0 = auto (2 per running request, at least 16)."),
    Option("device_pool", "--histate-device-pool", "HISTATE_DEVICE_POOL", _choice(DEVICE_POOL_CHOICES),
           choices=DEVICE_POOL_CHOICES,
           help="'unified' (default): KV and states share one device byte budget "
                "(--enable-unified-memory). 'static': keep SGLang's --mamba-full-memory-ratio split."),
    Option("ssd_backend", "--histate-ssd-backend", "HISTATE_SSD_BACKEND", _choice(SSD_BACKEND_CHOICES),
           choices=SSD_BACKEND_CHOICES,
           help="SSD I/O engine: 'nixl' (NIXL POSIX), 'file' (plain files, same format) or 'auto'."),
    Option("l3", "--histate-l3", "HISTATE_L3", _choice(L3_CHOICES), choices=L3_CHOICES,
           help="Shared L3 under the SSD tier: 'mooncake' reads pages and states the SSD lacks from a "
                "Mooncake Store shared with other servers, and writes what HiState backs up to it too, "
                "with SGLang's own MooncakeStore (stock keys and bytes: stock SGLang servers on the same "
                "store read them). The master comes from SGLang's Mooncake configuration: "
                "--hicache-storage-backend-extra-config keys (master_server_address, ...), "
                "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, or MOONCAKE_MASTER / MOONCAKE_CLIENT. Needs "
                "--histate-ssd-dir. 'off' (default): no L3."),
    Option("l3_budget_bytes", "--histate-l3-budget-gb", "HISTATE_L3_BUDGET_GB", parse_l3_budget_bytes, metavar="GB",
           help="The fleet's L3 budget in GB (e.g. 0.85 x the store's total segment size, below the master's "
                "eviction high watermark). With --histate-l3-servers N each server keeps the L3 bundles it "
                "wrote or read within GB / N, deleting its lowest-ranked ones (eq. 7, core/l3_ledger.py) so "
                "the master's per-object LRU rarely fires. Default: no deletes (the master's LRU alone): the "
                "share needs the fleet's size, which one server cannot know."),
    Option("l3_servers", "--histate-l3-servers", "HISTATE_L3_SERVERS", _parse_l3_servers, metavar="N",
           help="Number of servers sharing the L3 store (with --histate-l3-budget-gb)."),
    Option("l3_require_digests", "--histate-l3-require-digests", "HISTATE_L3_REQUIRE_DIGESTS", _parse_bool,
           is_switch=True,
           help="A HiState-only fleet: an L3 object without HiState's digest (histate/l3/digests.py) is a "
                "miss. Default off: objects a stock SGLang server wrote (no digest) are used unverified."),
    Option("chunk_align", "--histate-chunk-align", "HISTATE_CHUNK_ALIGN", _choice(CHUNK_ALIGN_CHOICES),
           choices=CHUNK_ALIGN_CHOICES,
           help="Chunked-prefill cuts: 'grid' (default) floors each cut to the 64-token state grid, so "
                "every later pass captures its planned checkpoints (no pass is added); 'off' keeps "
                "SGLang's cuts, and planned checkpoints after an off-grid cut are dropped."),
    Option("restore_costs", "--histate-restore-cost", "HISTATE_RESTORE_COST", parse_restore_costs,
           nargs="+", metavar="COST",
           help="Eq. 7's charge for a unit moved down a tier instead of dropped: restoring one token of "
                "KV from host DRAM and from SSD, in tokens of prefill (e.g. 0.0134 0.186, the default: "
                "Qwen3.5-9B on an H100). Restore seconds per KV token / prefill seconds per token."),
    Option("short_prefill_first", "--histate-short-prefill-first", "HISTATE_SHORT_PREFILL_FIRST", _parse_bool,
           is_switch=True,
           help="While a long prompt is prefilled chunk by chunk, let waiting short prefills (work after "
                "HiState's match across device, host and SSD, plus restore cost) take their tokens of the "
                "pass first and the long one the rest, with aging: the long one yields on at most "
                "--histate-short-prefill-max-yields passes in a row, then runs one pass uncapped. Works with "
                "every --schedule-policy (the queue order stays the policy's); under shortest-prefill-first "
                "it replaces SGLang's unbounded chunk cap (shortest_prefill_chunk_limit)."),
    Option("short_prefill_max_yields", "--histate-short-prefill-max-yields", "HISTATE_SHORT_PREFILL_MAX_YIELDS",
           _parse_positive_count, metavar="N",
           help=f"With --histate-short-prefill-first: passes in a row a long prefill may give to short "
                f"ones before it runs one pass uncapped (default {DEFAULT_MAX_YIELDS}); its own prefill then "
                f"takes at most N+1 times its unshared number of passes."),
    Option("tool_wait_prefetch", "--histate-tool-wait-prefetch", "HISTATE_TOOL_WAIT_PREFETCH",
           _choice(TOOL_WAIT_CHOICES), choices=TOOL_WAIT_CHOICES,
           help="Tool-wait residency ('on'; default 'off'): a finished request's path is kept, ranked after "
                "everything unheld, until its next turn is likely not coming (a wait longer than 99 in 100 of the "
                "waits seen between a turn's end and the request that continues it, or twice its own "
                "longest). Turns are recognised by prefix, no client sessions needed (docs/tool_wait.md). "
                "Staging from SSD during the wait is not built yet: only the residency half is."),
    Option("miss_reasons", "--histate-miss-reasons", "HISTATE_MISS_REASONS", _parse_bool, is_switch=True,
           help="Say why each request's uncached prompt tokens missed: no_prefix, kv_evicted, state_evicted, "
                "no_checkpoint, not_restored, page_boundary (docs/misses.md). Adds meta_info['histate_miss'] "
                "to every response and sglang:histate_miss_tokens_total{reason} to /metrics. Costs a prefix "
                "hash of each prompt and of each evicted node (numpy) and a bounded record of departures."),
)
OPTIONS_BY_FIELD = {o.field: o for o in OPTIONS}


@dataclass(frozen=True)
class HiStateConfig:
    """Resolved HiState settings; every field carries its unit."""

    enable: bool = False
    ssd_dirs: tuple[str, ...] = ()
    ssd_size_bytes: int = 0
    intervals_tokens: tuple[int, ...] = DEFAULT_INTERVALS_TOKENS
    tau_s: float = DEFAULT_TAU_S
    host_state_slots: int = 0
    device_pool: str = "unified"
    ssd_backend: str = "auto"
    chunk_align: str = "grid"
    l3: str = "off"
    l3_budget_bytes: int = 0
    """The fleet's L3 budget (0: no deletes, the master's LRU alone)."""
    l3_servers: int = 0
    """Servers sharing the L3 store (0: not given)."""
    l3_require_digests: bool = False
    restore_costs: tuple[float, float] = (DEFAULT_RESTORE_COST_TOKENS[Tier.CPU], DEFAULT_RESTORE_COST_TOKENS[Tier.SSD])
    short_prefill_first: bool = False
    short_prefill_max_yields: int = DEFAULT_MAX_YIELDS
    tool_wait_prefetch: str = "off"
    miss_reasons: bool = False
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    """field -> 'cli' | 'env' | 'default': where each value came from (for logs and errors)."""

    @property
    def has_ssd(self) -> bool:
        return bool(self.ssd_dirs)

    def intervals_pages(self, grid_tokens: int) -> tuple[int, ...]:
        """Intervals in units of the state grid (`grid_tokens` = lcm(page size, the model's
        state chunk): where SGLang can keep a checkpoint). Default intervals off the grid are
        dropped (a 256-token page has no 128-token checkpoints); an interval the user gave off
        the grid is an error naming the flag or env var that gave it."""
        off_grid = [i for i in self.intervals_tokens if i % grid_tokens]
        source = self.sources.get("intervals_tokens", "default")
        option = OPTIONS_BY_FIELD["intervals_tokens"]
        name = {"cli": option.flag, "env": option.env}.get(source)
        if off_grid and name is not None:
            raise HiStateConfigError(
                f"{name}: {off_grid} are not multiples of this server's {grid_tokens}-token state grid "
                f"(lcm of --page-size and the model's state chunk); use multiples of {grid_tokens}")
        on_grid = tuple(i // grid_tokens for i in self.intervals_tokens if i % grid_tokens == 0)
        if not on_grid:
            raise HiStateConfigError(
                f"{option.flag}: no default interval is a multiple of this server's {grid_tokens}-token "
                f"state grid; give {option.flag} with multiples of {grid_tokens}")
        return on_grid

    def describe(self) -> str:
        parts = [f"{f}={getattr(self, f)!r}({self.sources.get(f, 'default')})" for f in OPTIONS_BY_FIELD]
        return "HiStateConfig(" + ", ".join(parts) + ")"


def resolve_config(
    cli_values: Optional[Mapping[str, Any]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> HiStateConfig:
    """Build the record from CLI values (None = flag not given) over env vars over defaults."""
    cli_values = cli_values or {}
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        raw = cli_values.get(opt.field)
        if opt.is_switch and raw is False:
            raw = None  # store_true default: absent, let the env var decide
        if raw is not None:
            values[opt.field] = opt.parse(raw, option=opt.flag)
            sources[opt.field] = "cli"
        elif environ.get(opt.env, "").strip():
            values[opt.field] = opt.parse(environ[opt.env], option=opt.env)
            sources[opt.field] = "env"
        else:
            sources[opt.field] = "default"
    config = HiStateConfig(**values, sources=sources)
    given = [opt.flag for opt in OPTIONS if sources[opt.field] == "cli" and opt.field != "enable"]
    if given and not config.enable:
        raise HiStateConfigError(f"{given[0]} needs --enable-histate (HiState is off)")
    if sources["short_prefill_max_yields"] == "cli" and not config.short_prefill_first:
        raise HiStateConfigError("--histate-short-prefill-max-yields needs --histate-short-prefill-first")
    if config.ssd_size_bytes and not config.ssd_dirs:
        raise HiStateConfigError("--histate-ssd-size needs --histate-ssd-dir (no SSD directory given)")
    if config.l3 != "off" and not config.ssd_dirs:
        raise HiStateConfigError("--histate-l3 needs --histate-ssd-dir: the L3 tier sits under HiState's SSD "
                                 "backend (no SSD directory given)")
    for name in ("l3_budget_bytes", "l3_servers", "l3_require_digests"):
        if sources[name] != "default" and config.l3 == "off":
            opt = OPTIONS_BY_FIELD[name]
            raise HiStateConfigError(f"{opt.flag if sources[name] == 'cli' else opt.env} needs --histate-l3 mooncake")
    if bool(config.l3_budget_bytes) != bool(config.l3_servers):
        given, missing = (("l3_budget_bytes", "l3_servers") if config.l3_budget_bytes
                          else ("l3_servers", "l3_budget_bytes"))
        raise HiStateConfigError(f"{OPTIONS_BY_FIELD[given].flag} needs {OPTIONS_BY_FIELD[missing].flag} "
                                 f"(a server's share is the fleet budget / the number of servers)")
    return config


def cli_dest(opt: Option) -> str:
    """argparse destination of an option: the flag without dashes, '-' -> '_'."""
    return opt.flag.lstrip("-").replace("-", "_")


def cli_values_from_namespace(namespace: Any) -> dict[str, Any]:
    """Our options as given on an argparse namespace (missing attributes count as not given)."""
    return {opt.field: getattr(namespace, cli_dest(opt), None) for opt in OPTIONS}
