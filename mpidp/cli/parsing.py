"""The command-line machinery mpidp's commands and the examples share: a help formatter, a
parser whose usage errors print once under a launcher, and the launch's first rank (read from
the launcher's variables, no MPI)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["HelpFormatter", "Parser", "domain_size", "exit_once", "first_rank"]


def domain_size(text: str) -> int | tuple[int, int]:
    """``-d 4`` (bands) or ``-d 2x2`` (a grid of blocks: latitude x longitude ranks)."""
    from mpidp.errors import ConfigError
    from mpidp.runtime.grid import parse_domain

    try:
        return parse_domain(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default after its help, unless the help
    already names it or it is None, False, empty (the help says what those mean). mpidp's
    commands and the examples use it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        empty = action.default is None or action.default is False or action.default in ("", [])
        if empty or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def first_rank() -> bool:
    """Whether this process is rank 0 of its launch, or started alone (from the launcher's
    variables: no MPI, no communication). plan and sample-data need no MPI, so under a
    launcher the other ranks do nothing (and print nothing)."""
    import os

    from mpidp.errors import MpidpError
    from mpidp.runtime.bootstrap import detect_launch

    try:
        return detect_launch(dict(os.environ)).rank == 0
    except MpidpError:  # an inconsistent environment: info says why; here, carry on
        return True


def exit_once(message: str, code: int = 2) -> NoReturn:
    """End a command-line program on a mistake every rank sees alike (an argument, a missing
    file): ``message`` printed once, by the launch's first rank, and exit ``code`` on every
    rank, with no traceback. Not for errors one rank may meet alone (those abort the job)."""
    if first_rank():
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are printed once under a launcher (by its first
    rank; every rank exits 2)."""

    def error(self, message: str) -> NoReturn:
        if first_rank():
            self.print_usage(sys.stderr)
        exit_once(f"{self.prog}: error: {message}", 2)
