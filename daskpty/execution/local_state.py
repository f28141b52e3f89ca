"""Per-pattern state that lives with its chunk: refined positions and their optimiser memory,
the probe model's OPR weights and intensity factors (each enabled feature adds its arrays to the
chunk's dict).

An engine adapter with per-pattern state offers ``initial_local(nominal_positions) -> dict``
(``{name: (B, ...) array}`` for one chunk; see ``daskpty.engines.positions``). The execution
layer keeps one such dict per chunk — ``{chunk index: {name: array}}``, in the chunks' (sorted)
pattern order — on the worker that holds the chunk in epoch graphs, on the client round by round.
This module converts between that layout and whole arrays in the user's pattern order (for
results, checkpoints and resume).
"""
from __future__ import annotations

import copy

import numpy as np

from ..engines.eigen_probes import effective_weights
from ..engines.probe_model import PROBE_MODEL_KEYS


def chunk_bounds(chunk_lengths) -> np.ndarray:
    """Start of every chunk and the end of the last, in the chunks' pattern order."""
    return np.cumsum((0,) + tuple(int(c) for c in chunk_lengths))


def initial_locals(adapter, positions_sorted: np.ndarray, chunk_lengths, arrays: dict | None = None) -> dict:
    """Every chunk's per-pattern state: ``adapter.initial_local`` of its nominal positions, or the
    chunk's rows of ``arrays`` (whole arrays in the chunks' order, e.g. from a resumed store). A
    row of NaN in ``arrays`` is a pattern that joined after the state was stored (a scan that
    grows): it starts from its initial value."""
    bounds = chunk_bounds(chunk_lengths)
    out = {}
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        local = adapter.initial_local(positions_sorted[a:b])
        for name, values in (arrays or {}).items():
            if name in local:
                rows = np.asarray(values[a:b])
                joined = np.isnan(rows).reshape(len(rows), -1).all(axis=1) if rows.dtype.kind in "fc" \
                    else np.zeros(len(rows), bool)
                if joined.any():
                    local[name] = np.array(local[name], copy=True)
                    local[name][~joined] = rows[~joined].astype(local[name].dtype)
                else:
                    local[name] = np.array(rows, dtype=local[name].dtype)
        out[i] = local
    return out


def gather_locals(locals_: dict, chunk_lengths, order: np.ndarray | None) -> dict:
    """``{chunk: {name: array}}`` → ``{name: array}`` over all patterns in the user's order."""
    bounds = chunk_bounds(chunk_lengths)
    names = next(iter(locals_.values())).keys() if locals_ else ()
    out = {}
    for name in names:
        parts = [locals_[i][name] for i in range(len(bounds) - 1)]
        whole = np.concatenate(parts, axis=0)
        if order is not None:  # row k of the chunks' order is the user's pattern order[k]
            unsorted = np.empty_like(whole)
            unsorted[order] = whole
            whole = unsorted
        out[name] = whole
    return out


def sort_like_chunks(arrays: dict, order: np.ndarray | None) -> dict:
    """Whole arrays in the user's order → the chunks' order (the inverse of :func:`gather_locals`)."""
    if order is None:
        return dict(arrays)
    return {name: np.asarray(v)[order] for name, v in arrays.items()}


#: How per-pattern arrays other than ``positions`` are named in a reconstruction's engine state:
#: position refinement's memory as ``position_<name>``, the probe model's arrays (OPR weights,
#: intensity factors) as ``pattern_<name>``.
ENGINE_STATE_PREFIX = "position_"
PATTERN_PREFIX = "pattern_"


def stored_name(name: str) -> str:
    """The engine-state name of a per-pattern array of the chunks' state."""
    return (PATTERN_PREFIX if name in PROBE_MODEL_KEYS else ENGINE_STATE_PREFIX) + name


def local_name(stored: str) -> str | None:
    """Inverse of :func:`stored_name` (None: not a per-pattern array's name)."""
    for prefix in (PATTERN_PREFIX, ENGINE_STATE_PREFIX):
        if stored.startswith(prefix):
            return stored[len(prefix):]
    return None


class PatternLayout:
    """Where every pattern sits in the chunks (their lengths and the sort order): what turns the
    chunks' per-pattern state into arrays in the user's order and back. Filled in once the data
    are chunked (``update``); a result made before that has no per-pattern state to convert."""

    def __init__(self):
        self.chunk_lengths = None
        self.order = None
        self.nominal = None  # nominal positions in the chunks' order

    def update(self, data) -> None:
        self.chunk_lengths, self.order = tuple(data.chunk_lengths), data.order
        self.nominal = data.positions_host

    def displacements(self, state):
        """``(nominal, refined − nominal)`` in the chunks' order for a state carrying refined
        positions (for pictures: the order does not matter), else None."""
        local = getattr(state, "chunk_local", None)
        if not local or self.nominal is None or "positions" not in next(iter(local.values())):
            return None
        refined = np.concatenate([local[i]["positions"] for i in range(len(self.chunk_lengths))])
        return self.nominal, refined - self.nominal

    def probe_weights(self, state):
        """``(nominal, weights)`` in the chunks' order for a state carrying OPR weights: each
        pattern's (K,) weights in the current eigen-probe basis (the last orthonormalisation's T
        applied, which the chunks themselves apply only at their next visit), else None."""
        local = getattr(state, "chunk_local", None)
        if not local or self.nominal is None or "opr_weights" not in next(iter(local.values())):
            return None
        weights = np.concatenate([local[i]["opr_weights"] for i in range(len(self.chunk_lengths))])
        return self.nominal, effective_weights(weights, getattr(state, "weight_transform", None))

    def result_arrays(self, state) -> tuple[np.ndarray | None, dict]:
        """``(refined positions or None, per-pattern engine-state arrays)`` of a state carrying
        ``chunk_local``, in the user's pattern order."""
        local = getattr(state, "chunk_local", None)
        if not local or self.chunk_lengths is None:
            return None, {}
        arrays = gather_locals(local, self.chunk_lengths, self.order)
        refined = arrays.pop("positions", None)
        return refined, {stored_name(k): v for k, v in arrays.items()}

    def resumed_locals(self, adapter, data, positions, engine_state: dict) -> dict:
        """Every chunk's per-pattern state from a resumed result: its refined ``positions`` (object
        frame, user order) and the ``position_*`` / ``pattern_*`` arrays of its engine state."""
        arrays = {"positions": positions}
        arrays.update({local_name(k): v for k, v in engine_state.items()
                       if local_name(k) and np.ndim(v) == 2 and len(v) == len(positions)})
        return initial_locals(adapter, data.positions_host, data.chunk_lengths,
                              sort_like_chunks(arrays, data.order))


def with_local(state, local: dict | None):
    """A shallow copy of ``state`` carrying ``chunk_local``: every chunk's per-pattern state
    (``{chunk: {name: array}}``), as callbacks and results see it."""
    state = copy.copy(state)
    state.chunk_local = local
    return state
