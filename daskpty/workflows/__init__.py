"""Workflows built on :func:`daskpty.reconstruct` (above the api layer)."""
from .follow import ScanStopped, follow
from .half_set import half_set_frc

__all__ = ["ScanStopped", "follow", "half_set_frc"]
