"""Timing shared by nabla and its peers (each peer runs in its own process).

``measure``: seconds per call, the median of calibrated repeats. ``interleaved``: several functions
measured in alternating rounds, each keeping its best round, so that load from other processes on a
shared machine slows every side alike instead of whichever happened to run during a burst."""

from __future__ import annotations

import time
from statistics import median
from typing import Callable


def measure(fn: Callable[[], object], quick: bool = False, sync: Callable[[object], object] = lambda r: r) -> float:
    """Seconds per call: calibrate a loop to ~budget, repeat it, return the median."""
    budget = 0.02 if quick else 0.2
    repeats = 3 if quick else 7
    sync(fn())  # warm up: caches, compilation
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            r = fn()
        sync(r)
        dt = time.perf_counter() - t
        if dt >= budget or n >= 1 << 20:
            break
        n = max(n * 2, int(n * budget / max(dt, 1e-9)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            r = fn()
        sync(r)
        times.append((time.perf_counter() - t) / n)
    return median(times)


def interleaved(fns: dict[str, Callable[[], object]], quick: bool = False, rounds: int | None = None,
                sync: Callable[[object], object] = lambda r: r) -> dict[str, float]:
    """Seconds per call of each function: ``measure`` in ``rounds`` alternating rounds, best round kept."""
    rounds = rounds or (2 if quick else 5)
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = measure(fn, quick, sync)
            best[name] = min(best.get(name, t), t)
    return best
