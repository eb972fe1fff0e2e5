"""``nb.from_jax``: a jax.Array back as a tensor with its NamedSharding (onto the nabla mesh it came from, when it
went to jax with ``t.to_jax()``, or onto the mesh given)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import require_jax
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..sharding import pad
from ..spec import ShardingSpec
from ..placement import from_local
from ..tensor import Tensor
from .jax import _ATOMS, _KNOWN, _jax_key, remember


def _mesh_of(jmesh: Any, mesh: DeviceMesh | None) -> DeviceMesh:
    """The nabla mesh for a jax mesh: ``mesh`` when given, else one seen before with the same devices and axis
    names, else a new one named "jax"."""
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(f"from_jax(array, mesh): mesh must be a nabla DeviceMesh, got {type(mesh).__name__}")
        return remember(mesh)
    key = _jax_key(jmesh)
    known = _KNOWN.get(key, _ATOMS.get(key))
    return known if known is not None else remember(DeviceMesh("jax", *key))


def _device_blocks(array: Any) -> dict[int, np.ndarray]:
    """Device id -> the data that device holds. jax cannot list the shards of an array with ``unreduced``
    axes (``device_indices_map`` refuses them), so those are read from its per-device buffers."""
    try:
        return {int(s.device.id): np.asarray(s.data) for s in array.addressable_shards}
    except NotImplementedError:
        return {int(next(iter(a.devices())).id): np.asarray(a) for a in array._arrays}


def from_jax(array: Any, mesh: DeviceMesh | None = None):
    jax = require_jax("from_jax")
    if not isinstance(array, jax.Array):
        raise ShardingError(f"from_jax(array, mesh): expects a jax.Array, got {type(array).__name__} (for a numpy "
                            f"array use nb.tensor(array).shard(mesh, dim_specs))")

    sharding = getattr(array, "sharding", None)
    pspec = getattr(sharding, "spec", None)
    jmesh = getattr(sharding, "mesh", None)
    ndim = len(array.shape)
    if pspec is None or jmesh is None or not hasattr(jmesh, "devices"):  # one device, or not a NamedSharding
        t = Tensor._host(np.asarray(array))
        return t if mesh is None else t.shard(mesh, [None] * ndim)
    if mesh is None and jmesh.devices.size == 1 and _jax_key(jmesh) not in _KNOWN:  # a one-device value
        return Tensor._host(np.asarray(array))
    target = _mesh_of(jmesh, mesh)
    spec = pad(ShardingSpec.from_partition_spec(target, pspec), ndim, "from_jax")  # reads .partitions, unreduced
    if not spec.partial_axes:
        return Tensor._host(np.asarray(array)).shard(target, spec)
    # Pending sums: each device's summand, as jax holds it (the global value is not materialised by jax).
    ids = tuple(int(d.id) for d in jmesh.devices.flat)
    split = _ATOMS.get(_jax_key(jmesh)) == target  # the target's axes, split into sub-axes
    if ids != target.devices or (tuple(jmesh.axis_names) != target.axis_names and not split):
        raise ShardingError(f"from_jax: the array is partial (unreduced over {sorted(spec.partial_axes)}) on jax mesh "
                            f"{dict(zip(jmesh.axis_names, jmesh.devices.shape))} with devices {list(ids)}; it can "
                            f"only come back onto a mesh with the same axes and devices, not {target!r}")
    return from_local(_device_blocks(array), target, spec)
