"""Where stored blocks live and local kernels run: numpy arrays (the default simulation) or, inside
``with nb.backend("jax")``, jax arrays whose grid axes are sharded over real jax devices, so each device
holds exactly its block, kernels run where the blocks are and moves between layouts are real transfers."""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import Any, Iterator

import numpy as np

from .errors import ShardingError

_BACKENDS = ("numpy", "jax")
_current = ["numpy"]


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """``with nb.backend("jax"):`` place sharded tensors on jax devices and run their ops there."""
    if name not in _BACKENDS:
        raise ShardingError(f"backend: unknown backend {name!r}; available: {list(_BACKENDS)}")
    if name == "jax":
        import jax  # fails here, with jax's own message, if jax is not installed
        jax.config.update("jax_enable_x64", True)  # numpy's dtypes: float64 and int64 stay 64-bit
    _current.append(name)
    try:
        yield
    finally:
        _current.pop()


def active() -> str:
    return _current[-1]


def is_jax(a: Any) -> bool:
    return type(a) is not np.ndarray and type(a).__module__.startswith("jax")


def xp(*arrays: Any):
    """The array namespace for these arrays: jax.numpy if any is a jax array, else numpy."""
    for a in arrays:
        if is_jax(a):
            import jax.numpy as jnp
            return jnp
    return np


def wanted(*arrays: Any) -> bool:
    """Whether a result should live on jax devices: the jax backend is on, or an input already does."""
    if _current[-1] == "jax":
        return True
    for a in arrays:
        if is_jax(a):
            return True
    return False


def put(x: Any, spec) -> Any:
    """Lay stored blocks ``x`` (grid of ``spec``'s own atoms in front) onto the jax devices that own them."""
    import jax
    return jax.device_put(x, _sharding(spec, np.ndim(x) - len(_grid(spec).shape)))


def to_host(x: Any) -> np.ndarray:
    return np.asarray(x)


def _grid(spec):
    from .layout import grid
    return grid(spec)


@lru_cache(maxsize=4096)
def _sharding(spec, rank: int):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = spec.mesh
    devices = jax.devices()
    if max(mesh.devices) >= len(devices):
        raise ShardingError(f"backend jax: mesh {mesh!r} uses device ids up to {max(mesh.devices)} but jax has "
                            f"{len(devices)} devices (on CPU start jax with "
                            f"XLA_FLAGS=--xla_force_host_platform_device_count={mesh.size})")
    entries = []
    for atom, size in zip(_grid(spec).atoms, _grid(spec).shape):
        if size > 1 and not atom.is_full:
            raise ShardingError(f"backend jax: spec {spec!r} shards over sub-axis {str(atom)!r}; the jax backend "
                                f"places whole mesh axes only")
        entries.append(atom.name if size > 1 else None)
    jmesh = Mesh(np.array([devices[d] for d in mesh.devices], dtype=object).reshape(mesh.shape), mesh.axis_names)
    return NamedSharding(jmesh, PartitionSpec(*entries, *([None] * rank)))
