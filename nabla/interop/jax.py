"""``t.to_jax()``: the same blocks on real jax devices with the equivalent NamedSharding. Device ``d`` of a mesh is
``jax.devices()[d]`` (on CPU, start jax with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``). Meshes that
went to jax are remembered, so ``nb.from_jax`` (``interop/arrays.py``) brings them back as themselves."""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from typing import Any

import numpy as np

from ..backends import require_jax
from ..errors import ShardingError
from ..formats import to_partition_spec
from ..mesh import DeviceMesh
from ..spec import ShardingSpec
from ..layout import grid
from ..backends.jax import atom_mesh

# Meshes seen crossing to or from jax, by (shape, axis names, device ids): a jax mesh equal to one of them comes
# back as that nabla mesh (DeviceMesh equality includes the name, which jax's Mesh does not carry).
_KNOWN: "OrderedDict[tuple, DeviceMesh]" = OrderedDict()
_KNOWN_MAX = 256
# jax meshes with split axes (sub-axes as separate axes) built by ``to_jax``: key -> the nabla mesh they split
_ATOMS: "OrderedDict[tuple, DeviceMesh]" = OrderedDict()


def _key(mesh: DeviceMesh) -> tuple:
    return mesh.shape, mesh.axis_names, mesh.devices


def _jax_key(jmesh: Any) -> tuple:
    return tuple(jmesh.devices.shape), tuple(jmesh.axis_names), tuple(int(d.id) for d in jmesh.devices.flat)


def remember(mesh: DeviceMesh) -> DeviceMesh:
    _KNOWN[_key(mesh)] = mesh
    _KNOWN.move_to_end(_key(mesh))
    while len(_KNOWN) > _KNOWN_MAX:
        _KNOWN.popitem(last=False)
    return mesh


@lru_cache(maxsize=256)
def jax_mesh(mesh: DeviceMesh, explicit: bool = False):
    """The ``jax.sharding.Mesh`` of ``mesh``: the same axes, device ``d`` being ``jax.devices()[d]``;
    ``explicit``: of jax's Explicit axis type (which ``unreduced`` axes need)."""
    jax = require_jax("to_jax")
    from jax.sharding import AxisType, Mesh

    devices = jax.devices()
    if max(mesh.devices) >= len(devices):
        raise ShardingError(f"to_jax: mesh {mesh!r} uses device ids up to {max(mesh.devices)} but jax has "
                            f"{len(devices)} devices (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count)")
    grid = np.array([devices[d] for d in mesh.devices], dtype=object).reshape(mesh.shape)
    if explicit:
        return Mesh(grid, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names))
    return Mesh(grid, mesh.axis_names)


def jax_sharding(spec: ShardingSpec):
    """The concrete ``jax.sharding.NamedSharding`` of a layout: every dim closed (``None``, never
    ``UNCONSTRAINED``, which only a sharding constraint inside ``jit`` may hold); partial axes ``unreduced``.
    A spec with sub-axes goes onto a jax mesh with each split axis as separate axes (``x`` of 8 used as
    ``x:(1)2`` becomes axes ``x:(1)2`` and ``x:(2)4`` of sizes 2 and 4), which ``from_jax`` reads back."""
    require_jax("a jax NamedSharding")
    from jax.sharding import NamedSharding, PartitionSpec

    spec = spec.layout()
    remember(spec.mesh)
    refs = [r for d in spec.dim_refs for r in d] + list(spec.partial_refs)
    if all(r.is_full for r in refs):
        return NamedSharding(jax_mesh(spec.mesh, bool(spec.partial_axes)), to_partition_spec(spec))
    from jax.sharding import AxisType, Mesh

    atoms = grid(spec).atoms
    jmesh = atom_mesh(spec.mesh, atoms)
    if spec.partial_axes:  # unreduced axes must be Explicit
        jmesh = Mesh(jmesh.devices, jmesh.axis_names, axis_types=(AxisType.Explicit,) * len(atoms))
    _ATOMS[_jax_key(jmesh)] = spec.mesh
    while len(_ATOMS) > _KNOWN_MAX:  # bounded, as the meshes remembered above
        _ATOMS.popitem(last=False)
    entries = [tuple(str(r) for r in d) if len(d) > 1 else (str(d[0]) if d else None) for d in spec.dim_refs]
    unreduced = {str(r) for r in spec.partial_refs}
    pspec = PartitionSpec(*entries, unreduced=unreduced) if unreduced else PartitionSpec(*entries)
    return NamedSharding(jmesh, pspec)


def to_jax(t: Any):
    """The tensor as a ``jax.Array`` with the equivalent ``NamedSharding``: the same blocks on the same devices.
    A partial value stays partial (jax's ``unreduced`` axes: each device holds its summand, nothing is
    summed); sub-axes become separate axes of the jax mesh. Uneven dims have no jax equivalent."""
    jax = require_jax("to_jax")

    spec = t.sharding
    if spec is None:
        return jax.numpy.asarray(t.numpy())
    for i, n in enumerate(t.shape):
        k = spec.num_shards(i)
        if n % k:
            raise ShardingError(f"to_jax: dim {i} of size {n} is split over {k} shards {list(spec.dim_specs[i].axes)}; "
                                f"jax needs every sharded dim divisible by its shard count (nabla's ceil rule "
                                f"allows uneven ones): reshard that dim first, e.g. t.with_sharding(mesh, [...]) "
                                f"with that dim on fewer devices, or pad it")
    sharding = jax_sharding(spec)
    devices = jax.devices()
    if spec.partial_axes:  # each device's summand, as it is (jax cannot build these by global index)
        mine = {d.id for d in jax.local_devices()}
        shards = t.shards
        arrays = [jax.device_put(np.ascontiguousarray(shards[d]), devices[d]) for d in spec.mesh.devices
                  if devices[d].id in mine]
        return jax.make_array_from_single_device_arrays(t.shape, sharding, arrays)
    # Serve each device its own block; jax asks by global index.
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
