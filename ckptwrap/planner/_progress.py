"""A small text progress bar on standard error, for long measurements.

It draws only on a terminal (or when asked explicitly), so logs and captured output of
scripts and tests stay clean. It has no dependencies beyond the standard library.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["ProgressBar", "should_show"]

# Below this many items a measurement is quick enough that a bar is only noise.
_MIN_ITEMS = 20
_WIDTH = 28
# Redrawing on every step would slow down profiles of models with thousands of modules.
_MIN_INTERVAL = 0.1


def should_show(progress: Optional[bool], items: int, *, stream: Optional[TextIO] = None) -> bool:
    """Whether to draw a bar: as forced by ``progress``, else on a terminal for many items.

    Args:
        progress: ``True`` or ``False`` to force the bar on or off; ``None`` to decide.
        items: How many items the work goes through.
        stream: Where the bar would be drawn; standard error by default.

    Returns:
        ``progress`` if it is not ``None``; otherwise whether there are more than
        about twenty items and ``stream`` is a terminal.
    """
    if progress is not None:
        return bool(progress)
    if items <= _MIN_ITEMS:
        return False
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed or detached stream
        return False


class ProgressBar:
    """A one-line bar that is redrawn in place, e.g. ``profiling |#####     | 12/40 3.1s``.

    A disabled bar does nothing, so callers need no ``if`` around each update.

    Args:
        total: The number of steps that make a full bar.
        label: Text shown before the bar.
        enabled: Whether to draw at all.
        stream: Where to draw; standard error (looked up now, not at import) by default.
    """

    def __init__(
        self, total: int, *, label: str, enabled: bool, stream: Optional[TextIO] = None
    ) -> None:
        self._total = max(int(total), 0)
        self._label = label
        self._enabled = enabled
        self._stream = sys.stderr if stream is None else stream
        self._done = 0
        self._start = time.perf_counter()
        self._last_draw = float("-inf")
        self._drawn: Optional[str] = None  # the line on screen now

    @property
    def done(self) -> int:
        """Steps completed so far."""
        return self._done

    def update(self, steps: int = 1) -> None:
        """Advance by ``steps`` (never past the total) and redraw if it is time to."""
        self._done = min(self._done + steps, self._total)
        if not self._enabled or steps <= 0:
            return
        now = time.perf_counter()
        if self._done >= self._total or now - self._last_draw >= _MIN_INTERVAL:
            self._draw(now)

    def set_label(self, label: str) -> None:
        """Change the text shown before the bar (for a new phase of the work)."""
        self._label = label

    def close(self) -> None:
        """Finish the line, so that later output starts on a fresh one."""
        if self._enabled and self._drawn is not None:
            self._draw(time.perf_counter())
            self._stream.write("\n")
            self._stream.flush()
        self._enabled = False

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _draw(self, now: float) -> None:
        filled = _WIDTH * self._done // self._total if self._total else _WIDTH
        bar = "#" * filled + " " * (_WIDTH - filled)
        line = f"{self._label} |{bar}| {self._done}/{self._total} {now - self._start:.1f}s"
        if line == self._drawn:
            return
        # Blank out what is left of a longer line drawn before (a longer label, say).
        padding = " " * max(len(self._drawn or "") - len(line), 0)
        self._stream.write(f"\r{line}{padding}")
        self._stream.flush()
        self._last_draw = now
        self._drawn = line
