"""A context variable set for a block: how nabla scopes a flag (a phase, a scope label, a strategy, a recorder),
one helper instead of a set/try/reset at each place."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator


@contextlib.contextmanager
def setting(var: contextvars.ContextVar, value: Any, result: Any = None) -> Iterator[Any]:
    """``var`` set to ``value`` inside the block (yielding ``result``), restored after it."""
    token = var.set(value)
    try:
        yield result
    finally:
        var.reset(token)
