"""LSQML's engine core (:mod:`.core`): its chunk steps for every part combination, apply and the
epoch's end for the sample in use, on whole objects, in place and on tiles."""
from __future__ import annotations

import copy

from . import lsqml, lsqml_opr
from . import sample_model as sm
from .core import EngineCore, InPlaceSteps, TileSteps, chunk_steps


def _apply_in_place(state, total, options, peak=None):
    return state if total is None else lsqml.apply_in_place(state, total, options, peak)


def _end_epoch(state, run, in_place: bool = False, agree=None, scales=None):
    return lsqml.end_epoch(state, run.options, agree=agree, scales=scales, in_place=in_place)


class LSQMLCore(EngineCore):
    steps = chunk_steps(sm.lsqml_step, lsqml.refining_chunk_step, lsqml_opr.variable_chunk_step)
    device_fields = ("object", "probe", "velocity", "illumination", "epoch_start_object")
    tiles = TileSteps(("object", "velocity", "epoch_start_object", "illumination"), ("object", "velocity"),
                      end_numbers=("agree", "scales"))
    in_place = InPlaceSteps(lsqml.begin_owned_epoch, _apply_in_place,
                            lambda state, run, **numbers: _end_epoch(state, run, in_place=True, **numbers))
    begin_epoch = staticmethod(lsqml.begin_epoch)
    end_epoch = staticmethod(_end_epoch)
    rescale_probe = staticmethod(lsqml.rescale_probe)
    resample = staticmethod(lsqml.resample_object_state)
    copy_state = staticmethod(copy.copy)  # apply rebinds the state's arrays

    @staticmethod
    def flags(state, options) -> dict:
        return {"update_probe": state.update_probe(options)}

    @staticmethod
    def epoch_options(state, options):
        return options.at_epoch(state.epoch)   # the noise model's warm-up

    @staticmethod
    def new_state(obj, probe, epoch: int, stored: dict):
        return lsqml.LSQMLState(object=obj, probe=probe, epoch=epoch, velocity=stored.get("velocity"))

    @staticmethod
    def stored(state) -> dict:
        return {} if state.velocity is None else {"velocity": state.velocity}

    @staticmethod
    def apply(state, total, run):
        return lsqml.apply(state, total, run.options)

    @staticmethod
    def apply_probe_model(state, total, model, run) -> None:
        lsqml_opr.apply(state, total, model, run.options.object_delta, run.valid)
