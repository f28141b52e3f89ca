"""Workflows built on :func:`daskpty.reconstruct` (above the api layer)."""
from .half_set import half_set_frc

__all__ = ["half_set_frc"]
