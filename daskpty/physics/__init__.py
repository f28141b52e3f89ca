"""Physics layer: forward operators with their adjoints, noise models, probe modes.

Plain functions on NumPy or CuPy arrays (the namespace of the input); no dask here.
"""
from .backend import fft2, get_xp, ifft2, set_fft_workers, to_numpy
from .forward import exit_waves, model_intensities
from .modes import mode_powers, orthogonalize_modes
from .noise import (
    gaussian_correction,
    gaussian_loss,
    model_intensity,
    poisson_correction,
    poisson_loss,
    poisson_step_lengths,
)
from .noise_models import NOISE_MODELS, NoiseModel, get_noise_model, noise_model_names, register_noise_model
from .patches import check_windows_inside, extract_patches, scatter_add_patches
from .propagation import far_field, far_field_adjoint
from .shifts import shift_images, shift_probe, shift_probe_adjoint, shift_ramps, split_positions

__all__ = [
    "NOISE_MODELS", "NoiseModel", "check_windows_inside", "exit_waves", "extract_patches", "far_field",
    "far_field_adjoint", "fft2", "gaussian_correction", "gaussian_loss", "get_noise_model", "get_xp", "ifft2",
    "mode_powers", "model_intensities", "model_intensity", "noise_model_names", "orthogonalize_modes", "poisson_correction",
    "poisson_loss", "poisson_step_lengths", "register_noise_model", "scatter_add_patches", "set_fft_workers", "shift_images",
    "shift_probe", "shift_probe_adjoint", "shift_ramps", "split_positions", "to_numpy",
]
