"""The interface between the round loop and an engine, written down as typing Protocols.

An engine writes its per-chunk mathematics and a small core in ``daskpty/engines``
(:mod:`daskpty.engines.core`); execution's one adapter (:mod:`.adapter`) binds core and parts
to the round loop of :mod:`.driver`, :mod:`.epoch_graph` and :mod:`.tile_graph` and implements
these Protocols. :class:`EngineAdapter` is what every adapter has; :class:`UpdatesInPlace`,
:class:`RunsOwnRounds` (an apply with extra map-reduces, as AD's CG line search) and
:class:`RunsOnTiles` are there where the core offers them. tests/test_engine_protocol.py checks
every registered engine's adapter against them.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class EngineAdapter(Protocol):
    """What the round loop asks of every engine adapter.

    Attributes: ``name`` (the engine's registry name), ``options`` (its frozen options),
    ``valid`` ((n, n) detector mask with the zero frequency at index 0, or None), ``positions``
    (the position part, :mod:`.parts`), ``local_state`` (True when chunks carry per-pattern
    state from round to round), ``device_fields`` (state attributes kept in GPU memory on GPU
    workers), ``chunk_function`` (module-level, picklable:
    ``chunk_function(intensities, positions, payload, local=None) -> Partial``).
    """

    name: str
    options: Any
    valid: Any
    positions: Any
    local_state: bool
    device_fields: tuple
    chunk_function: Callable

    def payload(self, state) -> Any:
        """The small, picklable bundle broadcast to every chunk step of a round (object, probe, options)."""

    def apply(self, state, total):
        """The state after adding a round's reduced Partial (new arrays; the old state stays valid)."""

    def begin_epoch(self, state):
        """The state at the start of an epoch (reset per-epoch sums)."""

    def end_epoch(self, state):
        """The state at the end of an epoch (momentum, mode orthogonalisation, scale; epoch += 1)."""

    def new_state(self, obj, probe, epoch: int = 0, engine_state: dict | None = None):
        """A state from an object, a probe and (when resuming) the arrays of :meth:`engine_state`."""

    def engine_state(self, state) -> dict:
        """The arrays beyond object and probe needed to continue bit for bit (checkpoints)."""

    def initialise(self, client, data, state, *, split_every: int):
        """First-epoch set-up over the data (the probe's intensity rescale)."""

    def epoch_scalars(self, state) -> dict:
        """Engine-specific numbers for the epoch's history entry ({} when none)."""

    def initial_local(self, nominal) -> dict:
        """Each chunk's starting per-pattern state from its nominal positions (called only when
        ``local_state``)."""

    def copy_state(self, state):
        """A copy of ``state`` that :meth:`apply` may change without touching ``state`` (cheap
        when ``apply`` only rebinds the state's arrays)."""


@runtime_checkable
class UpdatesInPlace(Protocol):
    """Optional: an adapter whose update can write into the state's arrays where nothing else
    holds them (the client's round-by-round epochs): no copy of an object-sized state per round."""

    def begin_epoch_owned(self, state):
        """``begin_epoch``, leaving arrays of the epoch's own (the arrays it got may still be
        held by the previous epoch's handle: never written)."""

    def apply_in_place(self, state, total):
        """``apply`` writing into the arrays :meth:`begin_epoch_owned` gave the epoch."""

    def end_epoch_owned(self, state):
        """``end_epoch`` writing into them too (the state it returns is the next epoch's start)."""


@runtime_checkable
class RunsOwnRounds(Protocol):
    """Optional: an adapter whose round is more than one map-reduce and an apply."""

    needs_evaluations: bool

    def run_round(self, client, data, state, *, round_index: int = 0, rounds: int = 1,
                  split_every: int | None = None, local: dict | None = None):
        """Run one round; returns ``(state, total)``."""


@runtime_checkable
class RunsOnTiles(Protocol):
    """Optional: an adapter whose state can be cut into row tiles of the object
    (:mod:`.tile_graph`). Each worker holds a tile (its own rows and a halo, in the tile's frame);
    the whole-object numbers of ``apply`` and ``end_epoch`` come as every tile's share over its
    own rows (``own``: those rows in the tile's frame), in worker order."""

    tile_fields: tuple  # state attributes in the object's frame (..., H, W), cut by rows
    tile_sums_function: Callable  # chunk function of the first epoch's sums, on a tile's payload
    tile_round_stages: int  # rounds of shares an update needs (2: a second needs the first's sums)
    tile_warped_fields: tuple  # tile_fields the window correction resamples (their halos refreshed)
    positions: object  # the position part (:mod:`.parts`; its ``reach`` widens the halo)

    def tile_initialise(self, state, sums):
        """``initialise`` from ``tile_sums_function``'s sums over all chunks (reduced)."""

    def tiles_unsupported(self) -> str | None:
        """What in this adapter's parts cannot run on tiles yet (None: everything can)."""

    def tile_begin_epoch(self, state):
        """``begin_epoch`` on a tile, leaving ``tile_apply`` arrays of the epoch's own to write
        into (the arrays it got are shared with the previous epoch's end, never written)."""

    def tile_round_sums(self, state, total, own, *earlier) -> dict:
        """This tile's share of the whole-object numbers ``tile_apply`` needs; at stage s > 0,
        ``earlier`` holds every tile's shares of stages 0 … s − 1 (a list per stage)."""

    def tile_apply(self, state, total, shares):
        """``apply`` on a tile, in place (a round's state is used by nothing after its next
        round's update); ``shares``: every tile's ``tile_round_sums``."""

    def tile_finish_positions(self, state) -> None:
        """With ``positions``: the refinement's epoch end on a tile (window fit, the object's
        resampling, affine fit), in place, before ``tile_end_sums`` (the state's ``extra``
        holds the tile's :class:`~daskpty.engines.tile_frame.TileFrame`)."""

    def tile_end_sums(self, state, own) -> dict:
        """This tile's share of the whole-object numbers ``tile_end_epoch`` needs."""

    def tile_end_epoch(self, state, shares):
        """``end_epoch`` on a tile; ``shares``: every tile's ``tile_end_sums``."""
