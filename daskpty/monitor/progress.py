"""A one-line-per-epoch progress report on stderr (quiet when not attached to a terminal)."""
from __future__ import annotations

import sys
import time


class ProgressPrinter:
    """Callback printing epoch, loss, patterns/s and ETA.

    On a terminal the line is redrawn in place; otherwise one line every ``every`` epochs.
    """

    def __init__(self, epochs: int, n_patterns: int, stream=None, every: int = 10):
        self.epochs = epochs
        self.n_patterns = n_patterns
        self.stream = stream or sys.stderr
        self.every = every
        self.start = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = 0

    takes_epoch_state = True  # reads the metrics only: the state may stay on the workers

    def __call__(self, epoch, state, metrics):
        self.done += 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * max(self.epochs - self.done, 0)
        line = (f"epoch {self.done}/{self.epochs}  loss {metrics['loss']:.4g}  "
                f"{metrics['patterns_per_second']:.3g} patterns/s  ETA {eta:.0f} s")
        if self.tty:
            end = "\n" if self.done >= self.epochs else ""
            self.stream.write("\r" + line.ljust(78) + end)
        elif self.done % self.every == 0 or self.done >= self.epochs or self.done == 1:
            self.stream.write(line + "\n")
        self.stream.flush()
        return None
