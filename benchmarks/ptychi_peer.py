#!/usr/bin/env python
"""Run the peer code Pty-Chi (PyPI ``ptychi``) on a problem stored in daskpty's conventions.

Run with the peer virtualenv (see benchmarks/README_ptychi.md), never with daskpty's own::

    /work/peer-venv/bin/python benchmarks/ptychi_peer.py IN.npz OUT.npz --engine lsqml \
        --epochs-list 10,30,100 [--batch-size B] [--noise gaussian|poisson] [--threads T] [--lr 0.01]

    /work/peer-venv/bin/python benchmarks/ptychi_peer.py IN.npz --check-forward

IN.npz (daskpty conventions)
    intensities (N, n, n) float32, photon counts, DC at the centre of each pattern;
    positions   (N, 2) float64, (y, x) object pixels; the probe window's top-left corner is
                t = p - n/2 (fractional); daskpty splits t = round(t) + f, f in [-1/2, 1/2], and
                uses object pixels round(t) ... round(t) + n - 1 with the probe Fourier-shifted by +f;
    probe       (M, n, n) complex64 initial probe;  object (H, W) complex64 initial object;
    forward model: I = fftshift(sum_modes |fft2(S_f(P) * O[window], norm="ortho")|^2).
    --check-forward additionally needs true_object / true_probe (and compares with
    clean_intensities when given).
    Multislice: object (K, H, W), entrance slice first, plus wavelength_m, pixel_size_m and
    slice_spacing_m (metres); daskpty's multislice model (angular spectrum over +dz between slices).

Conversion to Pty-Chi 2.2 (details in README_ptychi.md)
    * intensities -> ifftshift (DC at [0, 0]) and passed with ``data_options.fft_shift=False``;
    * Pty-Chi's far field is an *unnormalised* FFT, so probe_ptychi = probe / n (and back * n);
    * positions: Pty-Chi takes window centres relative to ``object.pos_origin_coords``; we fix that
      origin to (H//2 - 1/2, W//2 - 1/2) (``SPECIFIED``) and pass p - (H//2, W//2). Pty-Chi then
      reads the same integer window round(t) and shifts the probe by the same f (requires even n);
    * object frame/shape is unchanged (Pty-Chi object is (1, H, W)); probe becomes (1, M, n, n).

OUT.npz: object_<e> (H, W) complex64, probe_<e> (M, n, n) complex64 for each listed epoch,
seconds_per_epoch (mean over the run), segment_seconds, setup_seconds, loss (per epoch),
ptychi_version, plus the settings used.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import time
import types
import warnings

import numpy as np


# --------------------------------------------------------------------------------------------
# torchvision work-around
# --------------------------------------------------------------------------------------------
def _install_torchvision_stub() -> bool:
    """Make ``from torchvision.transforms import GaussianBlur`` importable.

    Pty-Chi imports torchvision at module level only for one Gaussian blur used when it generates
    a random initial object, which this driver never asks for. PyPI's torchvision wheels pin a
    (CUDA) torch of their own and do not load beside the CPU torch of the peer venv, so when the
    real package is missing or fails to import we register a minimal stand-in module whose
    ``GaussianBlur`` raises if it is ever called. Returns True when the stub was installed.
    """
    try:
        import torchvision.transforms  # noqa: F401
        return False
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]

    class GaussianBlur:  # pragma: no cover - only reached if Pty-Chi blurs, which we never request
        def __init__(self, *args, **kwargs):
            self.args, self.kwargs = args, kwargs

        def __call__(self, *args, **kwargs):
            raise RuntimeError(
                "torchvision stub (benchmarks/ptychi_peer.py): GaussianBlur is unavailable; "
                "provide explicit initial guesses instead of letting Pty-Chi generate them."
            )

    tv = types.ModuleType("torchvision")
    tv.__path__ = []  # mark as a package
    tvt = types.ModuleType("torchvision.transforms")
    tvt.GaussianBlur = GaussianBlur
    tv.transforms = tvt
    sys.modules["torchvision"] = tv
    sys.modules["torchvision.transforms"] = tvt
    return True


# --------------------------------------------------------------------------------------------
# daskpty reference forward model (NumPy), for --check-forward
# --------------------------------------------------------------------------------------------
def daskpty_forward_numpy(obj, probe, positions):
    """Recorded intensities (DC centred) of daskpty's forward model, in float64."""
    probe = np.asarray(probe, dtype=np.complex128)
    if probe.ndim == 2:
        probe = probe[None]
    n = probe.shape[-1]
    t = np.asarray(positions, dtype=np.float64) - n / 2.0
    corners = np.floor(t + 0.5).astype(np.int64)
    frac = t - corners
    k = np.fft.fftfreq(n)
    probe_ft = np.fft.fft2(probe)
    out = np.empty((len(t), n, n))
    for j, ((cy, cx), (fy, fx)) in enumerate(zip(corners, frac)):
        ramp = np.exp(-2j * np.pi * (fy * k[:, None] + fx * k[None, :]))
        shifted = np.fft.ifft2(probe_ft * ramp)
        psi = shifted * obj[cy:cy + n, cx:cx + n]
        far = np.fft.fft2(psi, norm="ortho")
        out[j] = np.fft.fftshift((np.abs(far) ** 2).sum(axis=0))
    return out


def make_test_case(path, H=160, n=32, grid=(15, 14), step=8.0, n_keep=200, seed=1,
                   photons=1e5, poisson=False):
    """Write a synthetic IN.npz in daskpty conventions (object = ones, probe = truth).

    Random smooth complex object (H, H); probe = defocused, slightly soft disc aperture in the far
    field; jittered raster with fractional positions; intensities from ``daskpty_forward_numpy``.
    """
    rng = np.random.default_rng(seed)
    k = np.fft.fftfreq(H)
    ky, kx = np.meshgrid(k, k, indexing="ij")

    def smooth(sigma):
        g = np.exp(-2 * (np.pi * sigma) ** 2 * (ky**2 + kx**2))
        f = np.fft.ifft2(np.fft.fft2(rng.standard_normal((H, H))) * g).real
        return f / f.std()

    obj = ((0.8 + 0.2 * np.tanh(smooth(4.0))) * np.exp(1j * np.tanh(smooth(5.0)))).astype(np.complex64)
    q = np.fft.fftfreq(n)
    qy, qx = np.meshgrid(q, q, indexing="ij")
    q2 = qy**2 + qx**2
    aperture = 1.0 / (1.0 + np.exp((np.sqrt(q2) - 0.22) / 0.01))
    probe = np.fft.fftshift(np.fft.ifft2(aperture * np.exp(2j * np.pi * 25.0 * q2)))
    probe *= np.sqrt(photons / (np.abs(probe) ** 2).sum())
    probe = probe[None].astype(np.complex64)
    yy, xx = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing="ij")
    pos = np.stack([yy.ravel(), xx.ravel()], 1) * float(step)
    pos = pos - pos.mean(0) + H / 2 + rng.uniform(-1.5, 1.5, pos.shape)
    pos = pos[:n_keep]
    if pos.min() < n / 2 + 1 or pos.max() > H - n / 2 - 2:
        raise SystemExit("test case: scan does not fit in the object")
    inten = daskpty_forward_numpy(obj, probe, pos)
    if poisson:
        inten = rng.poisson(inten)
    np.savez(path, intensities=inten.astype(np.float32), positions=pos, probe=probe,
             object=np.ones_like(obj), true_object=obj, true_probe=probe)
    print(f"wrote {path}: {len(pos)} patterns {n}x{n}, object {H}x{H}")


# --------------------------------------------------------------------------------------------
# Conversion to Pty-Chi
# --------------------------------------------------------------------------------------------
def to_ptychi_arrays(intensities, positions, probe, obj):
    intensities = np.asarray(intensities, dtype=np.float32)
    positions = np.asarray(positions, dtype=np.float64)
    probe = np.asarray(probe, dtype=np.complex64)
    if probe.ndim == 2:
        probe = probe[None]
    obj = np.asarray(obj, dtype=np.complex64)
    if obj.ndim == 2:
        obj = obj[None]  # (1 slice, H, W); a multislice object is (K, H, W), entrance slice first
    n = probe.shape[-1]
    if probe.shape[-2] != n or n % 2:
        raise SystemExit(f"probe must be square with an even side, got {probe.shape[-2:]}")
    if intensities.shape[1:] != (n, n):
        raise SystemExit(f"pattern shape {intensities.shape[1:]} != probe shape {(n, n)}")
    H, W = obj.shape[-2:]
    t = positions - n / 2.0
    if probe.shape[0] > 1 and np.any(np.abs(t - np.floor(t + 0.5)) > 1e-6):
        print("[ptychi_peer] WARNING: Pty-Chi 2.2 applies the sub-pixel probe shift to the FIRST "
              "probe mode only; with several modes and fractional positions its forward model "
              "differs from daskpty's (all modes shifted).", file=sys.stderr)
    origin = [H // 2 - 0.5, W // 2 - 0.5]
    return dict(
        data=np.ascontiguousarray(np.fft.ifftshift(intensities, axes=(-2, -1))),
        pos_y=positions[:, 0] - H // 2,
        pos_x=positions[:, 1] - W // 2,
        probe=np.ascontiguousarray(probe[None] / np.float32(n)),  # (1 OPR mode, M, n, n)
        obj=np.ascontiguousarray(obj),  # (n_slices, H, W)
        origin=origin,
        n=n,
    )


def build_task(engine, arrays, *, epochs, batch_size, noise, lr, probe_lr, seed, device="cpu",
               rescale_probe_first_epoch, ambiguity_removal, positions=None, multislice=None,
               opr=None):
    import torch
    import ptychi.api as api
    from ptychi.api.task import PtychographyTask

    if engine == "lsqml":
        options = api.LSQMLOptions()
        options.reconstructor_options.noise_model = (
            api.NoiseModels.POISSON if noise == "poisson" else api.NoiseModels.GAUSSIAN
        )
        options.reconstructor_options.rescale_probe_intensity_in_first_epoch = rescale_probe_first_epoch
    elif engine == "ad":
        options = api.AutodiffPtychographyOptions()
        # Pty-Chi maps POISSON to torch.nn.PoissonNLLLoss() with log_input=True, which would read
        # the predicted intensities as log-rates; we replace it after the build (see below).
        options.reconstructor_options.loss_function = api.LossFunctions.MSE_SQRT
        options.object_options.optimizer = api.Optimizers.ADAM
        options.object_options.step_size = lr
        options.probe_options.optimizer = api.Optimizers.ADAM
        options.probe_options.step_size = probe_lr
    elif engine in ("rpie", "epie"):
        # Maiden et al. 2017: rPIE with alpha 0.1 for object and probe; ePIE with alpha 1 (step 1)
        options = api.RPIEOptions() if engine == "rpie" else api.EPIEOptions()
        alpha = 0.1 if engine == "rpie" else 1.0
        for part in (options.object_options, options.probe_options):
            part.alpha = alpha
            part.step_size = 1.0
            part.optimizer = api.Optimizers.SGD
    else:
        raise SystemExit(f"unknown engine {engine!r}")

    ro = options.reconstructor_options
    ro.num_epochs = max(1, epochs)
    ro.batch_size = batch_size
    ro.default_device = api.Devices.GPU if device == "cuda" else api.Devices.CPU
    ro.default_dtype = api.Dtypes.FLOAT32
    ro.random_seed = seed

    options.data_options.fft_shift = False  # we pass DC-at-corner data ourselves
    options.object_options.determine_position_origin_coords_by = api.ObjectPosOriginCoordsMethods.SPECIFIED
    options.object_options.position_origin_coords = arrays["origin"]
    options.object_options.remove_object_probe_ambiguity.enabled = ambiguity_removal
    options.probe_position_options.optimizable = False
    if positions is not None:
        set_position_correction(options, api, engine, positions)
    if multislice is not None:
        set_multislice(options, arrays, multislice)
    extra = {}
    if opr is not None:
        extra["opr_mode_weights_data"] = set_opr(options, arrays, opr)

    task = PtychographyTask(
        options,
        diffraction_data=arrays["data"],
        object_data=arrays["obj"],
        probe_data=arrays["probe"],
        probe_position_x_px=arrays["pos_x"],
        probe_position_y_px=arrays["pos_y"],
        **extra,
    )
    if engine == "ad" and noise == "poisson":
        task.reconstructor.loss_function = torch.nn.PoissonNLLLoss(log_input=False, full=False)
    return task


def set_position_correction(options, api, engine, settings):
    """Pty-Chi 2.2's own position refinement: gradient position correction (``correction_type =
    GRADIENT``, its default Fourier-differentiated object) from epoch ``start`` and, unless
    ``affine`` is False, its affine transform constraint (default degrees of freedom: rotation,
    scale, shear, asymmetry) from the same epoch. Settings left as None keep Pty-Chi's defaults
    (LSQML: SGD step size 0.3, update limit 0.1 px per axis, also clipped at 10 x MAD)."""
    po = options.probe_position_options
    po.optimizable = True
    # Pty-Chi 2.2 Autodiff fails with a later start (forward_models.scale_gradients multiplies the
    # positions' gradient, still None before the start epoch), so AD corrects positions from epoch 0
    po.optimization_plan.start = int(settings["start"]) if engine == "lsqml" else 0
    po.correction_options.correction_type = api.PositionCorrectionTypes.GRADIENT
    if settings.get("step_size") is not None:
        po.step_size = float(settings["step_size"])
    if settings.get("limit") is not None:
        po.correction_options.update_magnitude_limit = float(settings["limit"])
    if engine == "ad" and settings.get("optimizer"):
        po.optimizer = getattr(api.Optimizers, settings["optimizer"].upper())
    if engine == "lsqml" and settings.get("momentum") is not None:
        po.momentum_acceleration_gain = float(settings["momentum"])
    ac = po.affine_transform_constraint
    ac.enabled = bool(settings.get("affine", True))
    ac.optimization_plan.start = int(settings["start"])


def set_multislice(options, arrays, settings):
    """Pty-Chi 2.2's multislice object: ``object_options.slice_spacings_m`` (K - 1 spacings, m),
    the object pixel size ``object_options.pixel_size_m`` (the probe inherits it) and
    ``data_options.wavelength_m``. Its slice-to-slice propagator (AngularSpectrumPropagator) is
    exp(2 pi i z sqrt(1/lambda^2 - u^2)): daskpty's kernel times the constant exp(2 pi i z / lambda),
    the same sign, no band limit (daskpty's band limit is above Nyquist for the benchmark geometry;
    --check-forward verifies the match). Every other multislice option keeps Pty-Chi's default
    (no multislice regulariser; LSQML step sizes per slice, not joint with the probe)."""
    k = arrays["obj"].shape[0]
    if k < 2:
        raise SystemExit("multislice needs an object of shape (K >= 2, H, W)")
    options.data_options.wavelength_m = float(settings["wavelength_m"])
    options.object_options.pixel_size_m = float(settings["pixel_size_m"])
    options.object_options.slice_spacings_m = np.full(k - 1, float(settings["spacing_m"]))


def set_opr(options, arrays, settings):
    """Pty-Chi 2.2's OPR (variable probe): the probe gets ``modes`` OPR modes (mode 0 the given
    probe, the eigenmodes random, normalised, as ptychi.utils.add_additional_opr_probe_modes_to_probe
    makes them), per-pattern weights (1 for mode 0, ~1e-6 random for the eigenmodes, as
    ptychi.utils.generate_initial_opr_mode_weights makes them), ``opr_mode_weight_options.optimizable``
    with ``optimize_eigenmode_weights`` and (``intensity``) ``optimize_intensity_variation``, the
    optimisation from epoch ``start``; probe OPR-mode orthogonalisation stays on (its default).
    Returns the initial weights (N, modes)."""
    import torch
    from ptychi.utils import add_additional_opr_probe_modes_to_probe, generate_initial_opr_mode_weights

    modes = int(settings["modes"])
    torch.manual_seed(int(settings.get("seed", 0)))  # the random eigenmodes and weights
    probe = torch.as_tensor(arrays["probe"])
    probe = add_additional_opr_probe_modes_to_probe(probe, modes - 1)
    weights = generate_initial_opr_mode_weights(len(arrays["pos_y"]), modes, probe=probe)
    arrays["probe"] = probe.numpy().astype(np.complex64)
    ow = options.opr_mode_weight_options
    ow.optimizable = True
    ow.optimize_eigenmode_weights = True
    ow.optimize_intensity_variation = bool(settings.get("intensity", True))
    ow.optimization_plan.start = int(settings.get("start", 0))
    return weights.numpy().astype(np.float32)


def read_positions(task, shape):
    """Pty-Chi's positions (window centres relative to the origin we fixed) in daskpty's frame."""
    c = task.get_data_to_cpu("probe_positions", as_numpy=True).astype(np.float64)
    H, W = shape[-2:]  # a multislice object is (K, H, W)
    return c + np.array([H // 2, W // 2], dtype=np.float64)


def read_back(task, n):
    """Object (H, W), or (K, H, W) for a multislice object; probe (M, n, n) (OPR mode 0) in
    daskpty's scale."""
    obj = task.get_data_to_cpu("object", as_numpy=True).astype(np.complex64)
    obj = obj[0] if obj.shape[0] == 1 else obj
    probe = task.get_data_to_cpu("probe", as_numpy=True)[0] * np.float32(n)
    return obj, probe.astype(np.complex64)


def read_opr(task, n):
    """OPR weights (N, K) and the OPR modes of the first incoherent mode (K, n, n), daskpty scale."""
    weights = task.get_data_to_cpu("opr_mode_weights", as_numpy=True).astype(np.float32)
    modes = task.get_data_to_cpu("probe", as_numpy=True)[:, 0] * np.float32(n)
    return weights, modes.astype(np.complex64)


def ptychi_forward(task, n_patterns, batch=256):
    import torch

    fm = task.reconstructor.forward_model
    out = []
    with torch.no_grad():
        for s in range(0, n_patterns, batch):
            idx = torch.arange(s, min(s + batch, n_patterns))
            out.append(fm(idx).cpu().numpy())
    return np.concatenate(out)


# --------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inp", metavar="IN.npz")
    ap.add_argument("out", metavar="OUT.npz", nargs="?")
    ap.add_argument("--engine", choices=("lsqml", "ad", "rpie", "epie"), default="lsqml")
    ap.add_argument("--epochs-list", default="10,30,100")
    ap.add_argument("--batch-size", type=int, default=100, help="Pty-Chi's own default is 100")
    ap.add_argument("--noise", choices=("gaussian", "poisson"), default="gaussian")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where Pty-Chi computes (cuda: the first visible GPU)")
    ap.add_argument("--lr", type=float, default=0.01, help="Adam step size (AD engine only)")
    ap.add_argument("--probe-lr", type=float, default=None,
                    help="Adam step size for the probe (AD; default: --lr). Note the probe is "
                         "held in Pty-Chi's scale, probe/n.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rescale-probe-first-epoch", action="store_true",
                    help="Pty-Chi LSQML default: epoch 1 only rescales the probe (no updates). "
                         "Off here, so every epoch updates object and probe.")
    ap.add_argument("--ambiguity-removal", action="store_true",
                    help="Pty-Chi default: every 10 epochs renormalise object to mean |O|~1 and "
                         "rescale probe. Off here, to stay in the caller's scale.")
    ap.add_argument("--refine-positions", action="store_true",
                    help="Pty-Chi position correction (gradient type) plus its affine transform "
                         "constraint; OUT.npz then also holds positions_<e> (daskpty frame) and "
                         "affine_<e> (scale, asymmetry, rotation, shear)")
    ap.add_argument("--position-start", type=int, default=5,
                    help="first epoch (from 0) of position correction and affine constraint")
    ap.add_argument("--position-step-size", type=float, default=None,
                    help="probe_position_options.step_size (default: Pty-Chi's, 0.3)")
    ap.add_argument("--position-limit", type=float, default=None,
                    help="correction_options.update_magnitude_limit, px (default: Pty-Chi's, 0.1)")
    ap.add_argument("--position-optimizer", default=None,
                    help="AD only: optimizer of the positions, e.g. adam (default: Pty-Chi's SGD)")
    ap.add_argument("--position-momentum", type=float, default=None,
                    help="LSQML only: momentum_acceleration_gain (default: Pty-Chi's, 0)")
    ap.add_argument("--no-affine", action="store_true",
                    help="with --refine-positions: leave the affine constraint off")
    ap.add_argument("--make-test-case", choices=("small", "bench576"), default=None,
                    help="write a synthetic IN.npz (with true_object/true_probe) to the IN path "
                         "and exit: small = 200 x 32^2 on 160^2, bench576 = 576 x 64^2 on 256^2")
    ap.add_argument("--opr-modes", type=int, default=None, metavar="K",
                    help="variable probe: Pty-Chi's OPR with K modes (mode 0 + K-1 eigenmodes); "
                         "OUT.npz then also holds opr_weights_<e> (N, K) and opr_modes_<e> (K, n, n)")
    ap.add_argument("--opr-start", type=int, default=0, help="first epoch (from 0) of the OPR updates")
    ap.add_argument("--no-opr-intensity", action="store_true",
                    help="with --opr-modes: do not fit the per-pattern intensity (weight of mode 0)")
    ap.add_argument("--check-forward", action="store_true",
                    help="print the relative error of Pty-Chi's forward model on true_object/"
                         "true_probe vs the recorded intensities, then exit")
    args = ap.parse_args(argv)

    if args.make_test_case == "small":
        make_test_case(args.inp)
        return 0
    if args.make_test_case == "bench576":
        make_test_case(args.inp, H=256, n=64, grid=(24, 24), step=7.5, n_keep=576, seed=2)
        return 0
    if args.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True")
    stubbed = _install_torchvision_stub()
    import torch

    import ptychi.api  # noqa: F401  (import cost is not part of setup_seconds)
    import ptychi.api.task  # noqa: F401

    if args.threads:
        torch.set_num_threads(args.threads)
    version = importlib.metadata.version("ptychi")

    d = np.load(args.inp)
    intensities = d["intensities"]
    positions = d["positions"]
    N = len(positions)
    # a multislice problem: IN.npz holds object (K, H, W) and the geometry (wavelength_m,
    # pixel_size_m, slice_spacing_m: metres; the spacing between neighbouring slices, > 0 downstream)
    multislice = None
    if d["object"].ndim == 3 and d["object"].shape[0] > 1:
        multislice = {k: float(d[name]) for k, name in (("wavelength_m", "wavelength_m"),
                                                       ("pixel_size_m", "pixel_size_m"),
                                                       ("spacing_m", "slice_spacing_m"))}

    if args.check_forward:
        t_obj, t_probe = d["true_object"], d["true_probe"]
        # the noise-free daskpty model of the true object, when given (else the recorded data)
        ref_data = d["clean_intensities"] if "clean_intensities" in d.files else intensities
        arrays = to_ptychi_arrays(ref_data, positions, t_probe, t_obj)
        task = build_task("lsqml", arrays, epochs=1, batch_size=args.batch_size, noise="gaussian",
                          lr=args.lr, probe_lr=args.lr, seed=args.seed,
                          rescale_probe_first_epoch=False, ambiguity_removal=False,
                          multislice=multislice)
        y = ptychi_forward(task, N)
        meas = arrays["data"].astype(np.float64)
        err = np.linalg.norm(y - meas) / np.linalg.norm(meas)
        what = "daskpty's noise-free intensities" if "clean_intensities" in d.files else "intensities"
        print(f"ptychi {version}: forward-model relative error vs {what} = {err:.3e}"
              + (f" ({arrays['obj'].shape[0]} slices)" if multislice else ""))
        if multislice is None:
            ref = daskpty_forward_numpy(t_obj, t_probe, positions)
            err_ref = np.linalg.norm(ref - ref_data) / np.linalg.norm(ref_data)
            print(f"(daskpty NumPy reference model vs intensities = {err_ref:.3e})")
        return 0

    if args.out is None:
        ap.error("OUT.npz is required unless --check-forward")
    epochs_list = sorted({int(e) for e in args.epochs_list.split(",") if e.strip()})
    if not epochs_list or epochs_list[0] < 1:
        ap.error("--epochs-list needs positive integers")
    probe_lr = args.lr if args.probe_lr is None else args.probe_lr

    t0 = time.perf_counter()
    arrays = to_ptychi_arrays(intensities, positions, d["probe"], d["object"])
    n = arrays["n"]
    pos_settings = None
    if args.refine_positions:
        pos_settings = dict(start=args.position_start, step_size=args.position_step_size,
                            limit=args.position_limit, optimizer=args.position_optimizer,
                            momentum=args.position_momentum, affine=not args.no_affine)
    opr_settings = None
    if args.opr_modes and args.opr_modes > 1:
        opr_settings = dict(modes=args.opr_modes, start=args.opr_start, seed=args.seed,
                            intensity=not args.no_opr_intensity)
    task = build_task(args.engine, arrays, epochs=epochs_list[-1], batch_size=args.batch_size,
                      noise=args.noise, lr=args.lr, probe_lr=probe_lr, seed=args.seed,
                      rescale_probe_first_epoch=args.rescale_probe_first_epoch,
                      ambiguity_removal=args.ambiguity_removal, positions=pos_settings,
                      multislice=multislice, opr=opr_settings, device=args.device)
    setup = time.perf_counter() - t0
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    results = {}
    segments = []
    done = 0
    run_time = 0.0
    for e in epochs_list:
        t1 = time.perf_counter()
        task.run(n_epochs=e - done)
        sync()
        dt = time.perf_counter() - t1
        run_time += dt
        segments.append(dt)
        print(f"[ptychi_peer] epochs {done + 1}-{e}: {dt / (e - done):.4f} s/epoch", file=sys.stderr)
        done = e
        obj, probe = read_back(task, n)
        results[f"object_{e}"] = obj
        results[f"probe_{e}"] = probe
        if args.refine_positions:
            results[f"positions_{e}"] = read_positions(task, d["object"].shape)
            comp = task.reconstructor.parameter_group.probe_positions.affine_transform_components
            results[f"affine_{e}"] = np.array([float(comp[k]) for k in
                                               ("scale", "asymmetry", "rotation", "shear")])
        if opr_settings is not None:
            results[f"opr_weights_{e}"], results[f"opr_modes_{e}"] = read_opr(task, n)

    try:
        loss = task.reconstructor.loss_tracker.table["loss"].to_numpy(dtype=np.float64)
    except Exception:
        loss = np.zeros(0)
    np.savez(
        args.out,
        **results,
        epochs=np.asarray(epochs_list),
        seconds_per_epoch=np.float64(run_time / epochs_list[-1]),
        segment_seconds=np.asarray(segments),
        setup_seconds=np.float64(setup),
        loss=loss,
        ptychi_version=np.str_(version),
        engine=np.str_(args.engine),
        noise=np.str_(args.noise),
        batch_size=np.int64(args.batch_size),
        threads=np.int64(torch.get_num_threads()),
        device=np.str_(args.device),
        lr=np.float64(args.lr if args.engine == "ad" else np.nan),
        torchvision_stub=np.bool_(stubbed),
        refine_positions=np.bool_(args.refine_positions),
        position_settings=np.str_(repr(pos_settings)),
        multislice=np.str_(repr(multislice)),
        opr_settings=np.str_(repr(opr_settings)),
    )
    print(f"[ptychi_peer] ptychi {version} {args.engine}: {run_time / epochs_list[-1]:.4f} s/epoch, "
          f"setup {setup:.2f} s, threads {torch.get_num_threads()} -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
