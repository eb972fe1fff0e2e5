"""Timing shared by nabla and its peers (each peer runs in its own process).

``measure``: seconds per call, the median of calibrated repeats. ``interleaved``: several functions
measured in alternating rounds, each keeping its best round, so that load from other processes on a
shared machine slows every side alike instead of whichever happened to run during a burst. ``alternating``:
the same number of equally long samples of every side, alternated, reported as a median with quartiles (for
ratios that are targets: one statistic for every side)."""

from __future__ import annotations

import time
from statistics import median, quantiles
from typing import Callable, NamedTuple


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


class Spread(NamedTuple):
    """Seconds per call over ``repeats`` samples: the median, and the quartiles as the spread."""

    median: float
    q1: float
    q3: float
    repeats: int
    samples: tuple = ()  # in the order taken: sample i of every side was taken in the same round

    def as_dict(self, scale: float = 1.0) -> dict:
        return {"median": self.median * scale, "q1": self.q1 * scale, "q3": self.q3 * scale, "repeats": self.repeats}


def alternating(fns: dict[str, Callable[[], object]], repeats: int, calls: int | None = None, budget: float = 0.05,
                sync: Callable[[object], object] = lambda r: r) -> dict[str, Spread]:
    """Seconds per call of each function, one statistic for all: samples taken A, B, A, B, ... (``repeats`` of
    each, every sample ``calls`` calls, the same for every side), so load from others lands on every side
    alike; the median of each side's samples, with its quartiles. ``calls`` defaults to what makes the fastest
    side's sample last ``budget`` seconds."""
    once = {}
    for name, fn in fns.items():  # warm up (caches, compilation) and size the samples
        sync(fn())
        t = time.perf_counter()
        sync(fn())
        once[name] = time.perf_counter() - t
    if calls is None:
        calls = max(1, int(budget / max(min(once.values()), 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                r = fn()
            sync(r)
            samples[name].append((time.perf_counter() - t) / calls)
    return {name: _spread(v) for name, v in samples.items()}


def _spread(v: list[float]) -> Spread:
    q = quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return Spread(median(v), q[0], q[2], len(v), tuple(v))


def paired(a: Spread, b: Spread) -> list[float]:
    """The quartiles of a / b taken round by round: load that hit one round hit both sides of it."""
    q = quantiles([x / y for x, y in zip(a.samples, b.samples)], n=4, method="inclusive")
    return [q[0], q[2]]
