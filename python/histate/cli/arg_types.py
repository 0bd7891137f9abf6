"""argparse types of the `histate` command line: each turns a flag's text into a checked value or
one line naming what was expected (`OneLineErrorParser` prints it without the usage block)."""
from __future__ import annotations

import argparse
import math

from histate.core import available_policies

GiB = 2**30
NONE = "none"  # --max-gap none / --max-sessions all: override a preset's value with "no limit"


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments end in one line naming the flag (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def number(what: str, *, above=None, at_least=None, at_most=None, integer: bool = False, none_word=None):
    """An argparse type: a finite number (or a whole number) of `what` within bounds, or `none_word`."""
    bounds = " and ".join(f"{op} {bound:,}" if isinstance(bound, int) else f"{op} {bound:g}"
                          for op, bound in ((">", above), (">=", at_least), ("<=", at_most)) if bound is not None)
    expected = " ".join(w for w in ("expected", "a whole number" if integer else "a finite number",
                                    f"of {what}" if what else "", bounds) if w) + \
        (f" (or {none_word!r})" if none_word else "")

    def parse(text: str):
        if none_word is not None and text.strip().lower() == none_word:
            return NONE
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or (above is not None and value <= above) or \
                (at_least is not None and value < at_least) or (at_most is not None and value > at_most):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value
    parse.__name__ = what or "number"
    return parse


def gib(*, above=None, at_least=None):
    parse = number("GiB", above=above, at_least=at_least)
    return lambda text: int(parse(text) * GiB)


def policy_list(text: str) -> list:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in available_policies()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}; available: {', '.join(available_policies())}")
    return names


def plot_policies(text: str):
    """`all`, or a policy list (checked against --policies once both are known)."""
    return "all" if text.strip() == "all" else policy_list(text)


def intervals(text: str) -> tuple:
    try:
        values = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated page counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("intervals must be positive page counts")
    return values


def fail_server(text: str) -> tuple:
    """argparse type: K@T, a server index and a simulated time in seconds."""
    try:
        k, t = text.split("@")
        k, t = int(k), float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K@T (server index @ seconds), got {text!r}") from None
    if k < 0 or not (math.isfinite(t) and t >= 0):
        raise argparse.ArgumentTypeError(f"expected K >= 0 and a finite T >= 0, got {text!r}")
    return k, t


def token_scale(text: str) -> float:
    """argparse type: 1/k for a whole k (bench.scaling explains why pages cannot be split)."""
    from histate.bench.scaling import pages_per_scaled_page

    try:
        value = float(text)
        pages_per_scaled_page(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err) if "token scale" in str(err) else
                                         f"expected a number 1/k, got {text!r}") from None
    return value


def positive(kind):
    """argparse type: a number of `kind` (int or float) that must be > 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text}")
        return value
    return parse


def int_list(text: str) -> tuple:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if min(values) < 0:
        raise argparse.ArgumentTypeError("token counts must be >= 0")
    return values
