"""One round per epoch once the probe is seen to vary: the "auto" rounds of a run with OPR.

Minibatch rounds make the object converge faster per epoch; on a constant beam OPR's eigen-probe
weights stay small, and such runs keep their rounds. Where the probe truly varies over the scan,
OPR with minibatch rounds stalls well above what one round per epoch reaches (see
:data:`daskpty.engines.probe_model.VARYING_SHARED_RMS`). So a run whose ``rounds_per_epoch`` was
left "auto", with eigen-probes, watches their weights in each epoch's history entry
(``opr_eigen_shared_rms``) and, from the first epoch where they show a varying probe, runs the
rest of its epochs one round each (:func:`daskpty.execution.driver.run_epochs`,
``one_round_when``). The decision is a function of the run's history, so a resumed run makes it
at the same epoch, and the checkpoint written at that epoch already records one round per epoch.
"""
from __future__ import annotations

from ..engines.probe_model import VARYING_AFTER, VARYING_SHARED_RMS


def may_switch(adapter, rounds: int, auto: bool) -> bool:
    """Whether a run watches for the switch: its rounds per epoch were "auto" and came out
    above one, and its probe model has eigen-probes (OPR with K ≥ 2)."""
    model = getattr(adapter.probe_model, "model", None)
    return bool(auto) and int(rounds) > 1 and model is not None and model.n_eigen > 0


class OneRoundOnceVarying:
    """``one_round_when`` of :func:`~daskpty.execution.driver.run_epochs`: True after the first
    epoch, from the ``after``-th that fitted eigen-probe weights on, whose shared weight rms
    (``opr_eigen_shared_rms``: the part that neighbouring patterns share, which noise does not) is
    at least ``threshold`` and not below the epoch before's (a constant beam's weights first take
    up what the object and the mean probe have not fitted yet, then fall back epoch after epoch;
    a varying probe's stay or grow). ``on_switch(epoch, rms)`` is called then (``epoch`` counted
    from 1, as the callbacks count it), before the epoch's callbacks (the caller moves its
    records and the probe model's rounds-dependent settings to one round per epoch there).
    ``history``: the entries of the epochs a resumed run has behind it, so that it decides
    where the uninterrupted run would."""

    def __init__(self, on_switch=None, threshold: float = VARYING_SHARED_RMS, after: int = VARYING_AFTER,
                 history=()):
        self.on_switch, self.threshold, self.after = on_switch, float(threshold), int(after)
        self.fitted, self.last = 0, None
        self.switched_after: int | None = None
        for metrics in history:
            self._see(metrics)

    def _see(self, metrics: dict):
        """Count an epoch that fitted the weights: ``(its shared rms, the one before's)``, or
        None when it fitted none."""
        rms = metrics.get("opr_eigen_shared_rms")
        if rms is None:
            return None
        previous, self.last = self.last, float(rms)
        self.fitted += 1
        return float(rms), previous

    def __call__(self, epoch: int, metrics: dict) -> bool:
        if self.switched_after is not None:
            return False
        seen = self._see(metrics)
        if seen is None:
            return False
        rms, previous = seen
        if self.fitted < self.after or rms < self.threshold or (previous is not None and rms < previous):
            return False
        self.switched_after = int(epoch)
        if self.on_switch is not None:
            self.on_switch(int(epoch), rms)
        return True
