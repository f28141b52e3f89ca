"""The PIE family's engine core (:mod:`.core`; rPIE, ePIE): its chunk step through the sample's
forward model (:func:`.pie.chunk_step`) and the epoch's end."""
from __future__ import annotations

import copy
from functools import partial

from . import lsqml, pie
from .core import EngineCore, TileSteps, chunk_steps


def _step(sample):
    """The rPIE / 3PIE chunk step through ``sample``."""
    return partial(pie.chunk_step, sample=sample)


class PIECore(EngineCore):
    steps = chunk_steps(_step, pie.refining_chunk_step)
    device_fields = ("object", "probe", "illumination")
    tiles = TileSteps(("object", "illumination"), ("object",), end_numbers=("scales",))
    begin_epoch = staticmethod(pie.begin_epoch)
    rescale_probe = staticmethod(lsqml.rescale_probe)
    resample = staticmethod(lsqml.resample_object_state)
    copy_state = staticmethod(copy.copy)  # apply rebinds the state's arrays

    @staticmethod
    def flags(state, options) -> dict:
        return {"update_probe": pie.updates_probe(state, options)}

    @staticmethod
    def new_state(obj, probe, epoch: int, stored: dict):
        return lsqml.LSQMLState(object=obj, probe=probe, epoch=epoch)

    @staticmethod
    def apply(state, total, run, peak=None):
        return pie.apply(state, total, run.options, illumination_max=peak)

    @staticmethod
    def end_epoch(state, run, scales=None):
        return pie.end_epoch(state, run.options, scales)
