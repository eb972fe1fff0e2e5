"""The primitive table: JAX primitive name -> the function that runs one equation of it as nabla ops. The family
modules fill it with ``@primitive(...)``; the interpreter reads it. A handler is ``fn(ev, e, *operands)``: the
running call's context, the compiled equation (``e.params``, ``e.out_avals``) and the operands (tensors, numpy
scalars for literals, ``Key``s for PRNG keys); it returns the result, or a list for a multi-result primitive."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..ops import abstract, tensor
from ..tensor import Tensor

Handler = Callable[..., Any]

#: primitive name -> handler
TABLE: dict[str, Handler] = {}
#: primitives whose equation runs a sub-program (jit, scan, cond, ...): their own ops carry their own labels
CALLS: set[str] = set()
#: primitives that act element by element (what a gradient's path into an optimizer is made of)
ELEMENTWISE: set[str] = set()
#: primitive name -> the handler used when an operand is a PRNG key array (shape ops on keys)
KEYED: dict[str, Handler] = {}


def primitive(*names: str, call: bool = False, elementwise: bool = False) -> Callable[[Handler], Handler]:
    """Register ``fn`` as the handler of the primitives ``names``; ``call``: it runs a sub-program;
    ``elementwise``: it acts element by element."""
    def mark(fn: Handler) -> Handler:
        for n in names:
            TABLE[n] = fn
            if call:
                CALLS.add(n)
            if elementwise:
                ELEMENTWISE.add(n)
        return fn
    return mark


def keyed(*names: str) -> Callable[[Handler], Handler]:
    """Register ``fn`` as the handler of the primitives ``names`` on PRNG key arrays."""
    def mark(fn: Handler) -> Handler:
        for n in names:
            KEYED[n] = fn
        return fn
    return mark


def as_tensor(x: Any) -> Tensor:
    """An operand as a tensor (a literal becomes a host tensor of its numpy dtype)."""
    return x if isinstance(x, Tensor) else tensor(np.asarray(x))


def static_int(x: Any, what: str) -> int:
    """The value of a scalar operand that decides a shape or a position (read on the host)."""
    if isinstance(x, Tensor):
        return int(x.numpy())
    return int(x)


#: elements above which a value made from constants alone is kept abstract in an abstract run
CONST_LIMIT = 1 << 16


def const(ev: Any, value: np.ndarray) -> Tensor:
    """A value the program makes from constants alone (an iota, a broadcast literal): a host tensor; when the
    program runs without data and the value is large, an abstract one (planning needs its shape, not its bytes)."""
    if ev.abstract and value.size > CONST_LIMIT:
        return abstract(value.shape, value.dtype)
    return tensor(value)
