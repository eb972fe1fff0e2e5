"""The jax backend: stored blocks are one ``jax.Array`` whose grid axes are sharded over real jax devices,
one jax mesh axis per mesh atom (so sub-axes work), device ``d`` of a mesh being ``jax.devices()[d]``."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import ShardingError
from .grid import GridBackend
from ..layout import grid


class JaxBackend(GridBackend):
    name = "jax"

    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp
        self._jax, self._jnp = jax, jnp

    def owns(self, a: Any) -> bool:
        return isinstance(a, self._jax.Array)

    @property
    def xp(self) -> Any:
        return self._jnp

    def commit(self, x: Any, spec: Any) -> Any:
        return self._jax.device_put(x, atom_sharding(spec, np.ndim(x) - len(_grid(spec).shape)))

    def to_host(self, x: Any) -> np.ndarray:
        if not getattr(x, "is_fully_addressable", True):  # a multi-process array: gathered from every process
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    def fill(self, x: Any, regions: tuple, value: Any) -> Any:
        for idx in regions:
            x = x.at[idx].set(value)
        return x

    def enter(self) -> Any:
        """numpy's dtypes: float64 and int64 stay 64-bit inside the block, through jax's thread-local x64 switch
        (entered only when x64 is off; the global ``jax_enable_x64`` is never written)."""
        if self._jax.config.jax_enable_x64:
            return None
        ctx = self._jax.enable_x64(True)
        ctx.__enter__()
        return ctx

    def leave(self, token: Any) -> None:
        if token is not None:
            token.__exit__(None, None, None)


def _grid(spec):
    return grid(spec)


@lru_cache(maxsize=4096)
def atom_mesh(mesh, atoms: tuple) -> Any:
    """A jax Mesh with one axis per atom (``x`` of 8 cut as ``x:(1)2, x:(2)4`` gives axes of 2 and 4)."""
    import jax
    from jax.sharding import Mesh

    devices = jax.devices()
    if max(mesh.devices) >= len(devices):
        raise ShardingError(f"backend jax: mesh {mesh!r} uses device ids up to {max(mesh.devices)} but jax has "
                            f"{len(devices)} devices (on CPU start jax with "
                            f"XLA_FLAGS=--xla_force_host_platform_device_count={max(mesh.devices) + 1})")
    grid = np.array([devices[d] for d in mesh.devices], dtype=object).reshape(tuple(a.size for a in atoms))
    return Mesh(grid, tuple(atom_name(a) for a in atoms))


def atom_name(atom) -> str:
    return atom.name if atom.is_full else f"{atom.name}:({atom.pre}){atom.size}"


@lru_cache(maxsize=4096)
def atom_sharding(spec, rank: int) -> Any:
    from jax.sharding import NamedSharding, PartitionSpec

    g = _grid(spec)
    entries = [atom_name(a) if s > 1 else None for a, s in zip(g.atoms, g.shape)]
    return NamedSharding(atom_mesh(spec.mesh, g.atoms), PartitionSpec(*entries, *([None] * rank)))
