"""Numpy helpers the window kernels share: the epilogue's residual and relu in place (relu on numpy's
vectorised loop), and arrays derived from read-only weight blocks, made once and kept while those live."""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Callable

import numpy as np


def finish(dst: np.ndarray, res: np.ndarray | None, relu: bool) -> None:
    """The epilogue's residual and relu, in place on output a kernel just made (still in cache)."""
    if res is not None:
        np.add(dst, res, out=dst, casting="unsafe")
    if relu:
        relu_inplace(dst)


# The most zeros kept for relu (2**20, 4 MB of float32): the kernels' cache-sized chunks stay under it; a
# larger array (a whole block through ``kernels.epilogue``) takes the scalar form rather than a kept copy of it.
_ZEROS_BITS = 20


def relu_inplace(y: np.ndarray) -> np.ndarray:
    """``max(y, 0)`` in place on a numpy array: against an array of zeros, which numpy's vectorised loop
    takes (against a scalar 0, or a broadcast one, it ran 2.5x slower)."""
    bits = max(0, y.size - 1).bit_length()
    if bits > _ZEROS_BITS:
        return np.maximum(y, y.dtype.type(0), out=y)
    return np.maximum(y, _zeros(bits, y.dtype)[:y.size].reshape(y.shape), out=y)


@lru_cache(maxsize=16)
def _zeros(bits: int, dtype: np.dtype) -> np.ndarray:
    """``2**bits`` zeros, read-only: sizes rounded up to a power of two, so a few arrays serve every size."""
    z = np.zeros(1 << bits, dtype)
    z.flags.writeable = False
    return z


# Arrays derived from weight blocks (the GEMM weight with its bias column, the Winograd-domain weight), by
# (kind, each source's root array id, offset, shape, strides): a model's weights are read-only blocks used
# on every call, so each is transformed once and kept until its memory goes (a weakref callback drops it).
_DERIVED: dict[tuple, tuple[tuple[weakref.ref, ...], np.ndarray]] = {}


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def derived(kind: str, sources: tuple[np.ndarray, ...], make: Callable[[], np.ndarray]) -> np.ndarray:
    """``make()``, an array computed from ``sources``: computed once while they live when they and the
    arrays they view are read-only (their values cannot change), on every call otherwise."""
    roots = tuple(_root(a) for a in sources)
    if any(a.flags.writeable or r.flags.writeable for a, r in zip(sources, roots)):
        return make()
    key = (kind,) + tuple((id(r), a.__array_interface__["data"][0], a.shape, a.strides)
                          for a, r in zip(sources, roots))
    hit = _DERIVED.get(key)
    if hit is not None and all(ref() is r for ref, r in zip(hit[0], roots)):
        return hit[1]
    value = make()
    value.flags.writeable = False

    def drop(_, key=key):
        _DERIVED.pop(key, None)

    _DERIVED[key] = (tuple(weakref.ref(r, drop) for r in roots), value)
    return value


def gemm_weight(w: np.ndarray, bias: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """``w (O, C/groups, *K)`` as a GEMM's ``(O, C/groups*K)`` matrix, with ``bias (O,)`` as one more
    column when given (kept with the blocks: :func:`derived`)."""
    O = w.shape[0]
    if bias is None:
        return w.astype(dtype, copy=False).reshape(O, -1)
    return derived("bias", (w, bias), lambda: np.concatenate(
        [w.astype(dtype, copy=False).reshape(O, -1), bias.astype(dtype, copy=False).reshape(O, 1)], axis=1))
