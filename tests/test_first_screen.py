"""Where a K-slice model's probe lives: a defocus is measured at the sample's entrance surface,
the probe of K > 1 slices at the first screen, half a slice spacing in (a slab's mass acts about
at its middle). The aperture probe and the simulator's truth probe both follow it."""
import numpy as np
import pytest

import daskpty
from daskpty.physics.geometry import electron_wavelength_m
from daskpty.physics.probes import electron_probe
from daskpty.physics.propagation import angular_spectrum_kernel
from daskpty.simulate import simulate_multislice

N, DX, ALPHA, DEFOCUS, SPACING = 64, 0.25e-10, 25e-3, 6e-9, 2e-9
LAM = electron_wavelength_m(300e3)


def _overlap(a, b):
    a, b = np.ravel(a), np.ravel(b)
    return abs(np.vdot(a, b)) / (np.linalg.norm(a) * np.linalg.norm(b))


def _carried(probe, distance):
    """``probe`` propagated ``distance`` downstream (the forward model's own kernel)."""
    kernel = angular_spectrum_kernel(N, DX, LAM, distance, band_limit=False)
    return np.fft.ifft2(np.fft.fft2(probe) * kernel)


def test_propagating_downstream_adds_to_the_defocus():
    """electron_probe's ``defocus_m`` (z_sample − z_focus): the probe carried +h equals the probe
    of defocus + h, and not that of defocus − h."""
    entrance = electron_probe(N, DX, LAM, ALPHA, defocus_m=DEFOCUS)[0]
    carried = _carried(entrance, SPACING / 2)
    for step, same in ((SPACING / 2, True), (-SPACING / 2, False)):
        other = electron_probe(N, DX, LAM, ALPHA, defocus_m=DEFOCUS + step)[0]
        assert (_overlap(carried, other) > 0.9999) == same, (step, _overlap(carried, other))


@pytest.mark.parametrize("slices", [1, 2, 3])
def test_the_aperture_probe_of_k_slices_lives_half_a_slice_in(use_client, slices):
    """``probe="aperture"`` from the stored (entrance-surface) defocus is the entrance probe
    carried Δz/2 for K > 1 slices, the entrance probe itself for one slice."""
    ds = simulate_multislice(n=N, n_slices=2, grid=3, spacing_m=SPACING, defocus_m=DEFOCUS)
    data = daskpty.from_arrays(ds.intensities.astype(np.float32), ds.positions, object_pixel_size_m=DX,
                               electron_voltage_v=300e3, convergence_semiangle_rad=ALPHA, metadata={"defocus_m": DEFOCUS})
    rec = daskpty.reconstruct(data, epochs=0, probe="aperture", slices=slices, slice_spacing_m=SPACING,
                              check_data=False, progress=False)
    entrance = electron_probe(N, DX, LAM, ALPHA, defocus_m=DEFOCUS)[0]
    want = _carried(entrance, SPACING / 2) if slices > 1 else entrance
    got = np.asarray(rec.probe).reshape(-1, N, N)[0]
    assert _overlap(got, want) > 0.9999
    assert _overlap(got, entrance if slices > 1 else _carried(entrance, SPACING / 2)) < 0.99


def test_the_simulated_truth_probe_is_the_entrance_probe_half_a_slice_in():
    """simulate_multislice's ``truth.probe`` is what a K-slice reconstruction estimates: its
    stored defocus carried Δz/2 (K > 1), the defocused probe itself for one slice."""
    entrance = electron_probe(N, DX, LAM, ALPHA, defocus_m=DEFOCUS)[0]
    for k, want in ((2, _carried(entrance, SPACING / 2)), (1, entrance)):
        ds = simulate_multislice(n=N, n_slices=k, grid=2, spacing_m=SPACING, defocus_m=DEFOCUS)
        assert _overlap(ds.truth.probe[0], want) > 0.9999, k


def test_a_finely_sliced_slab_acts_at_its_middle():
    """Two thick slabs, each cut into 8 thin slices (as abTEM slices them): the 2-screen model
    fits their patterns best with the entrance probe carried +Δz/2, worse at the entrance, worse
    still carried −Δz/2."""
    from daskpty.physics.multislice import SliceGeometry, multislice_intensities
    from daskpty.simulate.multislice import weak_phase_slices

    fine, n = 8, 32
    slabs = weak_phase_slices((48, 48), 2, np.random.default_rng(0), phase=1.0)
    thin = np.repeat(slabs ** (1.0 / fine), fine, axis=0).astype(np.complex64)
    positions = np.array([[16.0, 16.0], [20.5, 24.0], [30.0, 18.5], [26.0, 31.0]])
    entrance = electron_probe(n, DX, LAM, ALPHA, defocus_m=DEFOCUS)[0]

    def carried(distance):
        kernel = angular_spectrum_kernel(n, DX, LAM, distance, band_limit=False)
        return np.fft.ifft2(np.fft.fft2(entrance) * kernel).astype(np.complex64)

    spacing = 4 * SPACING
    measured = multislice_intensities(thin, carried(spacing / fine / 2), positions,
                                      SliceGeometry(2 * fine, spacing / fine, LAM, DX).kernel(n))
    kernel = SliceGeometry(2, spacing, LAM, DX).kernel(n)
    errors = [np.linalg.norm(multislice_intensities(slabs, carried(d), positions, kernel) - measured)
              for d in (spacing / 2, 0.0, -spacing / 2)]
    assert errors[0] < 0.7 * errors[1] < 0.7 * errors[2], errors
