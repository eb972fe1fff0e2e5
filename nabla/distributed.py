"""More than one process: the same script runs as N processes, each owning some of the mesh's devices (a thin
layer over ``jax.distributed``), programs compiled with ``nb.jit`` run across all of them, and host data is
loaded per process. Device ``d`` of a mesh is ``jax.devices()[d]``, the global device list."""

from __future__ import annotations

from math import prod
from typing import Any, Sequence

import numpy as np

from .backends import require_jax
from .errors import ShardingError
from .mesh import DeviceMesh
from .spec import ShardingSpec
from .tensor import Tensor
from .layout import chunks, grid, grid_index
from .layout import grid, grid_index
from .backends.jax import atom_sharding


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               local_device_count: int | None = None) -> None:
    """Join a multi-process run (call first, in every process, before anything uses jax). On CPU, collectives
    between processes go through gloo; ``local_device_count`` forces that many CPU devices in this process
    (it must be set before jax starts: the same as ``XLA_FLAGS=--xla_force_host_platform_device_count``)."""
    import os
    if local_device_count is not None:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={int(local_device_count)}".strip()
    jax = require_jax("nb.distributed.initialize")
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def process_index() -> int:
    jax = require_jax("nb.distributed.process_index")
    return jax.process_index()


def process_count() -> int:
    jax = require_jax("nb.distributed.process_count")
    return jax.process_count()


def local_devices(mesh: DeviceMesh) -> list[int]:
    """The mesh's devices this process owns (mesh device ids)."""
    jax = require_jax("nb.distributed.local_devices")
    mine = {d.id for d in jax.local_devices()}
    devices = jax.devices()
    return [d for d in mesh.devices if devices[d].id in mine]


def from_process_local(local: Any, mesh: DeviceMesh, dim_specs: Sequence[Any], global_shape: Sequence[int]) -> Tensor:
    """A sharded tensor of ``global_shape`` from the part of it this process holds: ``local`` is the box of the
    global value that covers the blocks of this process's devices (each process loads only its data, as
    ``jax.make_array_from_process_local_data``). Its blocks go straight to this process's devices."""
    jax = require_jax("from_process_local")

    spec = ShardingSpec(mesh, dim_specs)
    shape = tuple(int(n) for n in global_shape)
    spec.check_rank(shape, "from_process_local")
    local = np.asarray(local)
    mine = local_devices(mesh)
    if not mine:
        raise ShardingError(f"from_process_local: this process owns no device of mesh {mesh!r}")
    boxes = {d: spec.shard_slices(shape, d) for d in mine}
    lo = [min(b[j].start for b in boxes.values()) for j in range(len(shape))]
    hi = [max(b[j].stop for b in boxes.values()) for j in range(len(shape))]
    want = tuple(h - s for s, h in zip(lo, hi))
    if local.shape != want:
        raise ShardingError(f"from_process_local: this process's devices {mine} hold rows {list(zip(lo, hi))} of "
                            f"a {shape} tensor laid out {spec!r}, so local data of shape {want} is needed, "
                            f"got {local.shape}")
    g = grid(spec)
    ch = chunks(spec, shape)
    stored = g.shape + ch
    by_position = {grid_index(spec, d): d for d in mine}

    def block(index):
        pos = tuple(s.start or 0 for s in index[:len(g.shape)])
        d = by_position[pos]
        piece = local[tuple(slice(b.start - s, b.stop - s) for b, s in zip(boxes[d], lo))]
        out = np.zeros((1,) * len(g.shape) + ch, dtype=local.dtype)
        out[(0,) * len(g.shape) + tuple(slice(0, n) for n in piece.shape)] = piece
        return out

    data = jax.make_array_from_callback(stored, atom_sharding(spec, len(shape)), block)
    return Tensor(data, spec, shape, local.dtype)


def gather(t: Tensor) -> np.ndarray:
    """The global value of ``t`` on every process (a collective across processes: every process calls it)."""
    return t.numpy()


def local_blocks(t: Tensor) -> dict[int, np.ndarray]:
    """Device id -> block, for the devices of ``t``'s mesh this process owns (no communication)."""
    jax = require_jax("nb.distributed.local_blocks")
    if t.sharding is None:
        return {0: t.numpy()}
    data = t._data
    g = grid(t.sharding)
    devices = jax.devices()
    out = {}
    shards = {s.device.id: s for s in getattr(data, "addressable_shards", [])}
    for d in local_devices(t.mesh):
        blk = np.asarray(shards[devices[d].id].data) if shards else np.asarray(data)[grid_index(t.sharding, d)]
        blk = blk.reshape(blk.shape[len(g.shape):]) if blk.ndim > t.ndim else blk
        sl = t.sharding.shard_slices(t.shape, d)
        out[d] = blk[tuple(slice(0, s.stop - s.start) for s in sl)]
    return out
