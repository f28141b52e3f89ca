"""A minimal text progress bar on stderr (no third-party dependency)."""
from __future__ import annotations

import sys
import time


def _fmt_time(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "--:--"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class TextProgress:
    """``label [#####     ]  37/128 shards  12,345 patterns/s  eta 00:45`` on one refreshed line.

    On a terminal the line is redrawn in place (at most every ``interval`` seconds); otherwise a
    line is printed every 10 % so logs stay short. Disabled bars do nothing.
    """

    def __init__(self, total: int, label: str, unit: str = "shards", item: str = "patterns",
                 enabled: bool = True, stream=None, interval: float = 0.25, width: int = 30):
        self.total = max(int(total), 0)
        self.label, self.unit, self.item = label, unit, item
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval, self.width = interval, width
        self.done = 0
        self.items = 0
        self.start = time.perf_counter()
        self._last = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, n: int = 1, items: int = 0) -> None:
        self.done += n
        self.items += items
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._tty:
            if now - self._last >= self.interval or self.done >= self.total:
                self._last = now
                self.stream.write("\r" + self._line(now))
                self.stream.flush()
        else:
            decile = (10 * self.done) // max(self.total, 1)
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(self._line(now) + "\n")
                self.stream.flush()

    def _line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + " " * (self.width - filled)
        rate = f"  {self.items / elapsed:,.0f} {self.item}/s" if self.items else ""
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("inf")
        return (f"{self.label} [{bar}] {self.done}/{self.total} {self.unit}{rate}  "
                f"elapsed {_fmt_time(elapsed)}  eta {_fmt_time(eta)}")

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\r" + self._line(time.perf_counter()) + "\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
