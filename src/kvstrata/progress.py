"""Progress of a long loop on stderr, readable on a terminal and in a log file alike.

On a terminal it is a tqdm bar. Anywhere else (CI logs, ``nohup``, a pipe) a bar is a stream of
carriage returns, so it prints one plain line when the loop starts and then one every
``interval_s`` seconds: requests done, tokens/s, ETA. Wall-clock time decides only when to print,
never anything the loop computes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

#: Seconds between two progress lines when stderr is not a terminal.
LINE_INTERVAL_S = 5.0


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m}:{s:02d}"


class Progress:
    """Reports ``done`` of ``total`` requests (and the tokens they computed) while a loop runs.

    ``enabled=False`` reports nothing. ``stream`` defaults to ``sys.stderr``; ``clock`` is
    injectable for tests.
    """

    def __init__(
        self,
        desc: str,
        total: int | None,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval_s: float = LINE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.desc = desc
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.clock = clock
        self.done = 0
        self.tokens = 0
        self._bar: tqdm | None = None
        self._lines = enabled and not self.stream.isatty()
        if enabled and not self._lines:
            self._bar = tqdm(total=total, desc=desc, unit="req", leave=False, file=self.stream)
        self._start = self._last = clock()
        if self._lines:
            of = f", {total:,} requests" if total is not None else ""
            self._print(f"{desc}: started{of}")

    def update(self, requests: int, tokens: int = 0) -> None:
        """``requests`` more finished, having computed ``tokens`` tokens."""
        self.done += requests
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(requests)
        elif self._lines:
            now = self.clock()
            if now - self._last >= self.interval_s:
                self._last = now
                self._print(self.line(now))

    def line(self, now: float, final: bool = False) -> str:
        """The status line at time ``now`` (``final``: the closing line, without an ETA)."""
        elapsed = max(now - self._start, 1e-9)
        parts = [f"{self.done:,}" + (f"/{self.total:,}" if self.total is not None else "")]
        parts[0] += " requests"
        parts.append(f"{self.tokens / elapsed:,.0f} tokens/s")
        if self.total is not None and self.done and not final:
            eta = (self.total - self.done) * elapsed / self.done
            parts.append(f"ETA {_duration(eta)}")
        parts.append(f"elapsed {_duration(elapsed)}")
        return f"{self.desc}: " + ", ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._lines:
            self._print(self.line(self.clock(), final=True) + " (done)")
            self._lines = False

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        elif self._bar is not None:
            self._bar.close()
