"""Figures of merit: aligned NRMSE, Fourier ring correlation, probe error; the half-set FRC's parts.

Pure NumPy/SciPy, host arrays only (pass ``cupy.asnumpy(x)`` for device arrays). Reductions run in
float64 / complex128 whatever the input precision. The half-set FRC itself runs two reconstructions
and lives with the workflows: :func:`daskpty.workflows.half_set_frc`.

- :mod:`.registration`: :func:`align` (global complex scale, sub-pixel shift, linear phase ramp)
- :mod:`.errors`: :func:`nrmse`, :func:`probe_error`, :func:`nrmse_vs_truth`, :func:`truth_frame`
- :mod:`.frc`: :func:`frc`, :func:`registered_frc`, :func:`split_halves`, :func:`common_region`
"""
from .errors import NRMSE_CROP, central_window, nrmse, nrmse_vs_truth, probe_error, truth_frame
from .frc import (BAND, FRCResult, HalfSetFRC, common_region, frc, illumination_map, registered_frc,
                  split_halves)
from .registration import Alignment, align

__all__ = ["BAND", "NRMSE_CROP", "Alignment", "FRCResult", "HalfSetFRC", "align", "central_window",
           "common_region", "frc", "illumination_map", "nrmse", "nrmse_vs_truth", "probe_error",
           "registered_frc", "split_halves", "truth_frame"]
