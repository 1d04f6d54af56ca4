"""What every kvstrata command shares: how it fails, and its exit codes.

Whatever goes wrong with the input — an argparse usage error, a bad value that a config dataclass
refuses, a checkpoint or trace that cannot be read, a request for more memory than the machine has —
ends in ONE line on stderr, ``kvstrata <command>: error: <what to change>``, and exit status 2. A
Ctrl-C ends in ``kvstrata <command>: interrupted`` and 130 (128 + SIGINT, as shells report it).
Errors kvstrata does not raise on purpose are bugs and keep their traceback.

=====  =========================================================================================
exit   meaning
=====  =========================================================================================
0      the command ran and what it checked holds
1      it ran, but the result is a failure (check-model past tolerance, replay: every request
       failed, a request failed under ``--fail-on-error``, or ``--verify`` found a mismatch)
2      bad input: a flag, a checkpoint, a trace, or more memory than the machine has
130    interrupted (Ctrl-C); replay still prints the summary of the requests finished so far
=====  =========================================================================================
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from .errors import KVStrataError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def error_line(prog: str, message: str) -> str:
    """The one stderr line a command ends with when its input is wrong."""
    first, *_ = str(message).strip().splitlines() or [""]
    return f"{prog}: error: {first}"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except None and a switch's False (the help text says those)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, error_line(self.prog, message) + "\n")


def run_command(prog: str, func: Callable[[], int]) -> int:
    """Run ``func`` and map kvstrata's errors and Ctrl-C to one stderr line and an exit status."""
    try:
        return func()
    except KVStrataError as err:
        print(error_line(prog, str(err)), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
