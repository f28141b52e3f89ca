"""Input/output: the Zarr v3 data-set store, its validation, scan-geometry helpers, importers
of measured files (:mod:`.importers`) and exporters of reconstructions (:mod:`.export`).

Names are imported lazily (PEP 562) so ``import daskpty`` stays cheap and dask/zarr load only
when a store is used.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "PtychoData": ".store",
    "Truth": ".metadata",
    "open_data": ".store",
    "from_arrays": ".store",
    "shard_layout": ".writing",
    "DEFAULT_SHARD_BYTES": ".writing",
    "DEFAULT_INNER_BYTES": ".writing",
    "DataError": ".validate",
    "ValueReport": ".validate",
    "check_values": ".validate",
    "FORMAT_NAME": ".validate",
    "FORMAT_VERSION": ".validate",
    "import_file": ".importers",
    "import_cxi": ".importers",
    "import_hdf5": ".importers",
    "import_empad": ".importers",
    "import_numpy": ".importers",
    "import_tiff": ".importers",
    "export_cxi": ".export",
    "export_hdf5": ".export",
    "export_tiff": ".export",
    "export_png": ".export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
