"""Trace loaders: Weka Claude Code sessions, TraceLab rounds, Mooncake requests -> `Workload`.

Every loader streams its input (orjson, gzip detected by magic bytes), builds prefix-chained page
keys (`histate.sim.request`), applies the shared max-context clipping rule (`LoadOptions`) and
counts whatever it drops in `Workload.stats`. Malformed input raises `TraceFormatError` naming the
file, line and field.
"""
from ._source import DEFAULT_MAX_CONTEXT_NUM_TOKENS, MAX_INPUT_NUM_TOKENS, LoadOptions, TraceFormatError
from .mooncake import load_mooncake
from .tracelab import load_tracelab
from .weka import iter_weka_sessions, load_weka

__all__ = [
    "DEFAULT_MAX_CONTEXT_NUM_TOKENS", "MAX_INPUT_NUM_TOKENS", "LoadOptions", "TraceFormatError", "iter_weka_sessions",
    "load_mooncake", "load_trace", "load_tracelab", "load_weka",
]


def load_trace(path, fmt: str = "weka", options: LoadOptions = LoadOptions(), **kwargs):
    """Load `path` with the loader for `fmt` ("weka", "tracelab" or "mooncake")."""
    loaders = {"weka": load_weka, "tracelab": load_tracelab, "mooncake": load_mooncake}
    if fmt not in loaders:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {sorted(loaders)}")
    return loaders[fmt](path, options, **kwargs)
