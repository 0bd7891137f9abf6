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

Bad input on the command line ends like an argparse error: one line, "sglang serve: error: ..."
naming the flag, exit status 2, no traceback. That holds for errors found while parsing
(`from_cli_args`) and, for records that came from the command line, for those found once the
model config is known (`resolve_once`, see plugin.py). On the `Engine(**kwargs)` path the same
errors are raised as `HiStateConfigError` for the caller.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

from .config import (CONFIG_ATTR, OPTIONS, HiStateConfig, HiStateConfigError, cli_dest, cli_values_from_namespace,
                     resolve_config)
from .server_settings import apply_to_record, ignored_settings

logger = logging.getLogger(__name__)

ARG_GROUP_TITLE = "HiState (sglang-histate plugin: hybrid-model prefix cache)"
ERROR_PROG = "sglang serve"
"""The `prog` of SGLang's own argument parser (server_args.py:679), so our errors read like its."""
FROM_CLI_ATTR = "_histate_from_cli"
"""Underscore bookkeeping attribute: this record was parsed from a command line."""


def add_histate_arguments(parser: Any) -> None:
    """Add the HiState argument group; a no-op if the parser already has it."""
    if "--enable-histate" in getattr(parser, "_option_string_actions", {}):
        return
    group = parser.add_argument_group(ARG_GROUP_TITLE)
    for opt in OPTIONS:
        help_text = f"{opt.help} [env: {opt.env}]".replace("%", "%%")  # argparse %-formats help
        if opt.is_switch:
            group.add_argument(opt.flag, dest=cli_dest(opt), action="store_true", default=False,
                               help=help_text)
        else:
            # Choices are checked by our parser (one line naming the flag), not by argparse (which
            # would print SGLang's whole usage first); the metavar still lists them.
            metavar = "{" + ",".join(opt.choices) + "}" if opt.choices else opt.metavar
            group.add_argument(opt.flag, dest=cli_dest(opt), default=None, nargs=opt.nargs,
                               metavar=metavar, help=help_text)


def add_cli_args_after(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    add_histate_arguments(parser)
    return None


WARNED_ATTR = "_histate_warned"
"""Underscore bookkeeping attribute: the warnings about ignored settings were logged for this record."""


def _apply(record: Any, config: HiStateConfig) -> None:
    changes = apply_to_record(record, config)
    if changes:
        logger.info("HiState enabled: %s; SGLang settings implied: %s", config.describe(), changes)
    if config.enable:  # the tokenizer-side check of application-placed checkpoints (checkpoint_hints.py)
        from .checkpoint_hints import install as install_hint_check

        install_hint_check()
    if config.enable and not getattr(record, WARNED_ATTR, False):
        setattr(record, WARNED_ATTR, True)
        for note in ignored_settings(record):
            logger.warning("%s", note)


def exit_with_usage_error(message: str) -> NoReturn:
    """End the process the way argparse ends it on a bad argument: one line, status 2."""
    print(f"{ERROR_PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def report_config_error(record: Any, error: HiStateConfigError) -> NoReturn:
    """A command-line record: one line and exit 2. Otherwise (Engine): raise for the caller."""
    if getattr(record, FROM_CLI_ATTR, False):
        exit_with_usage_error(str(error))
    raise error


def from_cli_args_around(original: Any, cls: Any, args: Any) -> Any:
    try:
        config = resolve_config(cli_values_from_namespace(args), os.environ)
        record = original(cls, args)
        setattr(record, CONFIG_ATTR, config)
        setattr(record, FROM_CLI_ATTR, True)
        _apply(record, config)
    except HiStateConfigError as error:
        exit_with_usage_error(str(error))
    return record


def resolve_once_before(record: Any, *args: Any, **kwargs: Any) -> None:
    if getattr(record, "_resolution_finished", False) or getattr(record, "_resolution_failed", False):
        return None  # a pickled copy in a child process: already resolved in the launcher
    config = getattr(record, CONFIG_ATTR, None)
    if config is None:
        config = resolve_config({}, os.environ)
        setattr(record, CONFIG_ATTR, config)
    try:
        _apply(record, config)
    except HiStateConfigError as error:
        report_config_error(record, error)
    return None


def config_of(server_args: Any) -> HiStateConfig:
    """The stashed config of a (possibly pickled) ServerArgs; env vars if nothing was stashed."""
    config = getattr(server_args, CONFIG_ATTR, None)
    return config if config is not None else resolve_config({}, os.environ)
