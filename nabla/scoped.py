"""A context variable set for a block: how nabla scopes a flag (a phase, a scope label, a strategy, a recorder),
one helper instead of a set/try/reset at each place; and the one process-wide setting nabla changes for a block,
CPython's collector thresholds during a long search."""

from __future__ import annotations

import contextlib
import contextvars
import gc
import threading
from typing import Any, Iterator


class setting:  # noqa: N801 - used as a function: ``with setting(var, value):``
    """``var`` set to ``value`` inside the block (yielding ``result``), restored after it. A class, not a
    generator: each replayed layer enters hundreds of these, and a generator's context manager costs twice as much."""

    __slots__ = ("var", "value", "result", "token")

    def __init__(self, var: contextvars.ContextVar, value: Any, result: Any = None) -> None:
        self.var, self.value, self.result = var, value, result

    def __enter__(self) -> Any:
        self.token = self.var.set(self.value)
        return self.result

    def __exit__(self, *exc: Any) -> None:
        self.var.reset(self.token)


class _Collector:
    """Who holds CPython's collector thresholds raised: the thresholds are the interpreter's, so the first block
    to enter saves them and the last to leave restores them, whichever threads they run on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved: tuple[int, ...] = ()

    def enter(self, young: int) -> None:
        with self.lock:
            if self.depth == 0:
                self.saved = gc.get_threshold()
                gc.set_threshold(max(young, self.saved[0]), *(max(20, t) for t in self.saved[1:]))
            self.depth += 1

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                gc.set_threshold(*self.saved)


_COLLECTOR = _Collector()


@contextlib.contextmanager
def few_collections(young: int = 50_000) -> Iterator[None]:
    """A block run with CPython's cyclic collector at high thresholds. A search (``nb.autoshard``, an estimate
    of a large step) builds hundreds of thousands of small records that live until it ends, and the default
    collector rescans every one of them each time the survivors grow by a quarter, freeing almost nothing
    (measured: 3.5 s of a 16.7 s autoshard of Llama-2-70B on 64 devices; 12.4 s with this). Cycles are still
    collected (every ``young`` allocations); the thresholds come back when the last such block ends."""
    _COLLECTOR.enter(young)
    try:
        yield
    finally:
        _COLLECTOR.leave()
