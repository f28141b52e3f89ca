"""What a new user meets first: the progress line's ETA, exporting a result's geometry without its
data, and the layout chosen when whole-object replicas do not fit a worker."""
from __future__ import annotations

import io


def test_eta_ignores_the_first_epochs_start_up():
    """Epoch 1 takes 10x the others (cluster, data, first graph): after it the line says ``ETA ...``,
    and from epoch 2 on the estimate is the later epochs' pace (9 epochs x 1 s), not 10x too long."""
    from daskpty.monitor.progress import ProgressPrinter

    ends = iter([0.0] + [10.0 + k for k in range(11)])  # start, then the end of epochs 1..11
    out = io.StringIO()
    printer = ProgressPrinter(11, 10, stream=out, every=1, clock=lambda: next(ends))
    for epoch in range(1, 12):
        printer(epoch, None, {"loss": 1.0, "patterns_per_second": 10.0})
    etas = [line.rsplit("ETA ", 1)[1] for line in out.getvalue().splitlines()]
    assert etas[0] == "..."
    assert etas[1:] == [f"{n} s" for n in range(9, -1, -1)]
