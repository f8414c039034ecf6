"""Timing for benchmarks that compare sides in one process: each call's wall and CPU time, the sides interleaved.

Imported as `from alternating import alternate` (a script's own folder is on the path when it runs).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen
class Run:
    """One call of one side: what it returned, its wall seconds and this process's CPU seconds (all threads)."""

    value: Any
    wall_s: float
    cpu_s: float


async def timed(call: Callable[[], Any]) -> Run:
    """Call `call()`, awaiting what it returns if that is awaitable, and time the whole of it."""
    t0, c0 = time.perf_counter(), time.process_time()
    value = call()
    if inspect.isawaitable(value):
        value = await value
    return Run(value, time.perf_counter() - t0, time.process_time() - c0)


async def alternate(sides: dict[str, Callable[[int], Any]], rounds: int, *, swap: bool = True) -> dict[str, list[Run]]:
    """Each side called once a round with the round's index, in turn, so a burst of other jobs' load hits both.

    With `swap` the side that goes first alternates (ABBA): neither always runs just after the other has
    evicted its weights from the caches. Returns each side's runs in round order.
    """
    names = list(sides)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[::-1] if swap and i % 2 else names:
            runs[name].append(await timed(functools.partial(sides[name], i)))
    return runs
