"""The eigen-probes of orthogonal probe relaxation (OPR): where they start, how they are kept
orthonormal (and clear of what the data cannot see), and the limits of their updates.

U_0 = P_0 is the mean probe (the state's first probe mode); U_1 … U_{K−1} are kept in the state,
orthogonal to U_0 and to each other, each of norm ‖U_0‖. Every orthonormalisation returns the
K × K real matrix T that keeps each pattern's probe Σ_k w_jk U_k, with the weights w_j · T
(:func:`effective_weights`). See :mod:`.probe_model` for the model. Pure functions on
NumPy/CuPy arrays; no dask.
"""
from __future__ import annotations

import numpy as np

from ..physics import get_xp
from ..physics.backend import to_numpy

#: Largest change of an eigen-probe in one round, relative to ‖U_0‖ (they are kept at ‖U_0‖).
#: Their least-squares step divides by the weights' spread, still tiny when the fit starts,
#: and in minibatch rounds a step grew from round to round: AD with K = 3 on a 24 × 24 raster
#: (R = 3) took steps of 0.45 ‖U_0‖ at once and up to 1.9 ‖U_0‖ later, and ended at 6.8× the
#: constant-probe NRMSE (worse than no OPR); with the limit 2.3×. bench_opr's scan (R = 1)
#: does not reach the limit often (five seeds, K = 2 / 3: LSQML 1.05 → 1.03×, AD 1.09 → 1.09×
#: / 1.12 → 1.12×).
EIGEN_TRUST = 0.05


def initial_eigen_probes(probe0, n_eigen: int, seed: int = 0) -> np.ndarray:
    """K − 1 starting eigen-probes (K−1, n, n) complex64, orthogonal to P_0 and to each other,
    each as strong as P_0 (their weights start at zero): the first two terms of a drifting
    defocus d, P(d) ≈ P_0 + d ∂P/∂d + ½ d² ∂²P/∂d² (a change of the propagation distance to the
    sample, or of the lens' focus),

    1. i F⁻¹(|k|² F P_0), the derivative of P_0 along the beam;
    2. −F⁻¹(|k|⁴ F P_0), its second derivative (the weights of a defocus drifting linearly
       over the scan are then linear and quadratic in it);

    then seeded noise. Not a real-space curvature of the phase, P_0 · i(r² − ⟨r²⟩): with weights
    linear over a dense raster it traded with an object phase cubic along the scan (the
    strongly drifting beam of bench_opr.py, K = 3 with intensity factors, LSQML seed 0 at 50
    epochs: 1.31× the constant-probe NRMSE with it second, 1.02× with the second derivative).
    Not the beam's pointing (the shifts ∂P_0/∂y, ∂P_0/∂x): a pattern's probe shifted is its
    window moved, which position refinement fits, and as eigen-probes the shifts fitted the
    object's errors along the scan (bench_opr.py's default scan, five seeds, LSQML / AD: K = 3
    1.38 / 1.12× the constant-probe NRMSE with the shift ∂P_0/∂y second, 1.08 / 1.09× without;
    K = 4 1.63 / 1.20× with both shifts, 1.20 / 1.16× without)."""
    probe0 = np.asarray(to_numpy(probe0), dtype=np.complex128)
    n = probe0.shape[-1]
    if n_eigen == 0:
        return np.zeros((0, n, n), np.complex64)
    spectrum = np.fft.fft2(probe0)
    k = np.fft.fftfreq(n)
    ky, kx = np.meshgrid(k, k, indexing="ij")
    k2 = ky * ky + kx * kx
    directions = [np.fft.ifft2(1j * k2 * spectrum), np.fft.ifft2(-(k2 * k2) * spectrum)]
    rng = np.random.default_rng(seed)
    while len(directions) < n_eigen:
        directions.append(probe0 * (rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n))))
    eigen, _ = orthonormalize(probe0, np.stack(directions[:n_eigen]))
    return eigen


def _real_rows(a):
    """Complex rows (K, ...) as real rows (K, 2·size): the real inner product Re⟨a, b⟩."""
    a = np.asarray(a, dtype=np.complex128).reshape(len(a), -1)
    return np.concatenate([a.real, a.imag], axis=1)


def unseen_directions(probe0) -> np.ndarray:
    """The changes of P_0 that the data cannot tell from the object or the positions (5, n, n):
    i P_0 (a pattern's own phase: its intensities do not change), i y P_0, i x P_0 (a linear
    phase across the probe, y and x from its centre of power: the same as a local phase
    gradient of the object) and the shifts ∂P_0/∂y, ∂P_0/∂x (a pattern's probe moved is its
    window moved: with weights smooth over the scan, a deformation of the object or a scale of
    the positions, which position refinement moves too).

    Weights that vary smoothly over the scan along these let a smooth object phase trade with
    the probe: an object phase c·y² looks, pattern by pattern, like a probe tilt 2c·y_j. OPR
    then drifts along that valley instead of fitting the beam (the 22 × 22 scan at a 2.5 px step
    of bench_opr.py, defocus drift only: object NRMSE 0.027 (LSQML) and 0.044 (AD) with such
    eigen-probes, worse than no OPR (0.018 / 0.016); 0.016 / 0.016 without them), so
    :func:`orthonormalize` keeps the eigen-probes orthogonal to them. Eigen-probes free to shift
    the probe took up the object's errors, or traded a scale of the refined positions for a
    radial pattern of weights: the ideal ``simulate`` small preset (576 × 64², exact positions,
    constant beam), K = 2, 60 epochs: 1.24× the plain run's NRMSE (1.03× without the shifts);
    with position refinement at one round per epoch the loss rose 18-fold from epoch 20."""
    p = np.asarray(to_numpy(probe0), dtype=np.complex128)
    y, x = _coordinates_about_power_centre(p)
    k = np.fft.fftfreq(p.shape[-1])
    spectrum = np.fft.fft2(p)
    shift_y = np.fft.ifft2(2j * np.pi * k[:, None] * spectrum)
    shift_x = np.fft.ifft2(2j * np.pi * k[None, :] * spectrum)
    return np.stack([1j * p, 1j * y * p, 1j * x * p, shift_y, shift_x])


def _coordinates_about_power_centre(probe0) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates (y, x), each (n, n), measured from the probe's centre of power."""
    power = np.abs(probe0) ** 2
    total = power.sum() or 1.0
    c = np.arange(probe0.shape[-1]) - (probe0.shape[-1] - 1) / 2.0
    y, x = np.meshgrid(c, c, indexing="ij")
    return y - (power * y).sum() / total, x - (power * x).sum() / total


def orthonormalize(probe0, eigen) -> tuple[np.ndarray, np.ndarray | None]:
    """Eigen-probes made orthogonal to P_0, to the changes the data do not see
    (:func:`unseen_directions`, whose parts are dropped) and to each other (real inner product;
    SVD, strongest first), each of norm ‖P_0‖, and the K × K real matrix T that keeps every
    pattern's probe, but for the dropped parts: Σ_k w_k U_k = Σ_k (w T)_k U'_k with
    U_0 = U'_0 = P_0. Returns ``(eigen', T)``."""
    eigen = np.asarray(to_numpy(eigen))
    k1 = eigen.shape[0]
    if k1 == 0:
        return eigen.astype(np.complex64), None
    p0 = _real_rows(to_numpy(probe0)[None])[0]
    norm0 = float(np.sqrt(p0 @ p0))
    rows = _real_rows(eigen)
    unseen = np.linalg.qr(_real_rows(unseen_directions(probe0)).T)[0]  # orthonormal columns, ⟂ P_0
    rows = rows - (rows @ unseen) @ unseen.T
    coef = rows @ p0 / (norm0 * norm0)                        # component along U_0
    rest = rows - coef[:, None] * p0[None]
    u, s, vh = np.linalg.svd(rest, full_matrices=False)
    keep = s > 1e-12 * max(float(s.max()), 1e-300)
    vh = np.where(keep[:, None], vh, 0.0)                    # a vanished mode stays zero
    new_rows = norm0 * vh                                     # U'_l, norm ‖U_0‖
    transform = np.zeros((k1 + 1, k1 + 1))
    transform[0, 0] = 1.0
    transform[1:, 0] = coef
    transform[1:, 1:] = u * (s / norm0)[None, :]              # U_k − c_k U_0 = Σ_l B_kl U'_l
    half = new_rows.shape[1] // 2
    new = (new_rows[:, :half] + 1j * new_rows[:, half:]).reshape(eigen.shape)
    return new.astype(np.complex64), transform


def add_eigen_weight_sums(sums, arrays, count: float) -> np.ndarray:
    """``sums`` (K,: the patterns counted, then Σ_j w_jk per eigen-probe; None: nothing yet)
    with a round's ``count`` patterns and their eigen-weights' sums added."""
    new = np.concatenate([[float(count)], np.asarray(arrays["opr_eigen_moments"], np.float64)[:, 0]])
    return new if sums is None else sums + new


def recentre(probe0, eigen, mean) -> tuple:
    """The mean probe with the eigen-probes' share of the mean weights ``mean`` moved into it,
    U'_0 = U_0 + Σ_k w̄_k U_k, and the K × K matrix T (``w_new = w_old · T``: w'_k = w_k − w̄_k w_j0)
    that keeps every pattern's probe Σ_k w_jk U_k exactly. Returns ``(U'_0, T)``.

    The model cannot tell a weight's mean from the mean probe, and the steps see them apart:
    the mean probe takes Σ_j G_j0 and the eigen-probes only the centred sums
    (:func:`centred_eigen_terms`). Left to drift (means of 0.1 ‖U_0‖ after 35 epochs), the
    mean of the eigen-weights fought the mean probe: on the strongly drifting beam of
    bench_opr.py (K = 3, intensity factors, six seeds) AD's loss rose from epoch 30 and ended at
    0.98–2.21× the constant-probe NRMSE at 50 epochs; kept at zero, 0.68–0.96× with a falling loss."""
    xp = get_xp(probe0)
    mean = np.asarray(mean, np.float64)
    shift = np.tensordot(mean, np.asarray(to_numpy(eigen), np.complex128), axes=1)
    transform = np.eye(len(mean) + 1)
    transform[0, 1:] = -mean
    return (probe0 + xp.asarray(shift.astype(np.complex64))).astype(probe0.dtype), transform


def centred_eigen_terms(arrays, count: float):
    """The eigen-probes' update numerators and denominators with every pattern's weights taken
    relative to their mean over the patterns summed, w_jk − w̄_k: Σ_j s_j (w_jk − w̄_k) G_j0 (in
    Fourier space, (K−1, n, n)) and Σ_j s_j² (w_jk − w̄_k)² ⟨|O_j|²⟩ ((K−1, 1, 1)), from the additive
    sums of the chunk steps. The mean probe takes Σ_j G_j0 in the same round: an eigen-probe
    stepped with the plain Σ_j s_j w_jk G_j0 would take the share w̄_k of it a second time
    (PtychoShelves and Pty-Chi likewise step the eigen-probes along δP_j − mean δP)."""
    num = np.asarray(arrays["opr_eigen_num"])
    moments = np.asarray(arrays["opr_eigen_moments"], np.float64)
    mean = moments[:, 0] / max(count, 1.0)
    num = num - (mean[:, None, None] * np.asarray(arrays["opr_eigen_mean_num"])).astype(num.dtype)
    den = moments[:, 2] - 2 * mean * moments[:, 1] + mean * mean * moments[:, 3]
    return num, np.maximum(den, 0.0).reshape(-1, 1, 1)


def limit_eigen_step(step, probe0, trust: float):
    """``step`` (K−1, n, n) with each eigen-probe's change scaled down to at most ``trust`` ·
    ‖P_0‖ (see :data:`EIGEN_TRUST`), its direction kept."""
    xp = get_xp(step)
    norms = xp.sqrt(xp.sum(xp.abs(step.reshape(len(step), -1)) ** 2, axis=1))
    limit = trust * float(np.linalg.norm(to_numpy(probe0)))   # the probe may live on a GPU
    scale = xp.minimum(1.0, limit / xp.maximum(norms, 1e-30))
    return step * scale.astype(step.real.dtype)[:, None, None]


def effective_weights(weights, transform) -> np.ndarray:
    """Stored weights in the current eigen-probe basis (``weights · T``; T None: as stored)."""
    weights = np.asarray(weights, dtype=np.float64)
    return weights if transform is None else weights @ np.asarray(transform, dtype=np.float64)
