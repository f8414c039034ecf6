"""benchmarks/alternating.py: the sides run in turn (ABBA unless told not to), each call timed, its value kept."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

# appended, not put first: a benchmark named after a package (benchmarks/qwen_tts.py) must not shadow it
sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

from alternating import alternate


def _sides(calls: list):
    async def a(i):
        calls.append(("a", i))
        await asyncio.sleep(0.02)  # wall time, hardly any CPU
        return f"a{i}"

    def b(i):
        calls.append(("b", i))
        end = time.process_time() + 0.02
        while time.process_time() < end:  # CPU time
            pass
        return f"b{i}"

    return {"a": a, "b": b}


def test_abba_order_values_and_times():
    calls: list = []
    runs = asyncio.run(alternate(_sides(calls), 4))
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3)]
    assert [r.value for r in runs["a"]] == ["a0", "a1", "a2", "a3"] and [r.value for r in runs["b"]] == \
        ["b0", "b1", "b2", "b3"]
    assert all(r.wall_s >= 0.02 for r in runs["a"])  # an awaitable's whole run is timed, not just its creation
    assert all(r.cpu_s >= 0.02 for r in runs["b"])  # this process's CPU


def test_without_swap_the_first_side_always_leads():
    calls: list = []
    asyncio.run(alternate(_sides(calls), 3, swap=False))
    assert [side for side, _ in calls] == ["a", "b"] * 3
