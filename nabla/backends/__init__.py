"""Where stored blocks live and local kernels run, behind one small interface: ``numpy`` (the default
simulation, every block in host memory) and ``jax`` (each device's block on a real jax device). The active
backend is per context (``with nb.backend("jax"):``), safe across threads and async tasks."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import numpy as np

from ..errors import ShardingError
from .base import Backend
from .numpy import NumpyBackend
from .jax import JaxBackend
from .shapes import ShapesBackend


def _numpy() -> Backend:
    return NumpyBackend()


def require_jax(what: str) -> Any:
    """The ``jax`` module, or a ``ShardingError`` naming ``what`` needs it and how to install it."""
    try:
        import jax
    except ImportError:
        raise ShardingError(f"{what} needs jax: pip install 'nabla-spmd[jax]' (in a clone: pip install -e '.[jax]')") from None
    return jax


def _jax() -> Backend:
    require_jax("backend 'jax'")
    return JaxBackend()


_FACTORIES = {"numpy": _numpy, "jax": _jax}
_instances: dict[str, Backend] = {}
_current: contextvars.ContextVar[str] = contextvars.ContextVar("nabla_backend", default="numpy")
ACTIVE = _current  # the active backend's name (the executor's hot path reads it directly: one call)


def register(name: str, factory) -> None:
    """Make ``nb.backend(name)`` available; ``factory()`` builds the Backend on first use."""
    _FACTORIES[name] = factory


def get(name: str) -> Backend:
    if name not in _instances:
        if name not in _FACTORIES:
            raise ShardingError(f"backend: unknown backend {name!r}; available: {sorted(_FACTORIES)}")
        _instances[name] = _FACTORIES[name]()
    return _instances[name]


NUMPY = get("numpy")
SHAPES = ShapesBackend()  # abstract values' (data None); not a ``nb.backend`` name: chosen by the data


def holding(data: Any) -> Backend:
    """The backend that holds ``data``: ``SHAPES`` for an abstract value's (None), else ``of(data)``."""
    return SHAPES if data is None else of(data)


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """``with nb.backend("jax"):`` place sharded tensors on jax devices and run their ops there."""
    be = get(name)
    token = be.enter()
    var = _current.set(name)
    try:
        yield
    finally:
        _current.reset(var)
        be.leave(token)


def active() -> Backend:
    name = _current.get()
    return NUMPY if name == "numpy" else get(name)


def of(*arrays: Any) -> Backend:
    """The backend an op's result belongs to: the active one, or the one that already holds an input."""
    name = _current.get()
    if name != "numpy":
        return get(name)
    for a in arrays:
        if a is not None and type(a) is not np.ndarray and not NUMPY.owns(a):
            for be in _instances.values():
                if be.owns(a):
                    return be
    return NUMPY


def xp(*arrays: Any) -> Any:
    """The array namespace for these arrays (jax.numpy if any lives on jax, else numpy)."""
    for a in arrays:
        if type(a) is not np.ndarray and not isinstance(a, (np.generic, int, float, bool, complex)):
            for be in _instances.values():
                if be is not NUMPY and be.owns(a):
                    return be.xp
    return np


def to_host(x: Any) -> np.ndarray:
    return NUMPY.to_host(x) if type(x) is np.ndarray else of(x).to_host(x)
