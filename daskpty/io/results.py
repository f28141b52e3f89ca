"""The result of a reconstruction and its Zarr v3 store (also the checkpoint format)."""
from __future__ import annotations

import copy
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import zarr

from .integrity import EVERY_CHUNK, WRITE_ALL, check_json_files, read_store_arrays
from .lock import StoreLock
from .pending_writes import despite_interrupts, settle_zarr_writes
from .safety import (FORMAT_VERSIONS, WRITING_MARKER, check_replaceable, clean_stale, intact_note, remove_tree,
                     write_error)

RECON_FORMAT = "daskpty-reconstruction"
RECON_VERSION = FORMAT_VERSIONS[RECON_FORMAT]


@dataclass
class Reconstruction:
    """Object, probe and history of a reconstruction.

    object: (H, W) complex64 (K slices: (K, H, W)); a dask array when a tiled run's object is
        large (:attr:`is_lazy`; written to a store by the workers, read back lazily from it).
        probe: (M, n, n) complex64, strongest mode first.
    positions: (N, 2) float64 in the object frame, in the data set's pattern order.
    origin: (y, x) object-pixel coordinates of scan position (0, 0): ``positions = data_positions + origin``.
    illumination: (H, W) float32 Σ|probe|² over the scan, e.g. to mask the reconstructed area.
    history: one dict per epoch (epoch, loss, seconds, patterns_per_second, step lengths, ...);
        :meth:`history_arrays` / :meth:`history_frame` give it per key. ``loss`` is the noise
        model's: with ``noise="poisson"`` the Poisson negative log-likelihood up to a constant of
        the data (0 for a model equal to the counts), else the amplitude least-squares misfit.
    options: the settings used (JSON-serialisable).
    nominal_positions: (N, 2) the positions as measured, in the object frame, when position
        refinement moved ``positions`` (else None: they are the nominal ones).
    probe_weights: (N, K) float64 OPR weights of every pattern (column 0: the mean probe's) in
        the eigen-probes' current basis (``reconstruct(opr_modes=K)``; else None).
    live: for a snapshot of a scan still being written (:func:`daskpty.workflows.follow`):
        ``frames_used`` (the data's frames it was made from), ``snapshot_unix`` (when it was
        made), ``started_unix`` (when following began) and whether the scan had ended; else None.
    geometry: the data set's geometry it was reconstructed with (wavelength, pixel sizes,
        distances, ``detector``: :func:`daskpty.io.export.geometry_from_metadata`), so an export
        describes it without the data; None when unknown.
    """

    object: np.ndarray
    probe: np.ndarray
    positions: np.ndarray
    origin: np.ndarray
    illumination: np.ndarray | None = None
    history: list = field(default_factory=list)
    options: dict = field(default_factory=dict)
    epoch: int = 0
    engine_state: dict = field(default_factory=dict)
    nominal_positions: np.ndarray | None = None
    probe_weights: np.ndarray | None = None
    live: dict | None = None
    geometry: dict | None = None

    @property
    def eigen_probes(self) -> np.ndarray | None:
        """OPR eigen-probes U_1 … U_{K−1} (K−1, n, n) (U_0 is ``probe[0]``), or None."""
        return self.engine_state.get("opr_eigen_probes")

    @property
    def intensity_scale(self) -> np.ndarray | None:
        """Per-pattern intensity factors (N,) (``reconstruct(fit_intensity=True)``), or None."""
        v = self.engine_state.get("pattern_intensity_scale")
        return None if v is None else np.asarray(v)[:, 0]

    @property
    def background(self) -> np.ndarray | None:
        """The fitted background, (1, 1) (constant) or (n, n) DC at the centre, or None."""
        v = self.engine_state.get("background")
        return None if v is None else np.fft.fftshift(v) if np.shape(v) != (1, 1) else np.asarray(v)

    @property
    def epochs(self) -> int:
        """Completed epochs (including those of runs this one resumed)."""
        return self.epoch or len(self.history)

    def history_arrays(self) -> dict:
        """The history as one NumPy array per key, over the epochs in order: float64 with NaN
        where an epoch lacks the key (or holds None); a key with non-scalar values (e.g. lists)
        gives an object array with None there."""
        keys = list(dict.fromkeys(k for entry in self.history for k in entry))
        out = {}
        for key in keys:
            values = [entry.get(key) for entry in self.history]
            if all(v is None or np.ndim(v) == 0 and not isinstance(v, str) for v in values):
                out[key] = np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
            else:
                column = np.empty(len(values), dtype=object)
                column[:] = values
                out[key] = column
        return out

    def history_frame(self):
        """The history as a pandas DataFrame, one row per epoch indexed by ``epoch`` (needs pandas;
        :meth:`history_arrays` does not)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Reconstruction.history_frame() needs pandas (pip install pandas); "
                              "history_arrays() gives the same columns as NumPy arrays") from None
        frame = pd.DataFrame(self.history_arrays())
        return frame.set_index("epoch") if "epoch" in frame else frame

    def illuminated(self, fraction: float = 0.1) -> np.ndarray:
        """Boolean mask of object pixels whose illumination exceeds ``fraction`` of its maximum."""
        if self.illumination is None:
            return np.ones(self.object.shape, dtype=bool)
        return self.illumination > fraction * self.illumination.max()

    def to_zarr(self, path: str, *, overwrite: bool = False) -> str:
        """Write the reconstruction store atomically.

        The new store is written completely beside the target (``PATH.partial-*``), then swapped in
        by renames: ``PATH`` → ``PATH.previous``, new → ``PATH``, then ``PATH.previous`` is removed.
        A crash at any moment leaves a complete store at ``PATH`` or, between the two renames, at
        ``PATH.previous`` (which :meth:`from_zarr` falls back to). No pickle is stored. Only a
        daskpty store (or an empty directory) is ever replaced; the write holds ``PATH.lock``
        (:class:`daskpty.io.lock.StoreLock`), removes leftovers of killed writes, and reports a
        full or read-only disk in one line (:class:`daskpty.io.safety.StoreWriteError`).
        """
        path = os.fspath(path).rstrip("/")
        previous = path + ".previous"
        if (os.path.lexists(path) or os.path.lexists(previous)) and not overwrite:
            raise FileExistsError(f"{path} exists; choose another output path or pass overwrite=True")
        with StoreLock(path):
            check_replaceable(path)  # never replace what daskpty did not write
            check_replaceable(previous)
            clean_stale(path)
            tmp = f"{path}.partial-{uuid.uuid4().hex[:8]}"
            try:
                root = zarr.open_group(tmp, mode="w", zarr_format=3)
                open(os.path.join(tmp, WRITING_MARKER), "x").close()
                self._write(root)
                os.remove(os.path.join(tmp, WRITING_MARKER))
            except BaseException as exc:
                _discard(tmp)
                err = write_error(exc, f"writing the reconstruction (epoch {self.epochs}) to", path,
                                  intact_note(path)) if isinstance(exc, OSError) else None
                if err is not None:
                    raise err from None
                raise
            if os.path.lexists(path):
                if os.path.lexists(previous):
                    remove_tree(previous)  # a daskpty store (checked above)
                os.replace(path, previous)
            os.replace(tmp, path)
            remove_tree(previous)
        return path

    def _write(self, root) -> None:
        arrays = [("object", self.object), ("probe", self.probe), ("positions", self.positions)]
        if self.nominal_positions is not None:
            arrays.append(("nominal_positions", self.nominal_positions))
        if self.probe_weights is not None:
            arrays.append(("probe_weights", self.probe_weights))

        if self.illumination is not None:
            arrays.append(("illumination", _as_array(self.illumination).astype(np.float32, copy=False)))
        for name, arr in arrays:
            _write_array(root, name, _as_array(arr), config=WRITE_ALL)
        state = root.create_group("engine_state")
        for name, arr in self.engine_state.items():
            _write_array(state, name, _as_array(arr), config=WRITE_ALL)
        root.attrs.update({  # written last: every chunk (all-zero ones too) is on disk
            "daskpty": {"format": RECON_FORMAT, "version": RECON_VERSION, EVERY_CHUNK: True},
            "origin": [float(v) for v in self.origin],
            "epoch": int(self.epochs),
            "history": _jsonable(self.history),
            "options": _jsonable(self.options),
            **({"live": _jsonable(self.live)} if self.live is not None else {}),
            **({"geometry": _jsonable(self.geometry)} if self.geometry else {}),
        })

    @property
    def is_lazy(self) -> bool:
        """True when the object is a dask array (a large object from a tiled run: see
        :mod:`daskpty.execution.tile_results`); ``numpy.asarray(rec.object)`` computes it."""
        return is_lazy(self.object)

    def reading_arrays_from(self, path: str) -> "Reconstruction":
        """This reconstruction with each of its dask arrays replaced by the same array read lazily
        from the store at ``path`` (written by :meth:`to_zarr`): it then needs no cluster."""
        import dask.array as da

        root = zarr.open_group(os.fspath(path), mode="r")

        def reopened(group, name, value):
            return da.from_zarr(group[name]) if is_lazy(value) else value

        out = copy.copy(self)
        for name in ("object", "illumination"):
            setattr(out, name, reopened(root, name, getattr(self, name)))
        out.engine_state = {k: reopened(root["engine_state"], k, v) for k, v in self.engine_state.items()}
        return out

    def computed(self) -> "Reconstruction":
        """This reconstruction with its dask arrays computed (gathered into NumPy arrays)."""
        import dask

        lazy = {k: v for k, v in [("object", self.object), ("illumination", self.illumination),
                                  *[(f"engine_state/{k}", v) for k, v in self.engine_state.items()]] if is_lazy(v)}
        values = dict(zip(lazy, dask.compute(*lazy.values())))
        out = copy.copy(self)
        out.object = values.get("object", self.object)
        out.illumination = values.get("illumination", self.illumination)
        out.engine_state = {k: values.get(f"engine_state/{k}", v) for k, v in self.engine_state.items()}
        return out

    @classmethod
    def from_zarr(cls, path: str, *, lazy: bool = False) -> "Reconstruction":
        """Read a reconstruction store written by :meth:`to_zarr`. ``lazy``: the object and the
        illumination as dask arrays read chunk by chunk when used (a large object)."""
        path = os.fspath(path).rstrip("/")
        if not os.path.exists(path) and os.path.exists(path + ".previous"):
            path = path + ".previous"  # a swap was interrupted between its two renames
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no reconstruction store at {path}")

        check_json_files(path)  # a truncated zarr.json is named
        try:
            root = zarr.open_group(path, mode="r")
        except Exception as exc:
            raise ValueError(f"{path} is not a daskpty reconstruction store ({exc})") from None
        meta = dict(root.attrs).get("daskpty", {})
        if meta.get("format") != RECON_FORMAT:
            raise ValueError(f"{path} is not a daskpty reconstruction store")
        if int(meta.get("version", 0)) > RECON_VERSION:
            raise ValueError(f"{path} has format version {meta['version']}, newer than this daskpty "
                             f"reads ({RECON_VERSION}); upgrade daskpty")
        # every chunk present and decodable, else one line naming the file (zarr reads a missing one as 0)
        a = read_store_arrays(root, path, every_chunk=bool(meta.get(EVERY_CHUNK)),
                              lazy=("object", "illumination") if lazy else ())
        engine_state = {k.split("/", 1)[1]: v for k, v in a.items() if k.startswith("engine_state/")}
        probe = a["probe"][None] if np.ndim(a["probe"]) == 2 else a["probe"]  # (n, n): one mode
        return cls(object=a["object"], probe=probe, positions=a["positions"],
                   origin=np.asarray(root.attrs["origin"], dtype=np.float64), illumination=a.get("illumination"),
                   history=list(root.attrs.get("history", [])), options=dict(root.attrs.get("options", {})),
                   epoch=_stored_epoch(root.attrs.get("epoch", 0), path), engine_state=engine_state,
                   nominal_positions=a.get("nominal_positions"), probe_weights=a.get("probe_weights"),
                   live=root.attrs.get("live"), geometry=root.attrs.get("geometry"))


def stored_geometry(path) -> dict:
    """The geometry a reconstruction store at ``path`` was written with ({} when it holds none),
    read from its attributes alone."""
    path = os.fspath(path).rstrip("/")
    if not os.path.isdir(path) and os.path.isdir(path + ".previous"):
        path = path + ".previous"
    try:
        return dict(zarr.open_group(path, mode="r").attrs.get("geometry") or {})
    except Exception:
        return {}


def _stored_epoch(value, path) -> int:
    """The ``epoch`` attribute of the store at ``path`` as a count of epochs, or one line naming the
    store and the field (a hand-edited or damaged store: -5 would make a resumed run count from
    -4, "abc" would fail deep inside ``int()``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{path}: its 'epoch' attribute (zarr.json) is {value!r}, not a count of epochs "
                         f"(an integer >= 0); the store was edited or damaged: restore it from a copy, or "
                         f"start afresh without resuming from it")
    return value


def _discard(tmp: str, timeout: float = 2.0) -> None:
    """Remove a partial store, also when an interrupt stopped the wait for zarr's background
    writes: those are let finish first (:func:`settle_zarr_writes`, bounded: the interrupt guard
    ends a run 5 s after a second Ctrl-C), and any file they still create is removed again. A
    further Ctrl-C does not cut the removal short (:func:`despite_interrupts`)."""
    deadline = time.monotonic() + timeout

    def remove():
        while True:
            settle_zarr_writes()
            shutil.rmtree(tmp, ignore_errors=True)
            time.sleep(0.05)
            if not os.path.lexists(tmp) or time.monotonic() > deadline:
                return

    despite_interrupts(remove)


def is_lazy(arr) -> bool:
    """True for a dask array (anything with a task graph and chunks that is not NumPy)."""
    return hasattr(arr, "dask") and hasattr(arr, "chunks") and not isinstance(arr, np.ndarray)


def _as_array(arr):
    return arr if is_lazy(arr) else np.asarray(arr)


def _write_array(group, name: str, arr: np.ndarray, **create) -> None:
    """One array of the store, written one row of chunks at a time: zarr then encodes a few
    chunks at once instead of the whole (object-sized) array. A dask array is written by its
    own tasks (on a cluster: by the workers that hold its blocks, e.g. each its object tile),
    rechunked to the store's chunks first so that no two tasks write one chunk."""
    chunks = _chunks_for(arr)
    a = group.create_array(name, shape=arr.shape, dtype=arr.dtype, chunks=chunks, **create)
    if is_lazy(arr):
        import dask.array as da

        da.store(arr.rechunk(chunks), a, lock=False)
        return
    if arr.ndim < 2 or chunks == arr.shape:
        a[...] = arr
        return
    rows = chunks[-2]
    for start in range(0, arr.shape[-2], rows):
        a[..., start:start + rows, :] = arr[..., start:start + rows, :]


def _chunks_for(arr: np.ndarray):
    if arr.ndim >= 2 and arr.shape[-1] * arr.shape[-2] * arr.dtype.itemsize > 16 * 2**20:
        return arr.shape[:-2] + (min(arr.shape[-2], 1024), min(arr.shape[-1], 1024))
    return arr.shape


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
