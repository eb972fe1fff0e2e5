"""``t.to_jax()`` and ``nb.from_jax``: the same blocks on real jax devices with the equivalent
NamedSharding. Device ``d`` of a mesh is ``jax.devices()[d]`` (on CPU, start jax with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ShardingError
from ..formats import to_partition_spec
from ..mesh import DeviceMesh
from ..spec import ShardingSpec


def to_jax(t: Any):
    import jax
    from jax.sharding import Mesh, NamedSharding

    spec = t.sharding
    if spec is None:
        return jax.numpy.asarray(t.numpy())
    if spec.partial_axes:  # jax arrays hold values, not pending sums: sum first (logged like any reshard)
        t = t.with_sharding(spec.mesh, spec.dim_specs)
        spec = t.sharding
    mesh = spec.mesh
    for i, n in enumerate(t.shape):
        k = spec.num_shards(i)
        if n % k:
            raise ShardingError(f"to_jax: dim {i} of size {n} is split over {k} shards {list(spec.dim_specs[i].axes)}; "
                                f"jax needs every sharded dim divisible by its shard count (nabla's ceil rule "
                                f"allows uneven ones): reshard that dim first")
    devices = jax.devices()
    if max(mesh.devices) >= len(devices):
        raise ShardingError(f"to_jax: mesh {mesh!r} uses device ids up to {max(mesh.devices)} but jax has "
                            f"{len(devices)} devices (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count)")
    grid = np.array([devices[d] for d in mesh.devices], dtype=object).reshape(mesh.shape)
    sharding = NamedSharding(Mesh(grid, mesh.axis_names), to_partition_spec(spec))
    # Serve each device its own block; jax asks by global index (its uneven rule is the same ceil rule).
    blocks = {}
    for d, blk in t.shards.items():
        key = tuple((sl.start, sl.stop) for sl in spec.shard_slices(t.shape, d))
        blocks.setdefault(key, blk)

    def block_at(index):
        key = tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, t.shape))
        if key not in blocks:
            raise ShardingError(f"to_jax: jax asked for block {key} which no device of {spec!r} holds")
        return np.ascontiguousarray(blocks[key])

    return jax.make_array_from_callback(t.shape, sharding, block_at)


def from_jax(array: Any):
    from ..tensor import Tensor

    value = np.asarray(array)
    sharding = getattr(array, "sharding", None)
    spec_obj = getattr(sharding, "spec", None)
    jmesh = getattr(sharding, "mesh", None)
    t = Tensor._host(value)
    if spec_obj is None or jmesh is None or jmesh.devices.size == 1:
        return t
    mesh = DeviceMesh("jax", tuple(jmesh.devices.shape), tuple(jmesh.axis_names),
                      [d.id for d in jmesh.devices.flat])
    entries = list(spec_obj) + [None] * (value.ndim - len(spec_obj))
    spec = ShardingSpec.from_partition_spec(mesh, entries)
    return t.shard(mesh, spec.dim_specs)
