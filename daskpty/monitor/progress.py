"""Per-epoch progress on stderr: a text line (redrawn in place on a terminal) or a tqdm bar.

``reconstruct(progress=None)`` (the default) shows progress when the session is interactive
(:func:`interactive`: stderr is a terminal, or a Jupyter kernel runs) and stays silent in tests,
pipelines and batch jobs. A tqdm bar is used there when tqdm is installed (it is optional).
"""
from __future__ import annotations

import statistics
import sys
import time

from ..physics.noise_models import NOISE_MODELS


def loss_label(kind) -> str:
    """``"loss (Poisson NLL + const)"`` and the like: the loss named with what it measures, from
    the noise model's registry entry (the Poisson negative log-likelihood up to a constant of the
    data: 0 for a model equal to the counts)."""
    model = NOISE_MODELS.get(kind)
    return f"loss ({model.loss_label})" if model is not None else "loss"


def in_notebook() -> bool:
    """Whether this process is a Jupyter (IPython) kernel."""
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    try:
        ip = shell.get_ipython()
    except Exception:
        return False
    return ip is not None and hasattr(ip, "kernel")


def interactive(stream=None) -> bool:
    """Whether someone is watching: ``stream`` (stderr) is a terminal, or a notebook runs."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):
        tty = False
    return tty or in_notebook()


def epoch_eta(ends, remaining: int, recent: int = 5) -> float | None:
    """Seconds left for ``remaining`` epochs from ``ends``, the clock at the end of each epoch
    (the first entry ends the first epoch). The median of the last ``recent`` epochs after the
    first is used: the first carries the start-up (cluster, data, first graph) and one slow
    epoch should not swing the estimate. None until a second epoch has ended."""
    if remaining <= 0:
        return 0.0
    steps = [b - a for a, b in zip(ends[:-1], ends[1:])][-recent:]
    if not steps:
        return None
    return statistics.median(steps) * max(remaining, 0)


def make_progress(epochs: int, n_patterns: int, *, start_epoch: int = 0, loss: str | None = None,
                  stream=None, bar: bool | None = None, warmup: int = 0):
    """The progress callback: a tqdm bar (``bar`` None: when tqdm is installed and the session is
    :func:`interactive`), else a :class:`ProgressPrinter`; ``warmup``: epochs whose loss is the
    amplitude model's before ``loss`` takes over (LSQML's ``noise_warmup``)."""
    if bar is None:
        bar = interactive(stream)
    if bar:
        try:
            import tqdm.auto  # noqa: F401  (optional dependency)
        except ImportError:
            bar = False
    cls = TqdmProgress if bar else ProgressPrinter
    return cls(epochs, n_patterns, start_epoch=start_epoch, loss=loss, stream=stream, warmup=warmup)


class ProgressPrinter:
    """Callback printing epoch, loss, patterns/s and ETA (:func:`epoch_eta`: ``ETA ...`` after the
    first epoch, which carries the start-up).

    ``epochs`` is the run's last epoch and ``start_epoch`` the epoch it starts after (a resumed
    run's stored epoch), so a resumed run counts on from there (``epoch 11/20``). On a terminal
    the line is redrawn in place; otherwise one line every ``every`` epochs (and the first and
    the last).
    """

    takes_epoch_state = True  # reads the metrics only: the state may stay on the workers

    def __init__(self, epochs: int, n_patterns: int, stream=None, every: int = 10, *, start_epoch: int = 0,
                 loss: str | None = None, clock=time.perf_counter, warmup: int = 0):
        self.epochs = epochs
        self.n_patterns = n_patterns
        self.clock = clock
        self.ends: list[float] = []
        self.stream = stream or sys.stderr
        self.every = every
        self.start_epoch = start_epoch
        self.label = loss_label(loss)
        self.warmup, self.warmup_label = int(warmup or 0), loss_label("gaussian")
        self.start = clock()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = 0

    def _line(self, epoch, metrics) -> str:
        eta = epoch_eta(self.ends, self.epochs - epoch)
        return (f"epoch {epoch}/{self.epochs}  {self.label_of(epoch)} {metrics['loss']:.4g}  "
                f"{metrics['patterns_per_second']:.3g} patterns/s  "
                + ("ETA ..." if eta is None else f"ETA {eta:.0f} s"))

    def label_of(self, epoch: int) -> str:
        """The loss's name after ``epoch`` epochs (the amplitude model's during a warm-up)."""
        return self.warmup_label if epoch <= self.warmup else self.label

    def __call__(self, epoch, state, metrics):
        self.done += 1
        self.ends.append(self.clock())
        epoch = int(epoch) if epoch is not None else self.start_epoch + self.done
        line = self._line(epoch, metrics)
        last = epoch >= self.epochs
        if self.tty:
            self.stream.write("\r" + line.ljust(78) + ("\n" if last else ""))
        elif epoch % self.every == 0 or last or self.done == 1:
            self.stream.write(line + "\n")
        self.stream.flush()
        return None


class TqdmProgress(ProgressPrinter):
    """The same callback as a tqdm bar (console or notebook widget, ``tqdm.auto``)."""

    def __init__(self, epochs: int, n_patterns: int, stream=None, every: int = 10, *, start_epoch: int = 0,
                 loss: str | None = None, warmup: int = 0):
        super().__init__(epochs, n_patterns, stream, every, start_epoch=start_epoch, loss=loss, warmup=warmup)
        from tqdm.auto import tqdm  # lazy: optional dependency

        self.bar = tqdm(total=epochs, initial=start_epoch, unit="epoch", file=self.stream, dynamic_ncols=True)

    def __call__(self, epoch, state, metrics):
        self.done += 1
        epoch = int(epoch) if epoch is not None else self.start_epoch + self.done
        self.bar.set_postfix_str(f"{self.label_of(epoch)} {metrics['loss']:.4g}, "
                                 f"{metrics['patterns_per_second']:.3g} patterns/s", refresh=False)
        self.bar.update(max(epoch - self.bar.n, 0))
        if epoch >= self.epochs:
            self.bar.close()
        return None
