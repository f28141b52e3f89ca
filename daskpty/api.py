"""Library entry point: :func:`reconstruct`."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from .engines import lsqml
from .engines.initial import object_frame, probe_diameter_from_scan, probe_from_mean_pattern
from .execution.cluster import client_context
from .execution.data import prepare_data
from .execution.driver import LSQMLAdapter, run_epochs
from .physics import check_windows_inside, split_positions
from .results import Reconstruction

ENGINES = ("lsqml",)


def _load(data):
    if isinstance(data, (str, os.PathLike)):
        from .io import open_data

        return open_data(data)
    for attr in ("intensities", "positions"):
        if not hasattr(data, attr):
            raise TypeError("data must be a path to a daskpty store or a PtychoData "
                            "(see daskpty.open_data / daskpty.from_arrays)")
    return data


def _initial_probe(probe, data, client, intensities, modes, seed):
    if probe is None:
        probe = getattr(data, "probe", None)
    if probe is None:
        mean = client.compute(intensities.mean(axis=0, dtype=np.float64)).result()
        diameter = probe_diameter_from_scan(data.positions, intensities.shape[-1])
        return probe_from_mean_pattern(np.asarray(mean), modes=modes or 1, seed=seed, diameter=diameter)
    probe = np.asarray(probe, dtype=np.complex64)
    if probe.ndim == 2:
        probe = probe[None]
    if probe.shape[-2:] != tuple(intensities.shape[-2:]):
        raise ValueError(f"probe shape {probe.shape[-2:]} does not match the detector shape "
                         f"{tuple(intensities.shape[-2:])}; pass a probe of the pattern size")
    if modes and modes > probe.shape[0]:
        extra = probe_from_mean_pattern(np.abs(np.fft.fftshift(np.fft.fft2(probe[0], norm="ortho"))) ** 2,
                                        modes=modes, seed=seed)[probe.shape[0]:]
        extra *= np.sqrt((np.abs(probe) ** 2).sum() / (np.abs(extra[0]) ** 2).sum() * 0.05)
        probe = np.concatenate([probe, extra.astype(np.complex64)])
    return probe


def reconstruct(data, engine: str = "lsqml", epochs: int = 100, *, probe=None, object=None,
                probe_modes: int | None = None, noise: str = "gaussian", rounds_per_epoch: int = 1,
                client=None, n_workers: int | None = None, seed: int = 0, callback=None,
                progress: bool = False, chunk_length: int | None = None, persist: bool = True,
                split_every: int = 8, sort: bool = True, rescale_probe: bool = True,
                **engine_options) -> Reconstruction:
    """Reconstruct object and probe from a ptychography data set on a dask cluster.

    Parameters
    ----------
    data : str or PtychoData
        A daskpty data-set store path (see :func:`daskpty.open_data`) or an opened data set.
    engine : "lsqml"
    epochs : number of passes over all patterns.
    probe : initial probe (n, n) or (M, n, n); default: the store's ``probe`` if present, else
        derived from the mean diffraction pattern (see :func:`daskpty.engines.initial.probe_from_mean_pattern`).
    object : initial object (H, W); positions are then in its pixel frame. Default: ones, sized
        to cover every probe window plus a margin; ``result.origin`` says where position (0, 0) lies.
    probe_modes : number of incoherent probe modes (default: those of ``probe``, else 1).
    noise : "gaussian" (amplitude) or "poisson".
    rounds_per_epoch : 1 = compact LSQML (one update per epoch from all patterns); R > 1 =
        minibatch semantics, every round using slice r of every chunk.
    client : a ``distributed.Client``; default: the current client, else an embedded LocalCluster
        (``n_workers`` processes) that is closed at the end.
    callback : ``callback(epoch, state, metrics)`` after every epoch; return False to stop.
    progress : print a progress line per epoch to stderr.
    chunk_length : patterns per chunk (default from the probe size and a memory budget; it does
        not depend on the number of workers, so results do not either).
    **engine_options : fields of :class:`daskpty.engines.lsqml.LSQMLOptions` (beta, delta, ...).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not isinstance(epochs, (int, np.integer)) or epochs < 0:
        raise ValueError(f"epochs must be a non-negative integer, got {epochs!r}")
    if rounds_per_epoch < 1:
        raise ValueError(f"rounds_per_epoch must be >= 1, got {rounds_per_epoch}")
    valid_names = {f.name for f in dataclasses.fields(lsqml.LSQMLOptions)}
    unknown = set(engine_options) - valid_names
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)} for engine {engine!r}; valid: {sorted(valid_names)}")
    options = lsqml.LSQMLOptions(noise=noise, **engine_options)
    data = _load(data)
    intensities = data.intensities
    positions = np.asarray(data.positions, dtype=np.float64)
    n = intensities.shape[-1]
    mask = getattr(data, "mask", None)
    valid = None if mask is None else np.fft.ifftshift(np.asarray(mask, dtype=bool))

    if object is not None:
        obj = np.array(object, dtype=np.complex64)
        origin = np.zeros(2)
    else:
        shape, origin = object_frame(positions, n)
        obj = np.ones(shape, dtype=np.complex64)
    frame_positions = positions + origin
    check_windows_inside(split_positions(frame_positions, n)[0], n, obj.shape)

    callbacks = []
    if progress:
        from .monitor.progress import ProgressPrinter

        callbacks.append(ProgressPrinter(epochs, len(positions)))
    if callback is not None:
        callbacks.append(callback)

    with client_context(client, n_workers=n_workers) as c:
        if not hasattr(intensities, "dask"):
            import dask.array as da

            intensities = da.from_array(np.asarray(intensities), chunks=(max(1, chunk_length or 256), -1, -1))
        init_probe = _initial_probe(probe, data, c, intensities, probe_modes, seed)
        chunked = prepare_data(c, intensities, frame_positions, chunk_length=chunk_length,
                               modes=init_probe.shape[0], sort=sort, persist=persist)
        state = lsqml.LSQMLState(object=obj, probe=init_probe)
        adapter = LSQMLAdapter(options, valid)
        state, history = run_epochs(c, chunked, adapter, state, epochs=epochs,
                                    rounds_per_epoch=rounds_per_epoch, split_every=split_every,
                                    callbacks=callbacks, initialise=rescale_probe)
        del chunked

    run_options = dict(engine=engine, epochs=epochs, rounds_per_epoch=rounds_per_epoch, seed=seed,
                       chunk_length=chunk_length, split_every=split_every, **dataclasses.asdict(options))
    return Reconstruction(object=state.object, probe=state.probe, positions=frame_positions,
                          origin=origin, illumination=state.illumination, history=history,
                          options=run_options)
