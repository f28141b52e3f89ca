"""Device-resident engine state on GPU workers.

In an epoch graph every worker holding data keeps its own copy of the engine state (see
:mod:`.epoch_graph`). On a GPU worker that copy lives in device memory: the first chunk step that
finds its chunks on the device moves the adapter's ``device_fields`` (object, probe, momentum,
illumination, optimiser memory) there, the chunk steps then return their partial sums on the
device, the worker's own subtrees of the sum tree add up there, and ``apply`` updates the state
there. Between workers only the partial sums travel (as they do on the CPU). The state comes back
to the host only when the client asks for it (checkpoints, dashboard images, the result): through
:func:`fetch_host_state`, a task on the worker that holds it, so the client never touches a GPU.

On CPU workers nothing moves: the state is NumPy and every function here returns it unchanged.
Set ``DASKPTY_DEVICE_STATE=0`` (or :func:`set_device_state`) to keep the state on the host of GPU
workers too, the layout before (each round copies the object box and the probe to the device and
the partial sums back): the ablation benchmark compares the two.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import numpy as np

from ..physics.backend import asarray_like, is_cupy, to_numpy

_ENABLED = os.environ.get("DASKPTY_DEVICE_STATE", "1").strip().lower() not in ("0", "false", "no", "off")


def set_device_state(enabled: bool) -> None:
    """Keep the engine state in device memory on GPU workers (default True). Workers read this
    in their own process: on a cluster of worker processes set ``DASKPTY_DEVICE_STATE`` in their
    environment instead (or call this through ``client.run``)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def _moved(value, convert):
    """``value`` with every array inside (dicts, dataclasses, tuples) passed through ``convert``;
    containers are copied, never changed in place (other copies of a state share them)."""
    if isinstance(value, np.ndarray) or is_cupy(value):
        return convert(value)
    if isinstance(value, dict):
        return {k: _moved(v, convert) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, convert) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(out, f.name, _moved(getattr(value, f.name), convert))  # (frozen ones too)
        return out
    return value


def state_on_device(state, adapter) -> bool:
    fields = adapter.device_fields
    return bool(fields) and is_cupy(getattr(state, fields[0], None))


def to_device(state, adapter, like):
    """A copy of ``state`` with the adapter's ``device_fields`` on the device of ``like``."""
    out = copy.copy(state)
    for name in adapter.device_fields:
        setattr(out, name, _moved(getattr(state, name), lambda a: asarray_like(a, like)))
    return out


def resident(state, adapter, blocks):
    """The state a worker computes with: moved to the device when its data ``blocks`` are there,
    the adapter keeps device-resident state and it is not there yet; else ``state`` itself."""
    if (not _ENABLED or not blocks or not is_cupy(blocks[0]) or not adapter.device_fields
            or state_on_device(state, adapter)):
        return state
    return to_device(state, adapter, blocks[0])


def follow_partials(state, adapter, total):
    """``state`` moved to the device when the reduced partial ``total`` came from there (a round
    end that runs apart from the chunk steps, in the split epoch graph)."""
    if total is None or not adapter.device_fields or state_on_device(state, adapter):
        return state
    arrays = [b.data for b in total.boxes.values()] + list(total.arrays.values())
    device = next((a for a in arrays if is_cupy(a)), None)
    return state if device is None else to_device(state, adapter, device)


def to_host(state):
    """A copy of ``state`` with every device array copied to NumPy (NumPy arrays are shared)."""
    if state is None:
        return None
    out = copy.copy(state)
    for name, value in vars(state).items():
        setattr(out, name, _moved(value, lambda a: to_numpy(a) if is_cupy(a) else a))
    return out


def has_device_arrays(state) -> bool:
    """True when any array of ``state`` (its attributes, one level of containers) is on a device."""
    for value in vars(state).values():
        items = value.values() if isinstance(value, dict) else vars(value).values() if \
            dataclasses.is_dataclass(value) and not isinstance(value, type) else (value,)
        for v in items:
            if is_cupy(v) or isinstance(v, dict) and any(is_cupy(a) for a in v.values()):
                return True
    return False


def host_state_of(carry):
    """Task run where an epoch's :class:`~.epoch_graph.EpochCarry` lives: its state on the host."""
    return to_host(carry.state)


def fetch_host_state(future, timeout=None):
    """The host copy of the state in the ``EpochCarry`` that ``future`` points to, made by a task
    on the worker holding it (a device → host copy there, NumPy arrays on the way)."""
    client = future.client
    host = client.submit(host_state_of, future, pure=False)
    try:
        return host.result(timeout=timeout)
    finally:
        host.release()
