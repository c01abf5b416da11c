"""The command line's progress lines: plain timestamped lines, and on a terminal a bar for the
numbered steps of a cold build (``[i/n] what``) whose elapsed time ticks until the next line.

A compile's longest step is one call into TVM that reports nothing while it runs, so on a
terminal a ticking clock is what tells the person the program is working, not hung.
"""

from __future__ import annotations

import re
import sys
import threading
import time

import click

STEP = re.compile(r"^\[(\d+)/(\d+)\] (.*?)(?: \(\d+ s so far\))?$")
BAR = 20  # characters of the bar
TICK_S = 0.5


class Progress:
    """A callable taking progress lines; ``tty`` None: whether stderr is a terminal."""

    def __init__(self, tty: bool | None = None):
        self._tty = tty
        self._lock = threading.Lock()
        self._live: tuple[str, float] | None = None  # the step line being ticked, its start
        self._ticker: threading.Thread | None = None

    def __call__(self, msg: str) -> None:
        with self._lock:
            self._settle()
            tty = sys.stderr.isatty() if self._tty is None else self._tty
            step = STEP.match(msg) if tty else None
            if step is None:
                click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)
                return
            i, n, text = int(step[1]), int(step[2]), step[3]
            done = BAR * (i - 1) // max(n, 1)
            self._live = (f"[{'#' * done}{'.' * (BAR - done)}] {i}/{n} {text}", time.monotonic())
            self._draw()
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, daemon=True, name="progress")
            self._ticker.start()

    def close(self) -> None:
        """End the live line (the build is over)."""
        with self._lock:
            self._settle()

    def _draw(self) -> None:
        text, t0 = self._live
        click.echo(f"\r{text} {time.monotonic() - t0:5.0f} s", err=True, nl=False)

    def _settle(self) -> None:
        """The live step line keeps its last time and ends; the next line starts below it."""
        if self._live is not None:
            self._draw()
            click.echo(err=True)
            self._live = None

    def _tick(self) -> None:
        while True:
            time.sleep(TICK_S)
            with self._lock:
                if self._live is not None:
                    self._draw()
