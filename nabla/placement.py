"""Tensors made from what is outside nabla's ops: ``from_local`` (DTensor's: a tensor from each device's block) and
JAX's ``device_put`` and ``with_sharding_constraint``. Above the ops and autodiff, which they use (``from_local``
of traced blocks records them, so gradients reach them)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import backends
from .backends.grid import check_data_mesh
from .backprop import from_local_record
from .dtypes import is_inexact
from .errors import ShardingError
from .layout import chunks, dim_position, grid, grid_index
from .mesh import DeviceMesh
from .ops import tensor
from .sharding import to_spec
from .spec import ShardingSpec
from .tensor import Tensor
from .trace import link_of


def from_local(blocks: Any, mesh: Any, dim_specs: Any = None, replicated_axes: Sequence[str] = (),
               partial_axes: Sequence[str] = (), *, shape: Sequence[int] | None = None) -> Tensor:
    """A sharded tensor from each device's block (DTensor's ``from_local``): ``blocks`` maps device id -> array,
    or lists one array per device in mesh device order. ``dim_specs`` takes what ``shard`` takes. The global
    shape follows from the blocks (or is given as ``shape``); every block must have its ceil-rule shape, and
    devices holding the same block (replicas; not the summands of partial axes) must agree, else
    ``ShardingError`` naming the device."""

    m = mesh.mesh if hasattr(mesh, "spec") and not isinstance(mesh, DeviceMesh) else mesh
    if not isinstance(m, DeviceMesh):
        raise ShardingError(f"from_local(blocks, mesh, dim_specs): mesh must be a DeviceMesh or NamedSharding, got "
                            f"{type(mesh).__name__}")
    check_data_mesh(m, "from_local")
    if isinstance(blocks, dict):
        unknown = [d for d in blocks if not isinstance(d, (int, np.integer)) or d not in m._coords]
        if unknown:
            raise ShardingError(f"from_local: device {unknown[0]!r} is not in mesh {m!r} (devices {list(m.devices)})")
        missing = [d for d in m.devices if d not in blocks]
        if missing:
            raise ShardingError(f"from_local: no block for device {missing[0]} of mesh {m!r}; every device needs one")
        by_dev = {d: blocks[d] for d in m.devices}
    elif isinstance(blocks, (list, tuple)):
        if len(blocks) != m.size:
            raise ShardingError(f"from_local: {len(blocks)} blocks for the {m.size} devices of mesh {m!r} (a list "
                                f"holds one block per device, in mesh device order {list(m.devices)})")
        by_dev = dict(zip(m.devices, blocks))
    else:
        raise ShardingError(f"from_local: blocks must be a dict device id -> array or a list in mesh device order, "
                            f"got {type(blocks).__name__}")
    arrays = {}
    for d, b in by_dev.items():
        a = b.numpy() if isinstance(b, Tensor) else np.asarray(b)
        if a.dtype.kind not in "biufc" and not a.dtype.name.startswith(("bfloat", "float8")):
            raise ShardingError(f"from_local: the block of device {d} has dtype {a.dtype}, not a numeric one")
        arrays[d] = a
    first = m.devices[0]
    rank, dtype = arrays[first].ndim, arrays[first].dtype
    for d, a in arrays.items():
        if a.ndim != rank:
            raise ShardingError(f"from_local: the block of device {d} has rank {a.ndim} (shape {a.shape}) but device "
                                f"{first}'s has rank {rank} (shape {arrays[first].shape})")
        if a.dtype != dtype:
            raise ShardingError(f"from_local: the block of device {d} has dtype {a.dtype} but device {first}'s has "
                                f"{dtype}; cast them alike (.astype)")
    spec = to_spec(mesh, dim_specs, rank, replicated_axes, partial_axes, "from_local")
    spec.check_rank(arrays[first].shape, "from_local", f"block of device {first}")
    if shape is None:  # a dim is the sum of its distinct shards' lengths, read off the devices holding them
        gshape = []
        for i in range(rank):
            by_pos: dict[int, tuple[int, int]] = {}
            for d, a in arrays.items():
                n, o = by_pos.setdefault(_position(spec, i, d), (a.shape[i], d))
                if n != a.shape[i]:
                    raise ShardingError(f"from_local: devices {o} and {d} hold the same shard of dim {i} under "
                                        f"{spec!r}, but their blocks have {n} and {a.shape[i]} elements there")
            gshape.append(sum(n for n, _ in by_pos.values()))
        shape = tuple(gshape)
    else:
        shape = tuple(int(n) for n in shape)
        spec.check_rank(shape, "from_local", "shape")
    for d, a in arrays.items():
        want = spec.shard_shape(shape, d)
        if a.shape != want:
            raise ShardingError(f"from_local: the block of device {d} has shape {a.shape}, but a {shape} tensor laid "
                                f"out {spec!r} gives device {d} a block of {want} (ceil rule: a dim of n over k "
                                f"shards gives each ceil(n / k) elements, the last ones fewer)")
    g = grid(spec)
    data = np.zeros(g.shape + chunks(spec, shape), dtype=dtype)
    holder: dict[tuple, int] = {}
    for d, a in arrays.items():
        idx = grid_index(spec, d)
        if idx in holder:
            o = holder[idx]
            if not np.array_equal(a, arrays[o], equal_nan=is_inexact(a.dtype)):
                raise ShardingError(f"from_local: devices {o} and {d} hold the same block of {spec!r} (replicas) but "
                                    f"their blocks differ; a replicated dim or axis needs equal blocks (make the "
                                    f"value partial over that axis if they are summands)")
            continue
        holder[idx] = d
        data[idx + tuple(slice(0, n) for n in a.shape)] = a
    data = backends.active().commit(data, spec)
    if isinstance(data, np.ndarray):
        data.flags.writeable = False
    traced = {d: b for d, b in by_dev.items() if isinstance(b, Tensor) and link_of(b) is not None}
    # blocks computed from values being differentiated: gradients reach them
    out = Tensor(data, spec, shape, dtype)
    return from_local_record(out, traced, spec, set(holder.values())) if traced else out


def device_put(x: Any, sharding: Any) -> Tensor:
    """JAX's ``device_put``: ``x`` (a tensor, an array, a scalar) laid out as ``sharding`` (an
    ``nb.NamedSharding``, or a ``ShardingSpec``); a sharded value moves with collectives."""
    t = x if isinstance(x, Tensor) else tensor(x)
    return t.shard(sharding)


def with_sharding_constraint(x: Any, shardings: Any) -> Any:
    """JAX's ``with_sharding_constraint``: ``x`` (a tensor, or a pytree of them) laid out as ``shardings`` (an
    ``nb.NamedSharding`` or ``ShardingSpec``, or a pytree of them matching ``x``); ``t.with_sharding`` on
    each leaf, so a sharded value moves with logged collectives and open dims keep what they have."""
    if isinstance(x, Tensor):
        return x.with_sharding(shardings)
    if isinstance(x, dict):
        if isinstance(shardings, dict):
            return {k: with_sharding_constraint(v, shardings[k]) for k, v in x.items()}
        return {k: with_sharding_constraint(v, shardings) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        per = shardings if isinstance(shardings, (list, tuple)) else [shardings] * len(x)
        if len(per) != len(x):
            raise ShardingError(f"with_sharding_constraint: {len(per)} shardings for {len(x)} values")
        return type(x)(with_sharding_constraint(v, s) for v, s in zip(x, per))
    raise ShardingError(f"with_sharding_constraint: expected a Tensor or a pytree of them, got {type(x).__name__}")


def _position(spec: ShardingSpec, dim: int, device: int) -> int:
    return dim_position(spec.dim_refs[dim], spec.mesh, spec.mesh.coords(device))
