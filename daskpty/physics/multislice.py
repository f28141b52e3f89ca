"""Multislice forward model for thick samples and its exact vector-Jacobian product.

K object slices O_1 … O_K (entrance first) a distance Δz apart. For pattern j, probe mode m,
with Q_jm = S_{f_j} P_m the shifted probe and O_kj the window of slice k at r_j::

    φ_1 = Q,   ψ_k = φ_k · O_kj,   φ_{k+1} = 𝒫 ψ_k (k < K),   exit wave ψ_K,

𝒫 = :func:`~daskpty.physics.propagation.angular_spectrum` over Δz (band-limited). The detector
operator (far field F, or the near-field operator) follows. K = 1 is the single-slice model.

Vector-Jacobian product (complex gradient g = ∂f/∂Re z + i ∂f/∂Im z, as in the AD engine, so
δf = Re⟨g, δz⟩): from g_{ψ_K}, for k = K … 1: g_{O_k} = Σ_m conj(φ_k) g_{ψ_k},
g_{φ_k} = conj(O_k) g_{ψ_k}, g_{ψ_{k−1}} = 𝒫ᴴ g_{φ_k}; the probe waves get g_Q = g_{φ_1}. The
same backward chain applied to the LSQML exit-wave residual χ gives each slice's residual χ_k.

Layouts: slice patches (K, B, n, n), probe waves (B, M, n, n), incident waves φ (K, B, M, n, n).
NumPy or CuPy (the namespace of the input), the precision of the input.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .backend import fft2, get_xp
from .noise import model_intensity
from .patches import PatchIndex, check_windows_inside
from .propagation import angular_spectrum, angular_spectrum_adjoint, angular_spectrum_kernel
from .shifts import shift_probe, shift_ramps, split_positions


@dataclass(frozen=True)
class SliceGeometry:
    """Slices of a multislice object: count K, spacing Δz, wavelength λ and object pixel size Δx.

    K = 1 needs nothing else (no propagation). K > 1 needs all three, each positive.
    """

    n_slices: int = 1
    spacing_m: float | None = None
    wavelength_m: float | None = None
    pixel_size_m: float | None = None
    band_limit: bool = True

    def __post_init__(self):
        k = self.n_slices
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"slices must be an integer >= 1, got {k!r}")
        if k == 1:
            return
        for name, what in (("wavelength_m", "the wavelength"), ("pixel_size_m", "the object pixel size")):
            if getattr(self, name) is None:
                raise ValueError(f"multislice (slices={k}) needs {what} ({name}): give it, or the geometry "
                                 "it follows from, with the data")
        if self.spacing_m is None:
            raise ValueError(f"multislice (slices={k}) needs the slice spacing (slice_spacing_m)")
        for name in ("spacing_m", "wavelength_m", "pixel_size_m"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float, np.floating)) and math.isfinite(v) and v > 0):
                label = "slice spacing" if name == "spacing_m" else name
                raise ValueError(f"the {label} must be positive and finite, got {v!r}")

    def kernel(self, n: int, xp=np, dtype=np.complex64):
        """Transfer function (n, n) of the propagation between neighbouring slices (None for K = 1)."""
        if self.n_slices == 1:
            return None
        return angular_spectrum_kernel(n, self.pixel_size_m, self.wavelength_m, self.spacing_m,
                                       band_limit=self.band_limit, xp=xp, dtype=dtype)

    @property
    def fresnel_number(self) -> float | None:
        """λ Δz / Δx²: the kernel's phase at spatial frequency u is ≈ π (λΔz/Δx²) (uΔx)²."""
        if self.n_slices == 1:
            return None
        return self.wavelength_m * self.spacing_m / self.pixel_size_m**2


def multislice_forward(probe_waves, slice_patches, kernel, *, keep: bool = True):
    """Exit waves ψ_K (B, M, n, n) and the incident waves φ (K, B, M, n, n) (None unless ``keep``).

    ``probe_waves``: Q = S_f P (B, M, n, n); ``slice_patches``: (K, B, n, n); ``kernel``: the
    slice-to-slice transfer function (n, n) (unused for K = 1).
    """
    xp = get_xp(probe_waves, slice_patches)
    n_slices = slice_patches.shape[0]
    dtype = np.result_type(probe_waves.dtype, slice_patches.dtype)
    incident = xp.empty((n_slices,) + probe_waves.shape, dtype) if keep else None
    phi = probe_waves
    for k in range(n_slices):
        if keep:
            incident[k] = phi
        psi = phi * slice_patches[k][:, None]
        if k + 1 < n_slices:
            phi = angular_spectrum(psi, kernel)
    return psi, incident


def multislice_vjp(grad_exit, slice_patches, incident, kernel, *, want_slices: bool = True,
                   want_residuals: bool = False):
    """Backward chain of :func:`multislice_forward` (module docstring).

    Returns ``(grad_slices, grad_probe_waves, residuals)``: grad_slices (K, B, n, n) =
    Σ_m conj(φ_k) g_{ψ_k} (None unless ``want_slices``), grad_probe_waves (B, M, n, n) = g_{φ_1},
    residuals (K, B, M, n, n): g_{ψ_k} of every slice, its exit-wave residual when ``grad_exit`` is
    the LSQML χ (None unless ``want_residuals``).
    """
    xp = get_xp(grad_exit, slice_patches)
    n_slices = slice_patches.shape[0]
    residuals = xp.empty((n_slices,) + grad_exit.shape, grad_exit.dtype) if want_residuals else None
    grads = xp.empty(slice_patches.shape, np.result_type(grad_exit.dtype, slice_patches.dtype)) \
        if want_slices else None
    g = grad_exit
    for k in range(n_slices - 1, -1, -1):
        if want_residuals:
            residuals[k] = g
        if want_slices:
            if g.shape[1] == 1 and grads.dtype == g.dtype:     # one mode: no temporaries
                xp.conjugate(incident[k][:, 0], out=grads[k])
                grads[k] *= g[:, 0]
            else:
                grads[k] = (xp.conj(incident[k]) * g).sum(axis=1)
        g = xp.conj(slice_patches[k])[:, None] * g              # g_φk
        if k:
            g = angular_spectrum_adjoint(g, kernel)             # g_ψ(k−1)
    return grads, g, residuals


def transmit(waves, slice_patches, kernel, start: int):
    """Carry waves leaving slice ``start`` (B, M, n, n) to the exit: propagate, then transmit
    through slices start+1 … K−1 (0-based). This is the linear map T_k of a change at slice k."""
    for k in range(start + 1, slice_patches.shape[0]):
        waves = transmitted(angular_spectrum(waves, kernel), slice_patches[k][:, None])
    return waves


def transmit_sum(changes, slice_patches, kernel):
    """Σ_k T_k(changes_k): a change of the waves leaving every slice k (an iterable of K
    (..., B, M, n, n), slice 0 first; ``slice_patches`` (K, B, n, n)) carried to the exit
    together, by Horner's rule: the sum so far is propagated and transmitted through the next
    slice before that slice's change is added, K − 1 propagations instead of the K(K − 1)/2 of
    :func:`transmit` per slice. The first change's array may be written into (pass new ones)."""
    total = None
    for k, change in enumerate(changes):
        if total is None:
            total = change
            continue
        total = transmitted(angular_spectrum(total, kernel), slice_patches[k][:, None])
        total += change
    return total


def transmitted(waves, transmission):
    """``waves * transmission``, in place when ``waves`` (a new array of the caller's) already has
    the product's dtype."""
    if waves.dtype == np.result_type(waves.dtype, transmission.dtype):
        waves *= transmission
        return waves
    return waves * transmission


def transmit_adjoint(waves, slice_patches, kernel, start: int):
    """Adjoint of :func:`transmit` (exit-plane waves back to just after slice ``start``)."""
    xp = get_xp(waves, slice_patches)
    for k in range(slice_patches.shape[0] - 1, start, -1):
        waves = angular_spectrum_adjoint(xp.conj(slice_patches[k])[:, None] * waves, kernel)
    return waves


def slice_windows(index: PatchIndex, slices, batch: slice = slice(None)):
    """Windows of every slice (K, H, W) → (K, b, n, n) (a new array)."""
    xp = get_xp(slices)
    return xp.stack([index.extract(slices[k], batch) for k in range(slices.shape[0])])


def detector_forward(waves, detector=None):
    """Detector operator: far field F (``detector=None``) or near field F⁻¹[H F ·] (H an (n, n) kernel)."""
    return fft2(waves) if detector is None else angular_spectrum(waves, detector)


def multislice_intensities(slices, probe, positions, kernel=None, *, detector=None):
    """Model intensities (B, n, n) float32 of slices (K, H, W) (or (H, W)) and probe (M, n, n)
    (or (n, n)) at positions (B, 2); zero frequency at index 0 in the far field."""
    xp = get_xp(slices, probe)
    slices = xp.asarray(slices)
    slices = slices[None] if slices.ndim == 2 else slices
    probe = xp.asarray(probe)
    probe = probe[None] if probe.ndim == 2 else probe
    n = probe.shape[-1]
    if slices.shape[0] > 1 and kernel is None:
        raise ValueError("multislice intensities need the slice-to-slice kernel (SliceGeometry.kernel)")
    corners, fractions = split_positions(positions, n)
    check_windows_inside(corners, n, slices.shape)
    ramps = shift_ramps(fractions, n, xp)
    q = shift_probe(probe.astype(np.complex64), ramps)
    patches = slice_windows(PatchIndex(corners, n, slices.shape, xp), slices.astype(np.complex64))
    exit_waves, _ = multislice_forward(q, patches, kernel, keep=False)
    if detector is not None:   # the image in the beam's frame: the wave moved back by the fraction
        detector = xp.asarray(detector)[None, None] * xp.conj(ramps)[:, None]
    return model_intensity(detector_forward(exit_waves, detector)).astype(np.float32)
