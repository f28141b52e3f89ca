"""Additive partial results of a chunk step, merged by the execution layer's tree reduce.

Object-sized quantities live on the bounding box of a chunk's footprint (``BoxedArray``),
so the bytes moved per round scale with each chunk's scan footprint, not the object size.
Adding two partials is associative: boxes merge into their union.
"""
from __future__ import annotations

from dataclasses import dataclass, field


from ..physics.backend import get_xp, to_numpy


@dataclass
class BoxedArray:
    """An array ``data`` (..., h, w) placed at ``offset`` (y0, x0) of a larger 2-D frame."""

    offset: tuple[int, int]
    data: object

    @property
    def stop(self) -> tuple[int, int]:
        return (self.offset[0] + self.data.shape[-2], self.offset[1] + self.data.shape[-1])

    def __add__(self, other: "BoxedArray") -> "BoxedArray":
        if other is None:
            return self
        y0 = min(self.offset[0], other.offset[0])
        x0 = min(self.offset[1], other.offset[1])
        y1 = max(self.stop[0], other.stop[0])
        x1 = max(self.stop[1], other.stop[1])
        if (y0, x0, y1, x1) == (*self.offset, *self.stop):
            out = self.data.copy()
        else:
            xp = get_xp(self.data)
            out = xp.zeros(self.data.shape[:-2] + (y1 - y0, x1 - x0), dtype=self.data.dtype)
            out[..., self.offset[0] - y0:self.stop[0] - y0, self.offset[1] - x0:self.stop[1] - x0] += self.data
        out[..., other.offset[0] - y0:other.stop[0] - y0, other.offset[1] - x0:other.stop[1] - x0] += other.data
        return BoxedArray((y0, x0), out)

    def add_into(self, frame) -> None:
        """Add this box into a full frame (in place)."""
        frame[..., self.offset[0]:self.stop[0], self.offset[1]:self.stop[1]] += self.data

    def to_numpy(self) -> "BoxedArray":
        return BoxedArray(self.offset, to_numpy(self.data))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass
class Partial:
    """Sum of per-chunk results: boxed object-frame arrays, probe-frame arrays and scalars.

    ``boxes`` and ``arrays`` are dicts of same-keyed entries; ``scalars`` are float64 sums.
    Missing keys on one side are treated as zero.

    ``local`` is not a sum: the per-pattern state a chunk step updated (refined positions and
    their optimiser memory). From an engine's chunk step it holds the updated arrays of the
    step's patterns (``{name: (B, ...) array}``); the execution layer re-keys it by chunk index
    (``{chunk: {name: array}}``), and adding partials takes the union of those (chunks are
    disjoint). Epoch graphs keep it on the chunk's worker and never reduce it.
    """

    boxes: dict = field(default_factory=dict)
    arrays: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)
    local: dict = field(default_factory=dict)

    def __add__(self, other: "Partial") -> "Partial":
        if other is None:
            return self
        boxes = dict(self.boxes)
        for k, v in other.boxes.items():
            boxes[k] = boxes[k] + v if k in boxes else v
        arrays = dict(self.arrays)
        for k, v in other.arrays.items():
            arrays[k] = arrays[k] + v if k in arrays else v
        scalars = dict(self.scalars)
        for k, v in other.scalars.items():
            scalars[k] = scalars.get(k, 0.0) + v
        return Partial(boxes, arrays, scalars, {**self.local, **other.local})

    def __radd__(self, other):
        if other == 0 or other is None:
            return self
        return NotImplemented

    def to_numpy(self) -> "Partial":
        """Host copy (CuPy → NumPy), so reduced results can leave a GPU worker."""
        return Partial({k: v.to_numpy() for k, v in self.boxes.items()},
                       {k: to_numpy(v) for k, v in self.arrays.items()},
                       {k: float(v) for k, v in self.scalars.items()},
                       _local_to_numpy(self.local))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.boxes.values()) + sum(int(a.nbytes) for a in self.arrays.values())


def _local_to_numpy(local: dict) -> dict:
    return {k: _local_to_numpy(v) if isinstance(v, dict) else to_numpy(v) for k, v in local.items()}


def _sum_boxes(boxes: list) -> BoxedArray:
    """Sum of boxed arrays into one union box allocated once, added left to right."""
    if len(boxes) == 1:
        return BoxedArray(boxes[0].offset, boxes[0].data.copy())
    out = _zeros_union(boxes)
    for b in boxes:
        _add_box(out, b)
    return out


def _zeros_union(boxes: list) -> BoxedArray:
    """Zeros over the union of ``boxes`` (their dtype and leading shape)."""
    y0, x0 = min(b.offset[0] for b in boxes), min(b.offset[1] for b in boxes)
    y1, x1 = max(b.stop[0] for b in boxes), max(b.stop[1] for b in boxes)
    like = boxes[0].data
    return BoxedArray((y0, x0), get_xp(like).zeros(like.shape[:-2] + (y1 - y0, x1 - x0), dtype=like.dtype))


def _add_box(out: BoxedArray, box: BoxedArray) -> None:
    """``out`` += ``box`` over ``box``'s rows and columns (in place; ``out`` holds it)."""
    (y0, x0) = out.offset
    out.data[..., box.offset[0] - y0:box.stop[0] - y0, box.offset[1] - x0:box.stop[1] - x0] += box.data


def _small_sums(parts: list) -> tuple:
    """The probe-frame arrays and scalars of ``parts`` (no None) summed left to right, and their
    per-pattern states merged: ``(arrays, scalars, local)``."""
    arrays, scalars, local = {}, {}, {}
    for p in parts:
        for k, v in p.arrays.items():
            arrays[k] = arrays[k] + v if k in arrays else v
        for k, v in p.scalars.items():
            scalars[k] = scalars.get(k, 0.0) + v
        local.update(p.local)
    return arrays, scalars, local


def covers(acc: Partial, parts) -> bool:
    """Whether ``acc``'s boxes hold every box of ``parts`` (same keys, each box inside)."""
    for part in parts:
        for key, box in part.boxes.items():
            own = acc.boxes.get(key)
            if own is None or box.offset[0] < own.offset[0] or box.offset[1] < own.offset[1] \
                    or box.stop[0] > own.stop[0] or box.stop[1] > own.stop[1]:
                return False
    return True


def sum_partials_into(parts: list, at: int) -> Partial:
    """:func:`sum_partials` of ``parts`` written into the boxes of ``parts[at]``, whose boxes must
    hold every other's (:func:`covers`), without a new object-sized array; ``parts[at]`` is
    changed. Per pixel the same additions in the same order, so the same values (a float sum of
    two terms does not depend on their order: the parts before ``at`` are summed first, as
    :func:`sum_partials` would, then added to it; the sign of a zero may differ)."""
    acc = parts[at]
    before = [p for p in parts[:at] if p is not None]
    prefix = sum_partials(*before) if before else None
    for key, box in acc.boxes.items():
        for part in ([prefix] if prefix is not None else []) + [p for p in parts[at + 1:] if p is not None]:
            if key in part.boxes:
                _add_box(box, part.boxes[key])
    return Partial(dict(acc.boxes), *_small_sums([p for p in parts if p is not None]))


def sum_partials_releasing(parts: list, release=None) -> Partial:
    """:func:`sum_partials` of the list ``parts``, letting each part go once added (its entry set
    to None; ``release()`` is then called, e.g. to hand freed memory back): the union boxes fill
    as the parts empty. Per pixel the same additions in the same order."""
    present = [i for i, p in enumerate(parts) if p is not None]
    if len(present) <= 1:
        return parts[present[0]] if present else None
    small = _small_sums([parts[i] for i in present])
    # (zeros: pages the system hands out as they are first written, while the parts go)
    unions = {key: _zeros_union([parts[i].boxes[key] for i in present if key in parts[i].boxes])
              for key in dict.fromkeys(k for i in present for k in parts[i].boxes)}
    for i in present:
        for key, box in parts[i].boxes.items():
            _add_box(unions[key], box)
        parts[i] = box = None
        if release is not None:
            release()
    return Partial(unions, *small)


def sum_partials(*parts: Partial) -> Partial:
    """Sum of partials, left to right (the fixed order keeps results worker-count independent).

    Each boxed quantity is accumulated into its union box allocated once (no growing copies).
    """
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    boxes = {}
    for key in dict.fromkeys(k for p in parts for k in p.boxes):
        boxes[key] = _sum_boxes([p.boxes[key] for p in parts if key in p.boxes])
    return Partial(boxes, *_small_sums(parts))
