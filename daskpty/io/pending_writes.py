"""Waiting for zarr's chunk writes that outlive an interrupted call.

zarr v3 runs every store operation as a coroutine on its own IO thread and the calling thread
only waits for it. A ``KeyboardInterrupt`` (a second Ctrl-C) ends that wait, not the write: its
chunk writes go on and recreate a store's directories after the caller removed them. A writer
that discards a partial store after an interrupt therefore first lets those writes finish.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Callable


def settle_zarr_writes(timeout: float = 3.0) -> bool:
    """Wait at most ``timeout`` seconds until zarr's IO loop runs no task but this wait; returns
    True when it is idle (or was never started), False when tasks were still running."""
    from zarr.core import sync as zarr_sync

    loop = zarr_sync.loop[0]
    if loop is None or loop.is_closed() or not loop.is_running():
        return True

    async def others_done() -> bool:
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if not others:
            return True
        _, pending = await asyncio.wait(others, timeout=timeout)
        return not pending

    future = asyncio.run_coroutine_threadsafe(others_done(), loop)
    with contextlib.suppress(Exception):
        return bool(future.result(timeout + 1.0))
    return False


def despite_interrupts(clean_up: Callable[[], None]) -> None:
    """Run the idempotent ``clean_up`` to its end even when Ctrl-C lands in it (a second one,
    right after the first stopped a write), repeating it after each interrupt; the last
    interrupt is raised once it has finished. The interrupt guard of the command line still
    ends a run that takes too long."""
    interrupt = None
    while True:
        try:
            clean_up()
            break
        except KeyboardInterrupt as exc:
            interrupt = exc
    if interrupt is not None:
        raise interrupt
