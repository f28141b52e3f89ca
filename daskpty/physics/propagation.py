"""Far-field (Fraunhofer) propagator and its adjoint.

Orthonormal FFT with the zero frequency at index 0 (engine convention); recorded
patterns have DC at the centre and are ``ifftshift``-ed once when loaded.
"""
from __future__ import annotations

from .backend import fft2, ifft2


def far_field(exit_waves):
    """Propagate exit waves (..., n, n) to the detector: orthonormal 2-D FFT."""
    return fft2(exit_waves)


def far_field_adjoint(far):
    """Adjoint (= inverse, the FFT being unitary) of :func:`far_field`."""
    return ifft2(far)
