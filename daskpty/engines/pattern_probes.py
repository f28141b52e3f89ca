"""One chunk step's per-pattern probes (:class:`PatternProbes`): each pattern's probe spectra
from its weights and intensity factor, and the least-squares terms of the probe model gathered
on the way through the engines' chunk steps (LSQML's :func:`~.lsqml.chunk_step`, AD's chunk
gradient). See :mod:`.probe_model` for the model. No dask.
"""
from __future__ import annotations

import numpy as np

from ..physics import fft2, get_noise_model, get_xp
from ..physics.backend import asarray_like, real_dots, to_numpy
from .probe_model import ProbeModelOptions

#: The weights' Gauss–Newton curvature is measured on every CURVATURE_STRIDE-th pattern of a
#: chunk step (more often in short steps, so that at least CURVATURE_SAMPLES are measured).
CURVATURE_STRIDE = 32
CURVATURE_SAMPLES = 4
#: Relative Tikhonov term of the intensity factors' least-squares step (LSQML).
INTENSITY_TIKHONOV = 1e-3


def _real_view(a, required: bool = True):
    """A complex array (..., m) whose last axis is contiguous as a real one (..., 2m), no copy
    (None when the namespace cannot, and not ``required``; else a contiguous copy)."""
    try:
        return a.view(a.real.dtype)
    except (ValueError, TypeError):
        if not required:
            return None
        xp = get_xp(a)
        return xp.ascontiguousarray(a).view(a.real.dtype)


class PatternProbes:
    """The per-pattern probes of one chunk step, and what the step learns about them.

    ``probe_ft`` (M, n, n) spectra of the state's probe modes; ``eigen`` (K−1, n, n) the
    eigen-probes (real space); ``local`` the step's per-pattern state (already transformed by the
    last epoch's T, see :func:`~.probe_model.model_local`). Methods are called per sub-batch of patterns
    by the engines' chunk steps; everything stays in the namespace of the chunk's data.
    """

    def __init__(self, options: ProbeModelOptions, probe, eigen, local: dict, like, *, active: bool,
                 background=None, cdtype=np.complex64):
        xp = get_xp(like)
        self.xp, self.options, self.active = xp, options, active
        self.cdtype = cdtype = np.dtype(cdtype)
        self.rdtype = rdtype = np.float64 if cdtype == np.complex128 else np.float32
        probe = asarray_like(probe, like).astype(cdtype, copy=False)
        self.n_modes, self.n = probe.shape[0], probe.shape[-1]
        self.weights = None if "opr_weights" not in local else np.asarray(local["opr_weights"], np.float64)
        self.velocity = None if "opr_velocity" not in local else np.asarray(local["opr_velocity"], np.float64)
        self.intensity_velocity = local.get("intensity_velocity")   # of s_j (LSQML) or s_j² (AD)
        scale = local.get("intensity_scale")
        self.amplitude = None if scale is None else np.sqrt(np.maximum(np.asarray(scale, np.float64)[:, 0], 0))
        n_patterns = len(next(iter(local.values()))) if local else 0
        self.n_patterns = n_patterns
        if self.weights is not None:
            basis = probe[:1]
            if options.n_eigen:
                basis = xp.concatenate([basis, asarray_like(eigen, like).astype(cdtype, copy=False)])
            self.basis = basis                                  # U (K, n, n)
            self.basis_ft = fft2(basis)                         # F U
            self.basis_ft_flat = self.basis_ft.reshape(len(basis), -1)
            # F U as real rows (K, 2n²): real coefficients times complex rows, and Re⟨F U_k, G⟩,
            # are then single real matrix products (no complex multiply by a real number).
            self.basis_ft_real = _real_view(self.basis_ft_flat)
        self.probe = probe
        self.probe_ft = fft2(probe)
        self.background = None if background is None else asarray_like(background, like).astype(rdtype)

    # per-pattern coefficients (host, float64) of a sub-batch
    def _amp(self, batch):
        return np.ones(batch.stop - batch.start) if self.amplitude is None else self.amplitude[batch]

    def mode_factors(self, batch) -> np.ndarray:
        """dP_jm/dP_m per pattern and mode (b, M): s_j w_j0 for mode 0, s_j for the others."""
        amp = self._amp(batch)
        f = np.repeat(amp[:, None], self.n_modes, axis=1)
        if self.weights is not None:
            f[:, 0] *= self.weights[batch, 0]
        return f

    def spectra(self, batch, out):
        """F P_j (b, M, n, n) of a sub-batch into ``out``: mode 0 as one real product
        (b, K) @ (K, 2n²) of the coefficients s_j w_jk and the eigen-probe spectra."""
        xp = self.xp
        amp = self._amp(batch)
        b = batch.stop - batch.start
        if self.weights is None:
            xp.multiply(xp.asarray(amp.astype(self.rdtype))[:, None, None, None], self.probe_ft[None], out=out)
            return out
        coeff = xp.asarray((self.weights[batch] * amp[:, None]).astype(self.rdtype))
        target = out[:, 0].reshape(b, -1)
        dst = _real_view(target, required=False)
        if dst is not None:
            xp.matmul(coeff, self.basis_ft_real, out=dst)
        else:  # a namespace whose views cannot reinterpret a strided complex array
            target[...] = (coeff @ self.basis_ft_real).view(self.cdtype)
        if self.n_modes > 1:
            xp.multiply(xp.asarray(amp.astype(self.rdtype))[:, None, None, None], self.probe_ft[None, 1:],
                        out=out[:, 1:])
        return out

    def eigen_coefficients(self, batch) -> np.ndarray | None:
        """s_j w_jk for k ≥ 1 (b, K−1): how each eigen-probe enters pattern j's probe."""
        if self.weights is None or not self.options.n_eigen:
            return None
        return self.weights[batch, 1:] * self._amp(batch)[:, None]

    def weight_rhs(self, spec0_flat):
        """Re⟨F U_k, G_j0⟩ per pattern (b, K): ⟨S_f U_k O_j, χ_j0⟩ without another FFT."""
        return _real_view(spec0_flat) @ self.basis_ft_real.T

    # --- hooks of the LSQML chunk step (see lsqml.chunk_step) -----------------------------------

    def begin(self, step: int, n_patterns: int, update_probe: bool) -> None:
        """Buffers of one chunk step (sub-batches of ``step`` patterns) and what it will learn."""
        xp, n = self.xp, self.n
        self.buffer = xp.empty((step, self.n_modes, n, n), self.cdtype)
        self.want_weights = self.active and update_probe and self.weights is not None
        self.want_eigen = self.want_weights and self.options.n_eigen > 0
        self.want_intensity = self.active and self.amplitude is not None
        self.want_background = self.active and self.background is not None
        # LSQML with brightness_first: the brightness steps in pass 1 (see brightness_step)
        self.steps_brightness_first = bool(self.options.brightness_first) and (
            self.want_intensity or self.want_weights and self.options.fit_mean_weight)
        self.brightness = None
        if self.steps_brightness_first:
            self.brightness = xp.zeros(n_patterns)
            self._psi = xp.empty((step, self.n_modes if self.want_intensity else 1, n, n), self.cdtype)
        k = 0 if self.weights is None else len(self.basis)
        if self.want_weights:
            self.rhs = xp.empty((n_patterns, k))
            self.obj_power = xp.empty(n_patterns)               # ⟨|O_j|²⟩ over the window
            self.sample_stride = max(1, min(CURVATURE_STRIDE, n_patterns // CURVATURE_SAMPLES))
            self._samples = xp.empty((len(range(0, n_patterns, self.sample_stride)), n, n), self.cdtype)
            self._curvature = np.zeros((k, k))
            self._curvature_count = 0
        if self.want_eigen:
            self.eigen_num = xp.zeros((k - 1, n * n), self.cdtype)
            self.eigen_mean_num = xp.zeros(n * n, self.cdtype)
            self.eigen_moments = np.zeros((k - 1, 4))
        if self.want_intensity:
            self.int_num = xp.empty(n_patterns)
            self.int_den = xp.empty(n_patterns)
            self._powers = xp.empty((step, n * n), self.rdtype)

    def mode_factors_xp(self, batch):
        return self.xp.asarray(self.mode_factors(batch).astype(self.rdtype))

    def pattern_terms(self, batch, o, g, w, intensity: bool = True) -> None:
        """Pass 1, before the object patches are conjugated: ⟨|O_j|²⟩ and the sampled
        curvature of the weights (see :meth:`_sample_curvature`) and, for the intensity factor,
        Re⟨ψ_j, χ_j⟩ = Re⟨O_j, g_j⟩ and ‖ψ_j‖² = ⟨|O_j|², Σ_k |S_f P_jk|²⟩."""
        xp = self.xp
        b = batch.stop - batch.start
        if self.want_weights:
            self.obj_power[batch] = real_dots(o, o) / float(self.n * self.n)
            first = (-batch.start) % self.sample_stride
            if first < b:                                       # kept for _sample_curvature
                at = (batch.start + first) // self.sample_stride
                rows = o[first::self.sample_stride]
                self._samples[at:at + len(rows)] = rows
        if self.want_intensity and intensity:    # (else brightness_step formed them)
            p = self._powers[:b]
            flat = o.reshape(b, -1)
            xp.multiply(flat.real, flat.real, out=p)
            p += xp.square(flat.imag)
            self.int_num[batch] = real_dots(o, g)
            self.int_den[batch] = real_dots(p.reshape(o.shape), w)

    def exit_terms(self, batch, psi, chi) -> None:
        """The intensity factor's terms from the exit waves themselves, Re⟨ψ_j, χ_j⟩ and ‖ψ_j‖²
        (a multislice or near-field step, where no single object patch maps probe to exit wave;
        :meth:`pattern_terms` forms the same from the patch in one slice)."""
        if self.want_intensity:
            self.int_num[batch], self.int_den[batch] = real_dots(psi, chi), real_dots(psi, psi)

    def brightness_step(self, batch, o, shifted, chi, psi=None) -> None:
        """LSQML with ``brightness_first`` (a no-op otherwise), pass 1, between the far-field
        correction and the object gradient: each pattern's brightness takes its damped
        least-squares step first, r_j = ``weight_step`` · Re⟨ψ_j, χ_j⟩ / ‖ψ_j‖² (a relative
        change, applied by :func:`~daskpty.engines.lsqml_opr.new_model_local`), and
        χ_j ← χ_j − r_j ψ_j in place, the residual that step leaves. The brightness is the
        intensity factor s_j (every mode) or, for OPR without one, pattern j's mode-0 probe
        Σ_k w_jk U_k (its weights scale together). The object, probe and eigen-weight steps of
        the round then fit what the new brightness leaves instead of explaining it a second
        time (a Gauss–Seidel split). With the joint step the object takes up part of every
        pattern's flux error where only that pattern lights it: from the true object, 12 % rms
        flux flicker fitted for 40 epochs leaves 0.84 % jointly and 0.34 % this way
        (docs/benchmarks.md, OPR). Sets ``int_num`` / ``int_den`` of the intensity factor (see
        :meth:`pattern_terms`). ``psi``: the exit waves when they are not ``shifted · o`` (multislice,
        near field)."""
        if not self.steps_brightness_first:
            return
        modes = slice(0, self.n_modes if self.want_intensity else 1)
        xp, b = self.xp, batch.stop - batch.start
        if psi is None:
            psi = xp.multiply(shifted[:, modes], o[:, None], out=self._psi[:b])  # ψ_j
        else:               # the exit waves (through slices or to a near-field detector)
            psi = xp.multiply(psi[:, modes], 1, out=self._psi[:b])
        num, den = real_dots(psi, chi[:, modes]), real_dots(psi, psi)
        if self.want_intensity:
            self.int_num[batch], self.int_den[batch] = num, den
        r = self.options.weight_step * num / (den + INTENSITY_TIKHONOV * den.mean() + 1e-30)
        self.brightness[batch] = r
        psi *= xp.asarray(r.astype(self.rdtype))[:, None, None, None]
        chi[:, modes] -= psi

    def _sample_curvature(self) -> None:
        """The Gauss–Newton curvature of the weights, measured exactly (once per chunk step) on
        every ``sample_stride``-th pattern: H_kl = Σ Re(conj Ψ̂ D_k) Re(conj Ψ̂ D_l) / ⟨|O_j|²⟩
        with D_k = F(U_k O_j) (the far-field direction of w_jk per unit s_j) and Ψ̂ = Ψ_j0 / √ŷ_j
        (the sub-pixel shift and the detector mask ignored). Only the component of D_k in phase
        with the far field changes the intensity: for a defocus-like eigen-probe it is a few per
        mille of ‖D_k‖², so the exit-wave Gram Σ Re(conj U_k U_l)|O_j|² would make the weights'
        steps hundreds of times too short. K FFTs per sampled pattern (M − 1 more with
        incoherent modes)."""
        xp = self.xp
        ob = self._samples
        s = ob.shape[0]
        if s == 0:
            return
        k, n2 = len(self.basis), self.n * self.n
        d = fft2(self.basis[None] * ob[:, None]).reshape(s, k, n2)       # D_k per unit s_j
        idx = slice(0, s * self.sample_stride, self.sample_stride)
        amp = self._amp(slice(0, self.n_patterns))[idx]
        coeff = xp.asarray((self.weights[idx] * amp[:, None]).astype(self.rdtype))
        psi = (coeff[:, :, None] * d).sum(axis=1)                        # Ψ_j0 = Σ_k s_j w_jk D_k
        power = xp.square(psi.real) + xp.square(psi.imag)
        for m in range(1, self.n_modes):
            other = fft2(self.probe[m][None] * ob).reshape(s, n2) * xp.asarray(amp.astype(self.rdtype))[:, None]
            power += xp.square(other.real) + xp.square(other.imag)
        level = power.mean(axis=1, keepdims=True)
        hat = psi / xp.sqrt(power + 1e-6 * level + 1e-30)
        proj = hat.real[:, None] * d.real + hat.imag[:, None] * d.imag  # Re(conj Ψ̂ D_k)
        curv = to_numpy(proj @ proj.transpose(0, 2, 1)).astype(np.float64)   # (s, K, K)
        mean_power = np.maximum(to_numpy(self.obj_power[idx]), 1e-30)
        self._curvature += (curv / mean_power[:, None, None]).sum(axis=0)
        self._curvature_count += s

    def weight_curvature(self) -> np.ndarray:
        """The weights' curvature matrices per unit s_j² (B, K, K): the sampled Gauss–Newton
        curvature per unit ⟨|O|²⟩, plus ``curvature_damping`` times the exit-wave one
        (diag ‖U_k‖², the whole change of the exit wave), times each pattern's ⟨|O_j|²⟩. The
        damping is the Levenberg–Marquardt term of a weight whose far-field change is nearly in
        quadrature: its intensity changes at second order, which the Gauss–Newton curvature
        leaves out, so an undamped step overshoots."""
        damping = self.options.curvature_damping
        unit = self._curvature / max(self._curvature_count, 1)
        norms = to_numpy(self.xp.sum(self.xp.abs(self.basis.reshape(len(self.basis), -1)) ** 2, axis=1))
        unit = unit + damping * np.diag(np.asarray(norms, np.float64))
        return np.asarray(self.obj_power, np.float64)[:, None, None] * unit[None]

    def probe_terms(self, batch, spec, spectra_sum) -> None:
        """Pass 1: the shared modes' probe sums Σ_j (∂P_jm/∂P_m) G_jm into ``spectra_sum``
        (M, n²), the weights' right-hand sides and Gram matrices, the eigen-probe numerators
        Σ_j s_j w_jk G_j0 and preconditioners Σ_j (s_j w_jk)² |O_j|².

        Mode 0's sum and the eigen-probe numerators are one real product (1 + K−1, b) @ (b, 2n²)
        (their coefficients are real), the other modes' one (b,) @ (b, (M−1)n²); each in the
        data's precision over the sub-batch, added into the caller's (float64 in AD) sums."""
        xp = self.xp
        b = batch.stop - batch.start
        flat = spec.reshape(b, self.n_modes, -1)
        amp = self._amp(batch)
        factor0 = amp if self.weights is None else amp * self.weights[batch, 0]
        coeff = factor0[None]
        if self.want_eigen:
            c = self.eigen_coefficients(batch)
            coeff = np.concatenate([coeff, amp[None], c.T])
        spec0 = flat[:, 0]
        rows = (xp.asarray(coeff.astype(self.rdtype)) @ _real_view(spec0)).view(self.cdtype)
        spectra_sum[0] += rows[0]
        if self.n_modes > 1:
            rest = flat[:, 1:].reshape(b, -1)
            spectra_sum[1:] += (xp.asarray(amp.astype(self.rdtype)) @ rest).reshape(self.n_modes - 1, -1)
        if self.want_weights:
            self.rhs[batch] = self.weight_rhs(spec0)
        if self.want_eigen:
            self.eigen_mean_num += rows[1]
            self.eigen_num += rows[2:]
            m = to_numpy(self.obj_power[batch])
            w = self.weights[batch, 1:]
            self.eigen_moments += np.stack([w.sum(axis=0), (c * amp[:, None] * m[:, None]).sum(axis=0),
                                            (c * c * m[:, None]).sum(axis=0),
                                            np.full(w.shape[1], (amp * amp * m).sum())], axis=1)

    def background_terms(self, loss: str, yhat, y, valid, eps: float) -> None:
        """AD: ∂L/∂b per pixel, Σ_j h'(ŷ_j), and its Gauss–Newton curvature, summed over the
        sub-batch (ŷ includes the background): amplitude loss (√ŷ − √y)²: 1 − √(y/ŷ) and
        1/(2ŷ); Poisson: 1 − y/ŷ and 1/ŷ; intensity (ŷ − y)²: 2(ŷ − y) and 2."""
        xp = self.xp
        grad, curv = get_noise_model(loss, what="loss").background_terms(yhat, y, eps)
        if valid is not None:
            grad = grad * valid
            curv = curv * valid
        b = yhat.shape[0]
        if not hasattr(self, "bg_grad"):
            self.bg_grad = xp.zeros(self.n * self.n)
            self.bg_curv = xp.zeros(self.n * self.n)
        self.bg_grad += grad.reshape(b, -1).sum(axis=0, dtype=np.float64)
        self.bg_curv += curv.reshape(b, -1).sum(axis=0, dtype=np.float64)

    def finish(self, part, measured, model) -> None:
        """End of the chunk step: the additive sums into ``part.arrays``; the per-pattern terms
        to the host (read by the engine's weight update)."""
        n = self.n
        if self.want_background and hasattr(self, "bg_grad"):       # AD
            part.arrays["background_grad"] = to_numpy(self.bg_grad)
            part.arrays["background_curvature"] = to_numpy(self.bg_curv)
        elif self.want_background:                                  # LSQML
            part.arrays["background_residual"] = to_numpy(measured - model)
        if self.want_eigen:
            k1 = self.options.n_eigen
            part.arrays["opr_eigen_num"] = self.eigen_num.reshape(k1, n, n)
            part.arrays["opr_eigen_mean_num"] = self.eigen_mean_num.reshape(1, n, n)
            part.arrays["opr_eigen_moments"] = self.eigen_moments
        if self.want_weights:
            self._sample_curvature()
        for name in ("rhs", "obj_power", "int_num", "int_den", "brightness"):
            if getattr(self, name, None) is not None:
                setattr(self, name, to_numpy(getattr(self, name)))
