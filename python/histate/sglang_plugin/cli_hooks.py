"""HookRegistry hooks on `ServerArgs` that add HiState's flags and apply them before resolution.

Three hooks, all on public `ServerArgs` entry points (research/sglang-0.5.23.md §4.2):
  AFTER  ServerArgs.add_cli_args   adds the "HiState" argparse group (visible in --help);
  AROUND ServerArgs.from_cli_args  builds the `HiStateConfig` (flags > env vars > defaults),
                                   stashes it as `_histate_config` and applies it;
  BEFORE ServerArgs.resolve_once   covers `Engine(**kwargs)`, which never parses argv: reads the
                                   env vars, stashes and applies them. Idempotent on the CLI path.
Applying = rejecting incompatible flags and writing the implied SGLang settings onto the raw
record while it is still input (before `resolve_once` seals it). The stash is an underscore,
non-field attribute, which `ServerArgs.__reduce__` pickles to the spawned scheduler.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from .config import CONFIG_ATTR, OPTIONS, HiStateConfig, cli_dest, cli_values_from_namespace, resolve_config
from .server_settings import apply_to_record

logger = logging.getLogger(__name__)

ARG_GROUP_TITLE = "HiState (sglang-histate plugin: hybrid-model prefix cache)"


def add_histate_arguments(parser: Any) -> None:
    """Add the HiState argument group; a no-op if the parser already has it."""
    if "--enable-histate" in getattr(parser, "_option_string_actions", {}):
        return
    group = parser.add_argument_group(ARG_GROUP_TITLE)
    for opt in OPTIONS:
        help_text = f"{opt.help} [env: {opt.env}]"
        if opt.is_switch:
            group.add_argument(opt.flag, dest=cli_dest(opt), action="store_true", default=False,
                               help=help_text)
        else:
            group.add_argument(opt.flag, dest=cli_dest(opt), default=None, nargs=opt.nargs,
                               metavar=opt.metavar, choices=opt.choices, help=help_text)


def add_cli_args_after(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    add_histate_arguments(parser)
    return None


def _apply(record: Any, config: HiStateConfig) -> None:
    changes = apply_to_record(record, config)
    if changes:
        logger.info("HiState enabled: %s; SGLang settings implied: %s", config.describe(), changes)


def from_cli_args_around(original: Any, cls: Any, args: Any) -> Any:
    config = resolve_config(cli_values_from_namespace(args), os.environ)
    record = original(cls, args)
    setattr(record, CONFIG_ATTR, config)
    _apply(record, config)
    return record


def resolve_once_before(record: Any, *args: Any, **kwargs: Any) -> None:
    if getattr(record, "_resolution_finished", False) or getattr(record, "_resolution_failed", False):
        return None  # a pickled copy in a child process: already resolved in the launcher
    config = getattr(record, CONFIG_ATTR, None)
    if config is None:
        config = resolve_config({}, os.environ)
        setattr(record, CONFIG_ATTR, config)
    _apply(record, config)
    return None


def config_of(server_args: Any) -> HiStateConfig:
    """The stashed config of a (possibly pickled) ServerArgs; env vars if nothing was stashed."""
    config = getattr(server_args, CONFIG_ATTR, None)
    return config if config is not None else resolve_config({}, os.environ)
