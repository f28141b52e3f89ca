"""The sample's forward model as one operator, with its adjoint and the derivatives the engines
take from it (no dask).

Pattern j, probe mode m, Q_jm = S_{f_j} P_m, O_kj the window of slice k at r_j (K slices Δz
apart, :mod:`daskpty.physics.multislice`): φ_1 = Q, ψ_k = φ_k · O_kj, φ_{k+1} = 𝒫 ψ_k, detected
Ψ = D ψ_K, D the far field F or the near-field operator (the wave moved back by f first,
:func:`detector_frame`). :class:`ForwardModel` (K, 𝒫, D) is the part an engine takes;
:meth:`ForwardModel.chunk` lays a chunk on the box of its windows and walks it in blocks: forward
(keeping the φ_k the adjoint needs), the detector's adjoint, one step of the backward chain per
slice (object gradient, illumination, the gradient carried to the previous slice or the entrance),
the entrance spectra, a change at slice k carried to the exit, the position derivatives. Gradient
convention of the AD engine: g = ∂f/∂Re z + i ∂f/∂Im z, δf = Re⟨g, δz⟩. One slice in the far field
walks cache-sized sub-batches on the CPU (the whole chunk on the GPU), in place, with the fused
kernels of :mod:`daskpty.physics.kernels`; K slices or the near field take the whole chunk as one
block (their position sums carry its changes through the slices, :mod:`.multislice_positions`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..physics import fft2, get_xp, ifft2, kernels
from ..physics.backend import asarray_like, real_dots, real_dots_with, shares_memory, to_numpy
from ..physics.multislice import detector_forward, transmit
from ..physics.patches import PatchIndex
from ..physics.propagation import angular_spectrum, angular_spectrum_adjoint
from ..physics.shifts import outer_ramps, shift_ramp_factors
from .positions import central_gradients

#: Target size of one sub-batch (b, M, n, n) of waves on the CPU: small enough that a block's
#: temporaries stay in the L2/L3 caches between the FFTs and the element-wise passes.
CPU_BLOCK_BYTES = 1 << 20


def fft_in_place(buf, inverse: bool = False):
    """Orthonormal (inverse) 2-D FFT of ``buf`` written back into ``buf``."""
    out = (ifft2 if inverse else fft2)(buf, overwrite=True)
    if not shares_memory(out, buf):
        buf[...] = out  # a copying transform: copy back
    return buf


def working_dtypes(*arrays):
    """(complex, real) working precision: double when any input is, else single."""
    wide = any(np.dtype(a.dtype) in (np.complex128, np.float64) for a in arrays)
    return (np.complex128, np.float64) if wide else (np.complex64, np.float32)


def split(positions, n: int):
    """Integer corners and float64 fractions of positions (B, 2) (the convention of
    :func:`daskpty.physics.split_positions`, the fractions in full precision)."""
    top_left = np.asarray(positions, dtype=np.float64) - n / 2.0
    corners = np.floor(top_left + 0.5).astype(np.int64)
    return corners, top_left - corners


def detector_frame(detector, ramps):
    """Per-pattern near-field transfer functions H · conj(ramp_j) (B, 1, n, n).

    The chunk shifts the probe by the sub-pixel fraction f_j over an integer window; the physical
    exit wave is the object moved under a fixed beam, P(x) · O(c + f + x), which is that wave
    translated by −f. A far-field intensity cannot see the translation; a near-field image can, so
    the detector operator takes it back: F⁻¹[H · e^{+2πi k·f} · F ψ]."""
    return detector[None, None] * get_xp(ramps).conj(ramps)[:, None]


@dataclass(frozen=True)
class ForwardModel:
    """K slices (``kernel``: the slice-to-slice transfer function, None for K = 1) and the
    detector (``detector``: None for the far field, else the near-field transfer function), both
    (n, n) complex64. The object is (H, W) for one slice in the far field, else (K, H, W) (also
    K = 1 in the near field); K is read from the object."""

    n_slices: int = 1
    kernel: np.ndarray | None = None
    detector: np.ndarray | None = None

    def chunk(self, obj, probe, intensities, positions, *, cdtype=np.complex64, variable=None,
              block_bytes: int | None = None, keep_probe_waves: bool = True, whole: bool = False) -> "Chunk":
        """One chunk of patterns laid out for the blocks of :class:`Chunk` (``block_bytes``: a
        CPU block's waves, default :data:`CPU_BLOCK_BYTES`; ``keep_probe_waves``: False, the
        detected waves overwrite S_f P; ``whole``: one block, every wave a new array, also for
        one slice in the far field)."""
        return Chunk(self, obj, probe, intensities, positions, cdtype, variable,
                     CPU_BLOCK_BYTES if block_bytes is None else block_bytes, keep_probe_waves, whole)

    @property
    def stacked(self) -> bool:
        """Whether the object is (K, H, W): K > 1 slices or a near-field detector."""
        return self.n_slices > 1 or self.detector is not None


#: one slice in the far field
THIN = ForwardModel()


class Block:
    """One block of patterns after :meth:`Chunk.forward`: ``batch``, ``ramps`` (b, n, n),
    ``probe_waves`` Q (b, M, n, n), ``patches`` (K, b, n, n), ``incident`` φ_k (K of (b, M, n, n);
    φ_1 = Q), ``exit`` ψ_K (None where the detected waves overwrote it), ``detected`` Ψ and the
    near-field ``detector`` frame (b, 1, n, n) or None. With the whole chunk in one block it also
    serves :mod:`.multislice_positions` (``xp``, ``n``, ``n_slices``, ``index``, ``kernel``,
    :meth:`box_gradients`)."""

    def __init__(self, chunk: "Chunk", batch: slice):
        self.chunk, self.batch = chunk, batch
        self.xp, self.n, self.n_slices = chunk.xp, chunk.n, chunk.n_slices
        self.index, self.kernel, self.variable = chunk.index, chunk.kernel, chunk.variable
        self.obj_box, self.box0, self.origin = chunk.obj_box, chunk.box0, chunk.origin
        self.exit = self.detector = None

    @property
    def shifted(self):
        return self.probe_waves

    def box_gradients(self):
        return self.chunk.box_gradients()

    def boxes(self, per_slice, dtype):
        """Scatter-add per-slice patches (K, b, n, n) into a (K, h, w) box."""
        out = self.xp.zeros(self.obj_box.shape, dtype)
        for k in range(self.n_slices):
            self.index.scatter_add(out[k], per_slice[k], self.batch)
        return out

    def pattern_spectra(self, g_q):
        """G_j = conj(ramp_j) F[g_Qj] (b, M, n, n), keeping the ramps."""
        spectra = fft2(g_q)
        spectra *= self.xp.conj(self.ramps)[:, None]
        return spectra

    def probe_gradient_spectra(self, spectra):
        """Σ_j (∂P_jm/∂P_m) G_jm (M, n, n): the shared modes' sums of the per-pattern spectra
        (with a varying probe, the probe model's terms are gathered on the way)."""
        if self.variable is None:
            return spectra.sum(axis=0)
        m, n = spectra.shape[1], self.n
        total = self.xp.zeros((m, n * n), spectra.dtype)
        self.variable.probe_terms(self.batch, spectra, total)
        return total.reshape(m, n, n)


class Chunk:
    """A chunk on the bounding box (K, h, w) of its windows, walked in :attr:`blocks`."""

    def __init__(self, model: ForwardModel, obj, probe, intensities, positions, cdtype, variable, block_bytes,
                 keep_probe_waves, whole):
        xp = get_xp(intensities)
        self.xp, self.cdtype = xp, np.dtype(cdtype)
        self.rdtype = np.float64 if self.cdtype == np.complex128 else np.float32
        self.flat = obj.ndim == 2                      # one slice in the far field: (H, W) boxes
        given, obj = obj, (obj[None] if self.flat else obj)
        probe = asarray_like(probe, intensities).astype(cdtype, copy=False)
        probe = probe[None] if probe.ndim == 2 else probe
        self.n_slices, self.n_modes, self.n = obj.shape[0], probe.shape[0], probe.shape[-1]
        n = self.n
        if self.n_slices > 1 and model.kernel is None:
            raise ValueError(f"{self.n_slices} slices need the slice-to-slice kernel (SliceGeometry.kernel)")
        for name, k in (("kernel", model.kernel), ("detector", model.detector)):
            if k is not None and tuple(k.shape) != (n, n):
                raise ValueError(f"{name} must be ({n}, {n}) like the probe, got shape {tuple(k.shape)}")
        corners, fractions = split(to_numpy(positions), n)
        self.box0, self.box1 = corners.min(axis=0), corners.max(axis=0) + n
        if self.box0.min() < 0 or self.box1[0] > obj.shape[-2] or self.box1[1] > obj.shape[-1]:
            raise ValueError(f"probe windows span {self.box0.tolist()}..{self.box1.tolist()}, outside the object "
                             f"of shape {tuple(obj.shape[-2:])}")
        (y0, x0), (y1, x1) = self.box0, self.box1
        box = given[..., y0:y1, x0:x1]                 # moved to the device as it is stored, then (K, h, w)
        self.obj_box = xp.ascontiguousarray(asarray_like(box, intensities), dtype=cdtype).reshape(
            (-1,) + box.shape[-2:])
        self._object, self._like = obj, intensities
        self.index = PatchIndex(corners - self.box0, n, self.obj_box.shape, xp)
        self.ry, self.rx = shift_ramp_factors(fractions, n, xp, cdtype)
        self.kernel, self.detector = (None if k is None else asarray_like(k, intensities).astype(cdtype, copy=False)
                                      for k in (model.kernel, model.detector))
        self.thin = self.n_slices == 1 and self.detector is None and not whole
        self.probe = probe
        self.probe_ft = fft2(probe)
        self.variable = variable
        n_patterns = intensities.shape[0]
        self.n_patterns = n_patterns
        block = block_bytes // (self.cdtype.itemsize * self.n_modes * n * n)
        step = max(1, min(n_patterns, block)) if xp is np and self.thin else n_patterns
        self.step = step
        self.blocks = [slice(s, min(s + step, n_patterns)) for s in range(0, n_patterns, step)]
        self._ramps = xp.empty((step, n, n), cdtype)
        self._patches = xp.empty((step, n, n), cdtype) if self.thin else None
        self._keep_probe_waves, self._buffers = keep_probe_waves, {}
        self._spectra = None if variable is None else xp.empty((step, self.n_modes, n, n), cdtype)
        self._dq = None

    @property
    def origin(self):
        return (int(self.box0[0]), int(self.box0[1]))

    def box(self, dtype):
        """Zeros on the box: (h, w) for one slice in the far field, else (K, h, w)."""
        return self.xp.zeros(self.obj_box.shape[1:] if self.flat else self.obj_box.shape, dtype)

    def slice_of(self, box, k: int):
        """Slice k of a box of :meth:`box`."""
        return box if self.flat else box[k]

    # ---------------------------------------------------------------------------------------------
    # forward

    def ramps(self, batch: slice):
        """exp(−2πi k·f_j) (b, n, n) of a block, in a buffer reused by every block."""
        b = batch.stop - batch.start
        if self.cdtype == np.complex64:
            return outer_ramps(self.ry[batch], self.rx[batch], out=self._ramps[:b])
        return self.xp.multiply(self.ry[batch][:, :, None], self.rx[batch][:, None, :], out=self._ramps[:b])

    def shifted(self, batch: slice, r, spectra=None, out=None):
        """S_f P = F⁻¹(ramp · F P) (b, M, n, n) in place of ``out`` (each pattern's own probe
        spectra with a varying probe; ``spectra``: other spectra, e.g. a direction's)."""
        b = batch.stop - batch.start
        if spectra is None:
            spectra = (self.probe_ft[None] if self.variable is None
                       else self.variable.spectra(batch, self._spectra[:b]))
        q = self.xp.multiply(r[:, None], spectra, out=self._buffer("shifted")[:b] if out is None else out)
        return fft_in_place(q, inverse=True)

    def _buffer(self, name: str):
        """A (step, M, n, n) buffer reused by every block, made when first asked for (a caller
        that gives its own arrays needs none)."""
        if name not in self._buffers:
            self._buffers[name] = self.xp.empty((self.step, self.n_modes, self.n, self.n), self.cdtype)
        return self._buffers[name]

    def forward(self, batch: slice, probe_out=None, wave_out=None) -> Block:
        """The forward model of one block (:class:`Block`); one slice in the far field in the
        chunk's buffers (or ``probe_out`` and ``wave_out``, (b, M, n, n)), the detected waves
        overwriting the exit waves."""
        xp, blk = self.xp, Block(self, batch)
        b = batch.stop - batch.start
        blk.ramps = r = self.ramps(batch)
        blk.probe_waves = q = self.shifted(batch, r, out=probe_out)
        if self.thin:
            o = self.index.extract(self.obj_box[0], batch, out=self._patches[:b])
            blk.patches, blk.incident = o[None], [q]
            waves = wave_out if wave_out is not None else self._buffer("waves")[:b] if self._keep_probe_waves else q
            blk.detected = fft_in_place(xp.multiply(q, o[:, None], out=waves))
            return blk
        blk.patches = xp.stack([self.index.extract(self.obj_box[k], batch) for k in range(self.n_slices)])
        blk.incident = []
        phi = q
        for k in range(self.n_slices):
            blk.incident.append(phi)
            psi = phi * blk.patches[k][:, None]
            if k + 1 < self.n_slices:
                phi = angular_spectrum(psi, self.kernel)
        blk.exit = psi
        if self.detector is not None:
            blk.detector = detector_frame(self.detector, r)
        blk.detected = detector_forward(psi, blk.detector)
        return blk

    def detect(self, blk: Block, waves):
        """The detector operator D on exit-plane waves (in place in the far field)."""
        return fft_in_place(waves) if blk.detector is None else angular_spectrum(waves, blk.detector)

    def to_exit(self, blk: Block, waves):
        """Dᴴ: detector-plane waves back to the exit surface (in place in the far field)."""
        if blk.detector is None:
            return fft_in_place(waves, inverse=True)
        return angular_spectrum_adjoint(waves, blk.detector)

    # ---------------------------------------------------------------------------------------------
    # adjoint

    def slice_terms(self, blk: Block, k: int, g, out=None):
        """(Σ_m conj(φ_k) g, Σ_m |φ_k|²) (b, n, n) of slice k for the gradient g (b, M, n, n) at
        its exit. One slice in the far field without ``out``: g is written into Q's buffer (the
        forward waves are spent); K slices keep φ_k (the position sums read them)."""
        return kernels.object_gradient(blk.incident[k], g, out=out, overwrite=self.thin and out is None)

    def back(self, blk: Block, k: int, g, weight=None, out=None):
        """The gradient at slice k's exit carried to its entrance, w · g with w = conj(O_k) (the
        exact chain; or ``weight`` (b, n, n), PIE's regularised one), then to slice k−1's exit
        (𝒫ᴴ) for k > 0. One slice in the far field: in place of g (or into ``out``), O's window
        conjugated in its buffer; else a new array."""
        if self.thin and weight is None:
            return kernels.conj_product(g, blk.patches[0], out=g if out is None else out)
        if self.thin:
            g *= weight[:, None]
            return g
        g = g * (self.xp.conj(blk.patches[k]) if weight is None else weight)[:, None]
        return angular_spectrum_adjoint(g, self.kernel) if k else g

    def vjp(self, blk: Block, g_exit):
        """The exact backward chain from the exit-surface gradient ``g_exit`` (consumed in one
        slice in the far field): ``(grads, lit, g_q)``, per slice Σ_m conj(φ_k) g_k and
        Σ_m |φ_k|² (lists of K (b, n, n)) and g_Q at the entrance (b, M, n, n)."""
        grads, lit = [None] * self.n_slices, [None] * self.n_slices
        g = g_exit
        for k in range(self.n_slices - 1, -1, -1):
            grads[k], lit[k] = self.slice_terms(blk, k, g)
            g = self.back(blk, k, g)
        return grads, lit, g

    def entrance_spectra(self, blk: Block, g_q):
        """G_j = conj(ramp_j) F[g_Qj] (b, M, n, n), F of the adjoint shift, in place of g_Q
        (the block's ramps are conjugated in their buffer)."""
        spectra = fft_in_place(g_q)
        return kernels.conj_product(spectra, blk.ramps, out=spectra)

    def carry(self, blk: Block, waves, k: int):
        """A change of the waves leaving slice k (b, M, n, n) carried to the exit surface
        (the linear map T_k; the waves themselves for the last slice)."""
        return transmit(waves, blk.patches, self.kernel, k)

    # ---------------------------------------------------------------------------------------------
    # position derivatives

    def frequencies(self):
        """2π k (n,) along either axis, in the working precision."""
        return self.xp.asarray(np.fft.fftfreq(self.n), dtype=self.rdtype) * self.rdtype(2 * np.pi)

    def shift_derivatives(self, blk: Block):
        """∂(S_f P_j)/∂f_a for a = y, x (2, b, M, n, n): F⁻¹[F(S_f P) · (−2πi k_a)]."""
        k = self.frequencies()
        spectra = fft2(blk.probe_waves)
        return (ifft2(spectra * (-1j * k)[:, None]), ifft2(spectra * (-1j * k)[None, :]))

    def position_gradient(self, blk: Block, spectra, g_detected=None, noise: bool = False):
        """∂L/∂(y, x) per pattern (b, 2) float64 from the entrance spectra G_j
        (:meth:`entrance_spectra`): the probe's sub-pixel shift Re⟨G_j, (−2πi k_a) F P_j⟩ (BLAS
        dots, no FFT; F P_j the pattern's own probe with a varying probe) and in the near field
        the detector's translation back by the same fraction, Re⟨g_D, ∂_a D⟩ (``g_detected``
        the gradient at the detector, the block's detected waves kept).

        ``noise``: also return each dot's scatter (b, 2) were G_j white noise of its own power,
        √(‖G_j‖² ‖D_a‖² / 2N) over the N entries of G_j (D_a = (−2πi k_a) F P_j): a gradient
        within it says nothing the noise could not (:func:`~.positions.noise_gate`)."""
        k = self.xp.asarray(np.fft.fftfreq(self.n), dtype=self.rdtype)
        w = self.rdtype(-2 * np.pi)
        ky, kx = (1j * w * k)[:, None], (1j * w * k)[None, :]
        if self.variable is None:
            if self._dq is None:       # F[∂(S_f P)/∂f_a] / ramp, formed once per chunk
                self._dq = [(self.probe_ft * d).astype(self.cdtype, copy=False) for d in (ky, kx)]
                self._dq_power = self.xp.asarray([float(real_dots(d[None], d[None])[0]) for d in self._dq])
            grad = real_dots_with(spectra, self._dq)
            d_power = self._dq_power[None, :]
        else:
            b = blk.batch.stop - blk.batch.start
            own = self.variable.spectra(blk.batch, self._spectra[:b])
            derivatives = [(own * d).astype(self.cdtype, copy=False) for d in (ky, kx)]
            grad = self.xp.stack([real_dots(spectra, d) for d in derivatives], axis=1)
            d_power = self.xp.stack([real_dots(d, d) for d in derivatives], axis=1) if noise else None
        if blk.detector is not None:
            grad = grad + self.xp.stack([real_dots(g_detected, d) for d in self.detector_derivatives(blk.detected)],
                                        axis=1)
        if not noise:
            return grad
        entries = spectra[0].size
        scatter = self.xp.sqrt(real_dots(spectra, spectra)[:, None] * d_power / (2.0 * entries))
        return grad, scatter

    def detector_derivatives(self, detected):
        """∂/∂f_a of the near-field operator's translation back by f (:func:`detector_frame`),
        applied to the detected waves (b, M, n, n): F⁻¹[(2πi k_a) · F(detected)], a = y, x."""
        k = self.frequencies()
        spectra = fft2(detected)
        return (ifft2(spectra * (1j * k)[:, None]), ifft2(spectra * (1j * k)[None, :]))

    def box_gradients(self):
        """(∂_y O_k, ∂_x O_k) per slice on the box, by central differences that reach one pixel
        beyond the box where the object goes on (one-sided only at the object's own edge)."""
        (y0, x0), (y1, x1) = self.box0, self.box1
        h, w = self._object.shape[-2:]
        py0, px0, py1, px1 = max(y0 - 1, 0), max(x0 - 1, 0), min(y1 + 1, h), min(x1 + 1, w)
        padded = self.xp.ascontiguousarray(asarray_like(self._object[:, py0:py1, px0:px1], self._like),
                                           dtype=self.cdtype)
        crop = (slice(y0 - py0, y0 - py0 + y1 - y0), slice(x0 - px0, x0 - px0 + x1 - x0))
        return [tuple(g[crop] for g in central_gradients(padded[k], self.xp)) for k in range(self.n_slices)]
