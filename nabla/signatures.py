"""Signatures: what the executor's cached decisions depend on of each operand (sharded or host, shape, dtype,
layout; a scalar's type), interned as small ints so a program is looked up by a tuple of ints; and the dtype of
an op's result on given signatures."""

from __future__ import annotations

import itertools
import threading
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from .opdef import Local, OpDef
from .value import Value

# The signature intern table: signature -> id and back. Ids are never reused; when the table holds
# ``_SIG_LIMIT`` signatures it is emptied (a program run with so many shapes would not reuse most of them), and
# values holding an id from before are given a new one on their next use (``StaleSignature``).
_SIG_IDS: dict[tuple, int] = {}
_SIGS: dict[int, tuple] = {}
_SCALAR_IDS: dict[type, int] = {}
_SIG_LIMIT = 1 << 15
_NEXT_SID = itertools.count()  # (taken under _SIG_LOCK)
_SIG_LOCK = threading.Lock()


class StaleSignature(Exception):
    """A signature id from before the intern table was emptied."""


def sig_id(sig: tuple) -> int:
    """The small int naming signature ``sig`` (interned: a new signature gets the next id)."""
    i = _SIG_IDS.get(sig)
    if i is None:
        with _SIG_LOCK:  # two threads meeting a new signature at once must not share an id
            i = _SIG_IDS.get(sig)
            if i is None:
                if len(_SIG_IDS) >= _SIG_LIMIT:
                    _SIG_IDS.clear()
                    _SIGS.clear()
                    _SCALAR_IDS.clear()
                i = next(_NEXT_SID)
                _SIG_IDS[sig] = i
                _SIGS[i] = sig
    return i


def signature(a: Any) -> tuple:
    """``a``'s signature: ``("s"|"h", shape, dtype, spec)`` (sharded or host), or ``("c", type)`` for a scalar."""
    if isinstance(a, Value):
        return ("s" if a._spec is not None else "h", a._shape, a._dtype, a._spec)
    return ("c", type(a))


def sid_of(a: Any) -> int:
    """A small int naming ``a``'s signature: ``("s"|"h", shape, dtype, spec)``, or ``("c", type)`` for scalars."""
    if isinstance(a, Value):
        i = a._sid
        return i if i >= 0 else a.signature_id(lambda: sig_id(signature(a)))
    t = type(a)
    i = _SCALAR_IDS.get(t)
    if i is None:
        i = sig_id(("c", t))
        _SCALAR_IDS[t] = i
    return i

def signatures_of(sids: Sequence[int]) -> tuple:
    """The signatures named by ``sids``; ``StaleSignature`` if the table was emptied since they were handed out."""
    try:
        return tuple(_SIGS[i] for i in sids)
    except KeyError:
        raise StaleSignature() from None


@lru_cache(maxsize=4096)
def result_dtype(op: OpDef, sigs: tuple, params: tuple) -> np.dtype:
    """The dtype of ``op``'s result on operands of signatures ``sigs``: its rule's, else sampled from its kernel."""
    if callable(op.dtype) and not isinstance(op.dtype, type):  # from the operands' dtypes
        return np.dtype(op.dtype(*(s[2] for s in sigs if s[0] != "c")))
    if op.dtype == "same":
        return next(s[2] for s in sigs if s[0] != "c")
    if op.dtype != "sample":
        return np.dtype(op.dtype)
    samples = [np.zeros((1,) * len(s[1]), dtype=s[2]) if s[0] != "c" else s[1](0) for s in sigs]
    shape = op.rule(tuple(s[1] if s[0] != "c" else () for s in sigs), *params).result_shape
    with np.errstate(all="ignore"):
        out = op.kernel(samples, Local(0, tuple(1 for _ in shape), params))
    return np.asarray(out).dtype
