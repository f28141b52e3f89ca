"""A data-set store that grows while it is read: :class:`ScanWriter` appends frames block by
block, :class:`LiveStore` reads what is committed so far.

The layout and commit protocol are in :mod:`.live_format` and docs/data-format.md. Each
:meth:`ScanWriter.append` is one block: its frames and positions are written into the chunk
files, the files are fsynced, and only then is the commit record replaced, so a reader never
sees part of a block and a writer killed mid-block leaves the store readable at its last
commit. :meth:`ScanWriter.close` ends the scan: the arrays are cut to the committed length and
the store becomes an ordinary data-set store for every other command.

Example: a Bluesky-style callback (``RE.subscribe(callback)``) writing each run into a store::

    import numpy as np
    from daskpty import ScanWriter

    class DaskptyCallback:
        def __init__(self, path, **geometry):
            self.path, self.geometry, self.writer = path, geometry, None

        def __call__(self, name, doc):
            if name == "start":
                self.writer = ScanWriter(self.path, pattern_shape=(256, 256), dtype="uint32",
                                         planned_frames=doc.get("num_points"), **self.geometry)
            elif name == "event_page":          # a batch of events: one block
                d = doc["data"]
                self.writer.append(np.asarray(d["eiger_image"]),
                                   np.stack([d["sample_y_px"], d["sample_x_px"]], axis=1))
            elif name == "stop":
                self.writer.close()             # the scan's end: an ordinary store from now on
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zarr

from .integrity import WRITE_ALL
from .lock import StoreLock
from .live_format import (LIVE_ATTR, LIVE_FORMAT_VERSION, fsync_path, is_live, new_record, read_record,
                          write_record, writer_note)
from .metadata import check_truth, make_metadata
from .validate import check_intensity_layout, check_mask, check_probe, fail
from .writing import DEFAULT_INNER_BYTES, _compressor, atomic_store, create_store

#: when the scan's length is not declared, the arrays start this many chunks long and double
GROWTH_CHUNKS = 4


def chunk_frames(pattern_shape, dtype, chunk_bytes: int = DEFAULT_INNER_BYTES, planned=None) -> int:
    """Frames per chunk of a live store: ``chunk_bytes`` worth, at least one, at most the plan."""
    h, w = pattern_shape
    c = max(1, int(chunk_bytes) // max(1, h * w * np.dtype(dtype).itemsize))
    return min(c, planned) if planned else c


class ScanWriter:
    """Write a scan into a new live data-set store while it is acquired.

    ``path``: the store to create (an existing one is refused unless ``overwrite=True``);
    ``pattern_shape`` (n, n) and ``dtype`` (uint16, uint32 or float32) of the frames;
    ``planned_frames``: the scan's length when known (None: the arrays grow as frames come);
    ``mask``, ``probe``, ``truth`` as for :func:`daskpty.from_arrays`; geometry keywords
    (``wavelength_m``, ``detector_distance_m``, ``detector_pixel_size_m``, ``provenance``,
    ``metadata``, ...) go to :func:`~daskpty.io.metadata.make_metadata`, or ``attributes``
    gives the store's complete root attributes (from ``make_metadata``) instead.

    :meth:`append` writes one block, :meth:`close` ends the scan. As a context manager the scan
    ends when the block exits normally; on an exception it is left resumable
    (:meth:`resume`), like a writer that was killed. One writer per store: the store's lock is
    held until :meth:`close` or :meth:`stop`. Call it from one thread; each append fsyncs, so
    append batches of frames (a few blocks per second), not single frames at a high rate.
    """

    def __init__(self, path, *, pattern_shape, dtype="uint16", planned_frames: int | None = None,
                 mask=None, probe=None, truth=None, attributes: dict | None = None,
                 overwrite: bool = False, chunk_bytes: int = DEFAULT_INNER_BYTES, **geometry):
        h, w = (int(s) for s in pattern_shape)
        dtype = np.dtype(dtype)
        check_intensity_layout((1, h, w), dtype)
        if planned_frames is not None and int(planned_frames) < 1:
            raise ValueError(f"planned_frames must be a positive number of frames or None, got "
                             f"{planned_frames}")
        planned = None if planned_frames is None else int(planned_frames)
        if attributes is not None and geometry:
            raise ValueError(f"give the geometry ({', '.join(sorted(geometry))}) or attributes, "
                             f"not both")
        attrs = dict(attributes) if attributes is not None else make_metadata(pattern_size=h, **geometry)
        chunk = chunk_frames((h, w), dtype, chunk_bytes, planned)
        attrs[LIVE_ATTR] = {"format_version": LIVE_FORMAT_VERSION, "planned_frames": planned,
                            "chunk_frames": chunk}
        path = os.path.abspath(os.fspath(path))
        self._lock = StoreLock(path).acquire()
        try:
            capacity = planned or GROWTH_CHUNKS * chunk
            with atomic_store(path, overwrite=overwrite) as tmp:
                _create(tmp, (capacity, h, w), dtype, chunk, attrs, check_mask(mask, (h, w)),
                        check_probe(probe, (h, w)), check_truth(truth, (h, w)))
                write_record(tmp, new_record(planned))
            _fsync_tree(path)
            fsync_path(os.path.dirname(path))
            self._attach(path)
        except BaseException:
            self._lock.release()
            raise

    @classmethod
    def resume(cls, path) -> "ScanWriter":
        """Go on writing a live store whose writer stopped (killed, or :meth:`stop`) before the
        scan's end: appends continue after its last committed frame."""
        path = os.path.abspath(os.fspath(path))
        self = cls.__new__(cls)
        self._lock = StoreLock(path).acquire()
        try:
            group = zarr.open_group(path, mode="r")
            if not is_live(group.attrs):
                fail(f"{path} is not a live store (no '{LIVE_ATTR}' attribute); only a store made by "
                     f"daskpty.ScanWriter can be resumed")
            record = read_record(path)
            if record.get("ended"):
                fail(f"{path}: the scan already ended at {record['frames_committed']:,} frames; "
                     f"nothing to resume")
            _remove_leftovers(path)
            self._attach(path)
        except BaseException:
            self._lock.release()
            raise
        return self

    def _attach(self, path: str) -> None:
        group = zarr.open_group(path, mode="r+")
        self.path = path
        self._inten, self._pos = group["intensities"], group["positions"]
        self._record = read_record(path)
        self._chunk = int(self._inten.chunks[0])
        self._closed = False

    # ------------------------------------------------------------------ state

    @property
    def frames_committed(self) -> int:
        """Frames readers can see now."""
        return int(self._record["frames_committed"])

    @property
    def planned_frames(self) -> int | None:
        return self._record.get("planned_frames")

    @property
    def pattern_shape(self) -> tuple[int, int]:
        return tuple(int(s) for s in self._inten.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self._inten.dtype

    # ------------------------------------------------------------------ writing

    def append(self, frames, positions) -> int:
        """Append one block: ``frames`` (k, n, n) (or one (n, n) frame) and their ``positions``
        (k, 2) (y, x) object pixels. Returns the frames committed after it; readers see the block
        only once all of its bytes are on disk."""
        self._check_open()
        frames, positions = self._block(frames, positions)
        n, k = self.frames_committed, len(frames)
        if k == 0:
            return n
        planned = self.planned_frames
        if planned is not None and n + k > planned:
            raise ValueError(f"appending {k:,} frames to {n:,} exceeds the planned "
                             f"{planned:,}; declare planned_frames=None for a scan of unknown length")
        if n + k > self._inten.shape[0]:
            self._grow(n + k)
        self._inten[n:n + k] = frames
        self._pos[n:n + k] = positions
        self._sync_rows(n, n + k)
        self._commit(frames_committed=n + k, blocks=int(self._record["blocks"]) + 1)
        return n + k

    def close(self) -> None:
        """End the scan: cut the arrays to the committed frames, record the end (last), release
        the store. From then on it is an ordinary data-set store. Idempotent."""
        if self._closed:
            return
        n = self.frames_committed
        try:
            if n == 0:
                raise ValueError(f"{self.path}: no frame was appended, so the scan cannot end; "
                                 f"append frames first, or remove the store")
            if self._inten.shape[0] != n:
                self._inten.resize((n, *self.pattern_shape))
                self._pos.resize((n, 2))
                for arr in (self._inten, self._pos):
                    fsync_path(os.path.join(self.path, arr.path, "zarr.json"))
            self._commit(ended=True)
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop writing without ending the scan: release the store's lock; the store stays
        readable at its committed frames and :meth:`resume` goes on from there."""
        if not self._closed:
            self._closed = True
            self._lock.release()

    def __enter__(self) -> "ScanWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.stop()

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return (f"ScanWriter({self.path!r}, {_of(self.frames_committed, self.planned_frames)} "
                f"committed, {state})")

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: this writer is closed; open another with "
                             f"ScanWriter.resume(path) if the scan has not ended")

    def _block(self, frames, positions):
        frames = np.asarray(frames)
        if frames.ndim == 2:
            frames = frames[None]
        positions = np.asarray(positions, dtype=np.float64)
        if positions.ndim == 1:
            positions = positions[None]
        if frames.ndim != 3 or tuple(frames.shape[1:]) != self.pattern_shape:
            raise ValueError(f"frames have shape {frames.shape}; expected (k, {self.pattern_shape[0]}, "
                             f"{self.pattern_shape[1]}) frames of this scan")
        if positions.shape != (len(frames), 2):
            raise ValueError(f"positions have shape {positions.shape}; expected ({len(frames)}, 2), "
                             f"one (y, x) per frame")
        if not np.isfinite(positions).all():
            raise ValueError("positions hold NaN or infinite values; give every frame its position")
        return _as_stored(frames, self.dtype), positions

    def _grow(self, needed: int) -> None:
        """Lengthen both arrays (a scan of undeclared length): double, in whole chunks."""
        c = self._chunk
        capacity = max(2 * self._inten.shape[0], math.ceil(needed / c) * c)
        self._inten.resize((capacity, *self.pattern_shape))
        self._pos.resize((capacity, 2))
        for arr in (self._inten, self._pos):
            fsync_path(os.path.join(self.path, arr.path, "zarr.json"))

    def _sync_rows(self, start: int, stop: int) -> None:
        """fsync the chunk files holding frames ``start .. stop-1`` (at once: the file system
        groups them into one journal commit), then the arrays' directories (the renames)."""
        files, dirs = [], set()
        for arr in (self._inten, self._pos):
            for row in range(start // self._chunk, (stop - 1) // self._chunk + 1):
                key = arr.metadata.encode_chunk_key((row,) + (0,) * (arr.ndim - 1))
                files.append(os.path.join(self.path, arr.path, key))
                dirs.add(os.path.dirname(files[-1]))
        with ThreadPoolExecutor(min(8, len(files))) as pool:
            list(pool.map(fsync_path, files))
        for d in dirs:
            fsync_path(d)

    def _commit(self, **changes) -> None:
        record = {**self._record, **changes, "updated_unix": time.time()}
        write_record(self.path, record)
        self._record = record


@dataclasses.dataclass(frozen=True)
class LiveStatus:
    """Where a live store stands: frames committed, the plan, whether the scan ended."""

    frames_committed: int
    planned_frames: int | None
    ended: bool
    blocks: int
    updated_unix: float
    writer: str

    def describe(self) -> str:
        """'live: 1,234 of 6,400 frames (writer running ...)' or 'ended at 1,234 frames'."""
        if self.ended:
            planned = f" ({self.planned_frames:,} planned)" if self.planned_frames else ""
            return f"ended at {self.frames_committed:,} frames{planned}"
        return f"live: {_of(self.frames_committed, self.planned_frames)}, {self.writer}"


class LiveStore:
    """Read a live store while it is written: :meth:`status`, :meth:`snapshot`, :meth:`wait`."""

    def __init__(self, path):
        self.path = os.path.abspath(os.fspath(path))
        group = zarr.open_group(self.path, mode="r")
        if not is_live(group.attrs):
            fail(f"{self.path} is not a live store (no '{LIVE_ATTR}' attribute); open it with "
                 f"daskpty.open_data")

    def status(self) -> LiveStatus:
        r = read_record(self.path)
        ended = bool(r.get("ended"))
        return LiveStatus(frames_committed=int(r["frames_committed"]),
                          planned_frames=r.get("planned_frames"), ended=ended,
                          blocks=int(r.get("blocks", 0)), updated_unix=float(r.get("updated_unix", 0)),
                          writer="" if ended else writer_note(self.path))

    def snapshot(self, validate: str | None = "metadata"):
        """The committed frames as a :class:`~daskpty.io.store.PtychoData` (fixed: later blocks
        do not change it)."""
        from .store import open_data

        return open_data(self.path, validate=validate, frames="committed")

    def wait(self, frames: int | None = None, timeout: float = 60.0, poll: float = 0.05) -> LiveStatus:
        """Wait until ``frames`` are committed (None: the scan's end) or the scan ended; a
        TimeoutError after ``timeout`` seconds names where the store stands."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.status()
            if s.ended or (frames is not None and s.frames_committed >= frames):
                return s
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path}: {s.describe()} after {timeout:g} s of waiting")
            time.sleep(poll)


# --------------------------------------------------------------------------- helpers

def _of(n, planned) -> str:
    return f"{n:,} of {planned:,} frames" if planned else f"{n:,} frames"


def _create(root, shape, dtype, chunk, attrs, mask, probe, truth) -> None:
    """The live store's group at ``root``: the ordinary layout (:func:`create_store`), with
    ``intensities`` and ``positions`` chunked along N and not sharded (see
    :mod:`.live_format`); positions not yet written read as NaN."""
    n, h, w = shape
    create_store(root, shape=(1, h, w), dtype=dtype, shard_len=1, inner_len=1,
                 positions=np.zeros((1, 2)), mask=mask, probe=probe, metadata=attrs, truth=truth)
    group = zarr.open_group(root, mode="r+")
    flat = {"name": "default", "separator": "."}  # chunk files side by side: one directory to fsync
    group.create_array("intensities", shape=(n, h, w), dtype=dtype, chunks=(chunk, h, w),
                       compressors=_compressor(dtype), fill_value=0, chunk_key_encoding=flat,
                       dimension_names=("pattern", "y", "x"), config=WRITE_ALL, overwrite=True)
    group.create_array("positions", shape=(n, 2), dtype=np.float64, chunks=(chunk, 2),
                       fill_value=np.nan, chunk_key_encoding=flat, dimension_names=("pattern", "axis"), config=WRITE_ALL,
                       overwrite=True)


def _fsync_tree(root: str) -> None:
    """fsync every file and directory of a newly created store (a few small files)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def _remove_leftovers(root: str) -> None:
    """Temporary files a killed writer left: zarr's chunk files being written, the record's."""
    for pattern in ("intensities/*.partial", "positions/*.partial", "live.json.tmp-*"):
        for file in glob.glob(os.path.join(glob.escape(root), pattern), recursive=True):
            with contextlib.suppress(FileNotFoundError):
                os.remove(file)


def _as_stored(frames: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``frames`` in the store's dtype; integer stores take only whole, in-range values."""
    if frames.dtype == dtype or np.can_cast(frames.dtype, dtype, "safe"):
        return frames.astype(dtype, copy=False)
    if frames.dtype.kind not in "biuf":
        raise ValueError(f"frames are {frames.dtype}; the store holds {dtype} counts")
    if dtype.kind in "iu" and frames.size:
        info = np.iinfo(dtype)
        lo, hi = frames.min(), frames.max()
        if lo < info.min or hi > info.max or (frames.dtype.kind == "f" and not np.all(np.mod(frames, 1) == 0)):
            raise ValueError(f"frames of {frames.dtype} hold values ({lo} .. {hi}) that {dtype} "
                             f"cannot store exactly; create the store with a wider dtype")
    return frames.astype(dtype)


__all__ = ["LiveStatus", "LiveStore", "ScanWriter", "chunk_frames"]
