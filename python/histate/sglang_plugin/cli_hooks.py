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

On a SGLang with plugin-declared arguments (upstream/series 0003, `sglang.srt.arg_groups.plugin_args`)
none of the three hooks is installed: `plugin_args_spec()` declares the same group, parser and
`_apply` to SGLang, which adds, parses, applies and stashes them itself (same flags, same errors).
"""
from __future__ import annotations

import logging
import os
import sys
from types import ModuleType
from typing import Any, NoReturn, Optional

from .config import (CONFIG_ATTR, OPTIONS, HiStateConfig, HiStateConfigError, cli_dest, cli_values_from_namespace,
                     resolve_config)
from .server_settings import apply_to_record, ignored_settings
from .write_policy import record_when_given, stash_choice

logger = logging.getLogger(__name__)

ARG_GROUP_TITLE = "HiState (sglang-histate plugin: hybrid-model prefix cache)"
ERROR_PROG = "sglang serve"
"""The `prog` of SGLang's own argument parser (server_args.py:679), so our errors read like its."""
FROM_CLI_ATTR = "_histate_from_cli"
"""Underscore bookkeeping attribute: this record was parsed from a command line."""


PLUGIN_ARGS_NAME = "histate"
"""Our name in SGLang's plugin-argument registry (upstream/series 0003)."""


def upstream_plugin_args() -> Optional[ModuleType]:
    """SGLang's plugin-declared arguments API (upstream/series 0003) if this SGLang has it, else None
    (stock 0.5.23: the three ServerArgs hooks)."""
    try:
        from sglang.srt.arg_groups import plugin_args
    except ImportError:
        return None
    return plugin_args


def add_histate_arguments(parser: Any) -> None:
    """Add the HiState argument group; a no-op if the parser already has it."""
    if "--enable-histate" in getattr(parser, "_option_string_actions", {}):
        return
    add_histate_options(parser.add_argument_group(ARG_GROUP_TITLE))


def add_histate_options(group: Any) -> None:
    """Our flags, into an argparse group (ours on stock SGLang, SGLang's under series 0003)."""
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
    record_when_given(parser)  # whether --hicache-write-policy was given (write_policy.py)
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
    api = upstream_plugin_args()
    if getattr(record, FROM_CLI_ATTR, False) or (api is not None and api.parsed_from_command_line(record)):
        exit_with_usage_error(str(error))
    raise error


def parse_config(namespace: Any) -> HiStateConfig:
    """Flags > env vars > defaults; `namespace` None: a record built without a command line (Engine)."""
    return resolve_config(cli_values_from_namespace(namespace) if namespace is not None else {}, os.environ)


def plugin_args_spec(api: ModuleType) -> Any:
    """What series 0003's registry needs: the same group, parser and `_apply` the hooks below use.
    Our `HiStateConfigError` is a ValueError, which SGLang turns into a one-line exit 2 on a command line."""
    return api.PluginArgs(name=PLUGIN_ARGS_NAME, title=ARG_GROUP_TITLE, add_arguments=add_histate_options,
                          parse=parse_config, apply=_apply)


def from_cli_args_around(original: Any, cls: Any, args: Any) -> Any:
    try:
        config = parse_config(args)
        record = original(cls, args)
        setattr(record, CONFIG_ATTR, config)
        setattr(record, FROM_CLI_ATTR, True)
        stash_choice(record, args)
        _apply(record, config)
    except HiStateConfigError as error:
        exit_with_usage_error(str(error))
    return record


def resolve_once_before(record: Any, *args: Any, **kwargs: Any) -> None:
    if getattr(record, "_resolution_finished", False) or getattr(record, "_resolution_failed", False):
        return None  # a pickled copy in a child process: already resolved in the launcher
    config = getattr(record, CONFIG_ATTR, None)
    if config is None:
        config = parse_config(None)
        setattr(record, CONFIG_ATTR, config)
    try:
        _apply(record, config)
    except HiStateConfigError as error:
        report_config_error(record, error)
    return None


def stashed_config(server_args: Any) -> Optional[HiStateConfig]:
    """The config parsed for this (possibly pickled) ServerArgs: SGLang's plugin-argument stash under
    series 0003, ours on stock SGLang; None if it was never parsed."""
    api = upstream_plugin_args()
    config = api.plugin_config(server_args, PLUGIN_ARGS_NAME) if api is not None else None
    return config if config is not None else getattr(server_args, CONFIG_ATTR, None)


def config_of(server_args: Any) -> HiStateConfig:
    """The stashed config of a (possibly pickled) ServerArgs; env vars if nothing was stashed."""
    config = stashed_config(server_args)
    return config if config is not None else parse_config(None)
