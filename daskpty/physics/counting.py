"""Count what a chunk step costs: element-wise passes, bytes moved and FFTs, on the CPU.

:class:`PassCounter` is a context manager. Inside it NumPy's allocators (``empty``, ``zeros``,
``asarray``, …) return :class:`CountedArray` views, so the buffers an engine allocates and the
arrays it is given are all counted; every ufunc, array function or copying method on a counted
array is executed on plain ``ndarray`` views (the same NumPy call, so the same bits) and, when its
largest operand holds at least one pattern plane (``plane`` elements), recorded as one *pass*:
``elements / plane`` plane-passes, the bytes it reads (each input's distinct elements: a
broadcast operand counts once) and the bytes it writes. Views (slices, reshapes, window views)
cost nothing. The FFTs are counted at :func:`daskpty.physics.backend._transform`, which every
``fft2`` / ``ifft2`` of the physics and the engines reaches: one record per call with the 2-D
size, the number of transforms batched in it and the direction; an FFT's bytes are one read and
one write of its array (the floor of a batched transform that fits on chip).

``fused=True`` counts each call of the fused-kernel entry points of :mod:`daskpty.physics.kernels`
(:data:`FUSED_KERNELS`, the CuPy kernels of the GPU path) as one operation that reads its array
arguments once and writes its array results once, instead of the NumPy expressions they run on
the CPU: the traffic of the chunk step when each of those calls is a single pass.

Operations nested inside a recorded one (NumPy's own Python code, the FFT backends) are not
counted again. Smaller operations (per-pattern scalars, step systems) are tallied as calls only.
Used by ``benchmarks/bench_passes.py``; no dask, no effect on results.
"""
from __future__ import annotations

import contextlib
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from . import backend, kernels

COMPLEX64_BYTES = 8
_ALLOCATORS = ("empty", "zeros", "ones", "full", "asarray", "ascontiguousarray", "array", "empty_like",
               "zeros_like", "ones_like", "full_like")
_state = {"counter": None, "depth": 0}
#: the entry points of :mod:`daskpty.physics.kernels` that the GPU runs as fused CuPy kernels
FUSED_KERNELS = ("mode_intensity", "far_field_update", "far_field_loss", "object_gradient", "conj_product",
                 "step_dots", "object_step_dots", "poisson_alpha", "poisson_loss")


@dataclass
class OpTally:
    """One kind of operation: how often, how many plane-passes, bytes read and written."""

    calls: int = 0
    passes: float = 0.0
    read: int = 0
    written: int = 0

    def add(self, passes: float, read: int, written: int) -> None:
        self.calls += 1
        self.passes += passes
        self.read += read
        self.written += written


@dataclass
class Tally:
    """What a counted region did: element-wise ops by name, FFTs by (direction, n_y, n_x,
    transforms per call), and the calls below one plane."""

    ops: dict = field(default_factory=lambda: defaultdict(OpTally))
    ffts: dict = field(default_factory=lambda: defaultdict(OpTally))
    small_calls: int = 0

    @property
    def passes(self) -> float:
        return sum(t.passes for t in self.ops.values())

    @property
    def calls(self) -> int:
        return sum(t.calls for t in self.ops.values())

    @property
    def bytes_read(self) -> int:
        return sum(t.read for t in self.ops.values())

    @property
    def bytes_written(self) -> int:
        return sum(t.written for t in self.ops.values())

    @property
    def fft_bytes(self) -> int:
        return sum(t.read + t.written for t in self.ffts.values())

    @property
    def fft_calls(self) -> int:
        return sum(t.calls for t in self.ffts.values())

    def transforms(self, n_y: int | None = None, n_x: int | None = None) -> int:
        """How many 2-D transforms (batched ones counted one by one), of size (n_y, n_x) if given."""
        return sum(t.calls * key[3] for key, t in self.ffts.items()
                   if n_y is None or (key[1], key[2]) == (n_y, n_x))


class CountedArray(np.ndarray):
    """An ``ndarray`` whose operations a running :class:`PassCounter` records (see the module)."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        raw_in = _unwrap(inputs)
        if out is not None:
            kwargs["out"] = _unwrap(out)
        with _nested():
            result = getattr(ufunc, method)(*raw_in, **kwargs)
        name = ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}"
        if method == "at":
            _record_at(name, raw_in)
            return None
        outs = kwargs["out"] if out is not None else (result if isinstance(result, tuple) else (result,))
        _record(name, raw_in, outs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        raw_args, raw_kwargs = _unwrap(args), {k: _unwrap(v) for k, v in kwargs.items()}
        with _nested():
            result = func(*raw_args, **raw_kwargs)
        outs = _arrays(result)
        ins = _arrays((raw_args, raw_kwargs))
        if outs and not any(np.may_share_memory(o, i) for o in outs for i in ins):
            _record(func.__name__, ins, outs)   # views of an input cost nothing
        return _wrap(result)

    def __getitem__(self, key):
        raw = self.view(np.ndarray)
        with _nested():
            result = raw[_unwrap(key)]
        if isinstance(result, np.ndarray) and not np.may_share_memory(result, raw):   # a gather
            _record("gather", _arrays(_unwrap(key)) + [result], [result], gather=True)
        return _wrap(result)

    def __setitem__(self, key, value):
        raw, raw_value = self.view(np.ndarray), _unwrap(value)
        target = raw[_unwrap(key)] if isinstance(raw_value, np.ndarray) else None
        with _nested():
            raw[_unwrap(key)] = raw_value
        if target is not None and _same_memory(target, raw_value):
            return   # ``a[k] += b`` writes the view back onto itself: no copy
        region = raw[_unwrap(key)]
        ins = [raw_value] if isinstance(raw_value, np.ndarray) else []
        _record("setitem", ins, [region] if isinstance(region, np.ndarray) else [])

    def _method(name):
        def method(self, *args, **kwargs):
            raw = self.view(np.ndarray)
            with _nested():
                result = getattr(raw, name)(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
            if isinstance(result, np.ndarray) and not np.may_share_memory(result, raw):
                gather = name == "take"   # reads the taken elements, not the whole source
                _record(name, [result] if gather else [raw], [result], gather=gather)
            return _wrap(result)
        method.__name__ = name
        return method

    astype = _method("astype")
    copy = _method("copy")
    reshape = _method("reshape")
    ravel = _method("ravel")
    flatten = _method("flatten")
    take = _method("take")
    dot = _method("dot")
    del _method


class PassCounter:
    """Count the passes, bytes and FFTs of the NumPy code run inside ``with PassCounter(plane):``.

    ``plane``: elements of one pattern (n_y · n_x); an operation is a pass when its largest
    operand holds at least that many. ``fused``: count each :data:`FUSED_KERNELS` call as one
    pass (see the module). :attr:`tally` holds the counts; :meth:`wrap` makes any array counted
    (arrays allocated inside the block already are).
    """

    def __init__(self, plane: int, fused: bool = False):
        if plane < 1:
            raise ValueError(f"plane must be the pixels of one pattern (≥ 1), got {plane}")
        self.plane = int(plane)
        self.fused = bool(fused)
        self.tally = Tally()
        self._saved: dict = {}
        self._bound: list = []

    @staticmethod
    def wrap(a):
        return _wrap(a)

    def __enter__(self) -> "PassCounter":
        if _state["counter"] is not None:
            raise RuntimeError("a PassCounter is already counting: nest none inside another")
        _state["counter"], _state["depth"] = self, 0
        self._saved = {name: getattr(np, name) for name in _ALLOCATORS}
        self._saved["_transform"] = backend._transform
        for name in _ALLOCATORS:
            setattr(np, name, _counted_allocator(self._saved[name]))
        backend._transform = _counted_transform(self._saved["_transform"])
        if self.fused:
            self._bind_fused_kernels()
        return self

    def __exit__(self, *exc) -> None:
        for name in _ALLOCATORS:
            setattr(np, name, self._saved[name])
        backend._transform = self._saved["_transform"]
        for module, attr, function in self._bound:
            setattr(module, attr, function)
        self._bound = []
        _state["counter"] = None

    def _bind_fused_kernels(self) -> None:
        """Replace every daskpty module's binding of a :data:`FUSED_KERNELS` function (the
        engines call them as ``kernels.name`` or import the name) by its counting wrapper."""
        originals = {id(getattr(kernels, name)): name for name in FUSED_KERNELS}
        wrappers = {}
        for module in [m for k, m in list(sys.modules.items()) if k.startswith("daskpty") and m is not None]:
            for attr, value in list(vars(module).items()):
                name = originals.get(id(value))
                if name is not None and callable(value):
                    wrappers.setdefault(name, _fused_kernel(name, value))
                    self._bound.append((module, attr, value))
                    setattr(module, attr, wrappers[name])


def _counted_allocator(allocate):
    def allocator(*args, **kwargs):
        result = allocate(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
        return _wrap(result) if _state["depth"] == 0 else result
    allocator.__name__ = allocate.__name__
    return allocator


def _counted_transform(transform):
    def counted(a, inverse: bool, overwrite: bool):
        raw = _unwrap(a)
        with _nested():
            out = transform(raw, inverse, overwrite)
        counter = _state["counter"]
        if counter is not None and _state["depth"] == 0 and raw.ndim >= 2:
            n_y, n_x = raw.shape[-2:]
            batch = raw.size // max(1, n_y * n_x)
            counter.tally.ffts[("ifft2" if inverse else "fft2", n_y, n_x, batch)].add(
                batch * n_y * n_x / counter.plane, raw.nbytes, out.nbytes)
        return _wrap(out)
    return counted


def _fused_kernel(name: str, function):
    def fused(*args, **kwargs):
        with _nested():
            result = function(*args, **kwargs)
        ins = _arrays((_unwrap(args), {k: _unwrap(v) for k, v in kwargs.items() if k not in ("out", "work")}))
        _record(f"kernels.{name}", ins, _arrays(_unwrap(result)))
        return result
    fused.__name__ = name
    return fused


@contextlib.contextmanager
def _nested():
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1


def _unwrap(x):
    if isinstance(x, CountedArray):
        return x.view(np.ndarray)
    if isinstance(x, tuple):
        return tuple(_unwrap(v) for v in x)
    if isinstance(x, list):
        return [_unwrap(v) for v in x]
    return x


def _wrap(x):
    if type(x) is np.ndarray:
        return x.view(CountedArray)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


def _arrays(x) -> list:
    if isinstance(x, np.ndarray):
        return [x]
    if isinstance(x, (tuple, list)):
        return [a for v in x for a in _arrays(v)]
    if isinstance(x, dict):
        return [a for v in x.values() for a in _arrays(v)]
    return []


def _distinct_bytes(a: np.ndarray) -> int:
    """Bytes of the distinct elements of ``a`` (a broadcast axis, stride 0, counts once)."""
    return a.itemsize * math.prod(s for s, st in zip(a.shape, a.strides) if st != 0)


def _elements(a: np.ndarray) -> int:
    """Elements of ``a``, a real view of interleaved complex data (``z.view(float32)``) counted
    as the complex elements it holds, so that a dot product over it is one pass, not two."""
    if a.dtype.kind == "f" and a.ndim and a.strides[-1] == a.itemsize:
        base = a.base
        while isinstance(base, np.ndarray):
            if base.dtype.kind == "c" and base.itemsize == 2 * a.itemsize:
                return a.size // 2
            base = base.base
    return a.size


def _same_memory(a, b) -> bool:
    return (isinstance(b, np.ndarray) and a.shape == b.shape and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _counting():
    counter = _state["counter"]
    return counter if counter is not None and _state["depth"] == 0 else None


def _record(name: str, ins, outs, gather: bool = False) -> None:
    counter = _counting()
    if counter is None:
        return
    ins = [a for a in ins if isinstance(a, np.ndarray)]
    outs = [a for a in outs if isinstance(a, np.ndarray)]
    elements = max([_elements(a) for a in ins + outs], default=0)
    if elements < counter.plane:
        counter.tally.small_calls += 1
        return
    read = sum(a.nbytes if gather else _distinct_bytes(a) for a in ins)
    counter.tally.ops[name].add(elements / counter.plane, read, sum(a.nbytes for a in outs))


def _record_at(name: str, raw_in) -> None:
    """``ufunc.at(target, indices, values)``: reads the values, the indices and the targets hit,
    writes the targets hit."""
    counter = _counting()
    if counter is None:
        return
    target = raw_in[0]
    extra = [np.asarray(v) for v in raw_in[1:]]
    hits = max([v.size for v in extra], default=0)
    if hits < counter.plane:
        counter.tally.small_calls += 1
        return
    touched = hits * target.itemsize
    counter.tally.ops[name].add(hits / counter.plane, sum(v.nbytes for v in extra) + touched, touched)
