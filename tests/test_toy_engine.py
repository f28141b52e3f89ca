"""A fourth engine from this file and one spec: plain gradient descent on the amplitude loss
(preconditioned by the illumination), its chunk gradient AD's through the sample model's
injection. Registered here alone, it runs through ``daskpty.reconstruct`` with one slice and K
slices, in the near field, with refined positions, a varying probe (OPR) and on tiles; the loss
falls and the object approaches the truth."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from scipy.ndimage import gaussian_filter

import daskpty
from daskpty.engines import lsqml
from daskpty.engines import sample_model as sm
from daskpty.engines import specs
from daskpty.engines.ad import opr
from daskpty.engines.ad.gradient import refining_chunk_gradient
from daskpty.engines.core import EngineCore, TileSteps, chunk_steps
from daskpty.engines.positions import accumulate_position_sums
from daskpty.metrics import nrmse
from daskpty.physics.backend import get_xp
from daskpty.physics.geometry import NearFieldGeometry
from daskpty.physics.multislice import multislice_intensities
from daskpty.physics.propagation import near_field_kernel

from synthetic import make_dataset


@dataclasses.dataclass(frozen=True)
class ToyOptions:
    """loss: the chunk gradient's loss; optimizer: plain steps only; lr: the step on the
    illumination-preconditioned gradient; probe_start_epoch: first epoch moving the probe."""

    loss: str = "gaussian"
    optimizer: str | None = None
    lr: float | None = None
    probe_start_epoch: int | None = 1
    delta: float = 0.1
    eps: float = 1e-6

    def __post_init__(self):
        if self.optimizer not in (None, "sgd"):
            raise ValueError(f"the toy engine takes plain gradient steps (optimizer None), not {self.optimizer!r}")

    @property
    def step(self) -> float:
        return 0.5 if self.lr is None else self.lr


def _descend(state, total, options, peak=None):
    """x ← x − lr · g / (W + δ max W) for the object and the probe (``peak``: max W of every tile)."""
    if total is None:
        return state
    accumulate_position_sums(state, total)
    xp = get_xp(state.object)
    illum = xp.zeros(state.object.shape, np.float32)
    total.boxes["illumination"].add_into(illum)
    peak = float(illum.max()) if peak is None else peak
    if "object_grad" in total.boxes:
        g = xp.zeros(state.object.shape, np.complex64)
        total.boxes["object_grad"].add_into(g)
        state.object = (state.object - options.step * g / (illum + options.delta * peak)).astype(np.complex64)
    if "probe_grad" in total.arrays:
        w = total.arrays["probe_illumination"][None]
        state.probe = (state.probe - options.step * total.arrays["probe_grad"] / (w + options.delta * w.max())
                       ).astype(np.complex64)
    state.illumination = illum if state.illumination is None else np.maximum(state.illumination, illum)
    return state


def _next_epoch(state, options):
    state.epoch += 1
    return state


class ToyCore(EngineCore):
    steps = chunk_steps(sm.ad_gradient, refining_chunk_gradient, opr.variable_chunk_gradient, inject="gradient",
                        keep_gram=sm.carries_position_sums)
    tiles = TileSteps(("object", "illumination"), ("object",))  # its apply takes the round's peak
    rescale_probe = staticmethod(lsqml.rescale_probe)
    resample = staticmethod(lsqml.resample_object_state)
    copy_state = staticmethod(copy.copy)  # the steps rebind the state's arrays

    @staticmethod
    def flags(state, options) -> dict:
        moves = options.probe_start_epoch is not None and state.epoch >= options.probe_start_epoch
        return {"want_object": True, "want_probe": moves}

    @staticmethod
    def new_state(obj, probe, epoch, stored):
        return lsqml.LSQMLState(object=obj, probe=probe, epoch=epoch)

    @staticmethod
    def begin_epoch(state, options):
        state.illumination, state.affine_sums = None, None
        return state

    @staticmethod
    def apply(state, total, run, peak=None):
        return _descend(state, total, run.options, None if peak is None else float(np.max(peak)))

    @staticmethod
    def end_epoch(state, run):
        return _next_epoch(state, run.options)

    @staticmethod
    def apply_probe_model(state, total, model, run) -> None:
        opr.apply(state, total, model, run.options.loss, run.options.delta)


TOY = specs.EngineSpec("toy", f"{__name__}:ToyOptions", "plain gradient descent (a test's engine)",
                       frozenset(specs.FEATURES), gradient_based=True,
                       position_defaults=specs.ENGINE_SPECS["ad"].position_defaults,
                       probe_model_defaults=specs.ENGINE_SPECS["ad"].probe_model_defaults,
                       core_path=f"{__name__}:ToyCore")


@pytest.fixture
def toy(monkeypatch):
    """The toy engine in the spec table for one test."""
    monkeypatch.setitem(specs.ENGINE_SPECS, "toy", TOY)
    return "toy"


@pytest.fixture(scope="module")
def data():
    return make_dataset(grid=10, seed=3)


def _run(data, client, epochs=12, **settings):
    """A run from a flat object; its loss per epoch and its NRMSE against the truth where lit,
    and the start's."""
    start = np.ones_like(data.truth.object)
    rec = daskpty.reconstruct(data, "toy", epochs, client=client, progress=False, object=start, **settings)
    lit = rec.illumination > 0.3 * rec.illumination.max()
    losses = [entry["loss"] for entry in rec.history]
    return rec, losses, nrmse(rec.object, data.truth.object, mask=lit), nrmse(start, data.truth.object, mask=lit)


def test_the_toy_engine_reconstructs_with_one_slice(toy, data, client):
    rec, losses, error, start = _run(data, client)
    assert rec.options["engine"] == "toy" and rec.options["tiles"] is False
    assert losses[-1] < 0.4 * losses[0] and error < 0.7 * start, (losses, error, start)


@pytest.mark.parametrize("settings", [{"tiles": True}, {"refine_positions": {"start_epoch": 2}},
                                      {"opr_modes": 2, "probe_model": {"start_epoch": 2}},
                                      {"tiles": True, "refine_positions": {"start_epoch": 2}}],
                         ids=["tiles", "positions", "opr", "tiles-positions"])
def test_the_toy_engine_takes_every_part(toy, data, client, settings):
    rec, losses, error, start = _run(data, client, **settings)
    assert losses[-1] < 0.4 * losses[0] and error < 0.7 * start, (losses, error, start)
    assert rec.options["tiles"] is bool(settings.get("tiles"))
    if "refine_positions" in settings:
        assert np.abs(rec.positions - rec.nominal_positions).max() > 1e-3
    if "opr_modes" in settings:
        assert rec.probe_weights is not None and np.ptp(rec.probe_weights[:, 0]) > 0


def test_the_toy_engine_reconstructs_through_slices(toy, data, client):
    """Each slice takes the whole step's gradient: the step per slice is 1 / K of one slice's."""
    sample = {"slices": 2, "slice_spacing_m": 2e-9, "wavelength_m": 1.97e-12, "object_pixel_size_m": 0.25e-10}
    rec = daskpty.reconstruct(data, "toy", 12, client=client, progress=False, sample=sample, lr=0.25)
    losses = [entry["loss"] for entry in rec.history]
    assert np.shape(rec.object)[0] == 2 and losses[-1] < 0.4 * losses[0], losses


def _near_field_data(seed=0):
    """36 holograms of a phase object 1.12 m behind a 32² probe, 3.65 mm from the sample."""
    rng = np.random.default_rng(seed)
    n = 32
    obj = np.exp(1j * gaussian_filter(rng.standard_normal((60, 60)), 1.5) * 4).astype(np.complex64)
    yy, xx = np.mgrid[0:n, 0:n] - n / 2
    probe = np.exp(3j * gaussian_filter(rng.standard_normal((n, n)), 3)) * np.exp(-(yy**2 + xx**2) / (2 * (n / 3.5) ** 2))
    probe = (probe * np.sqrt(1e5 / (np.abs(probe) ** 2).sum()))[None].astype(np.complex64)
    grid = np.arange(6) * 5.0
    positions = np.stack(np.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2) + n / 2 + 2
    detector = near_field_kernel(n, 55e-6, 0.9795e-10, 1.12, 3.65e-3)
    y = rng.poisson(multislice_intensities(obj[None], probe, positions, detector=detector)).astype(np.float32)
    geometry = NearFieldGeometry(n, 1.12, 55e-6, 3.65e-3, wavelength_m=0.9795e-10)
    return daskpty.from_arrays(y, positions, probe=probe, geometry=geometry)


def test_the_toy_engine_reconstructs_in_the_near_field(toy, client):
    rec = daskpty.reconstruct(_near_field_data(), "toy", 12, client=client, progress=False)
    losses = [entry["loss"] for entry in rec.history]
    assert rec.geometry["detector"] == "near_field" and "sample" in rec.options  # (the sample model's path)
    assert losses[-1] < 0.4 * losses[0], losses


def test_the_toy_engine_is_gone_with_its_spec():
    with pytest.raises(ValueError, match="engine must be one of"):
        specs.engine_spec("toy")
