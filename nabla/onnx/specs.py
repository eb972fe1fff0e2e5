"""ONNX sharding annotations <-> ``ShardingSpec``: ``ShardingSpecProto`` (a device list in row-major
order of the shards, device groups for replicas, ``sharded_dim``s with shard counts), the mesh a
``DeviceConfigurationProto`` describes, and which annotations of a node belong to a configuration."""

from __future__ import annotations

from math import prod
from typing import Sequence

import numpy as np
import onnx

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..spec import ShardingSpec

AXIS = "d"  # the axis of the 1-D mesh a DeviceConfigurationProto describes


def spec_from_onnx(proto: onnx.ShardingSpecProto, mesh: DeviceMesh, rank: int,
                   shape: Sequence[int] | None = None) -> ShardingSpec:
    """The ``ShardingSpec`` on ``mesh`` that places the shards where ``proto`` says.

    ONNX device ids are ``mesh`` device ids. Shard counts that split a mesh axis become sub-axes. The
    result has closed dims and names only the sharding axes (the others are replicated). ``shape``, when
    known, is checked against the ``dim_value``s. Raises ``ShardingError`` for a malformed proto and for
    a device order that no spec of ``mesh`` gives.
    """
    name = proto.tensor_name
    who = f"spec_from_onnx: tensor {name!r}"
    if shape is not None and len(shape) != rank:
        raise ShardingError(f"{who}: shape {tuple(shape)} does not have rank {rank}")
    counts = [1] * rank
    order: list[int] = []
    for sd in proto.sharded_dim:
        axis = sd.axis
        if not -rank <= axis < rank:
            raise ShardingError(f"{who}: sharded_dim axis {axis} is out of range for rank {rank} "
                                f"(its shard count divides no dim)")
        axis %= rank
        if axis in order:
            raise ShardingError(f"{who}: dim {axis} appears in two sharded_dim entries")
        counts[axis] = _dim_shards(sd, axis, None if shape is None else shape[axis], who)
        order.append(axis)
    devices = list(proto.device)
    n_tiles = prod(counts[a] for a in order) if order else 1
    if len(devices) != n_tiles:
        raise ShardingError(f"{who}: {len(devices)} devices {devices} listed for {n_tiles} shards "
                            f"(shard counts {[counts[a] for a in order]} on dims {order})")
    groups: dict[int, list[int]] = {}
    for entry in proto.index_to_device_group_map:
        if entry.key in groups:
            raise ShardingError(f"{who}: device group {entry.key} is defined twice")
        groups[entry.key] = list(entry.value)
    cells = [groups.get(v, [v]) for v in devices]
    sizes = {len(c) for c in cells}
    flat = [d for c in cells for d in c]
    shown = _order_text(devices, groups)
    for d in flat:
        if d not in mesh.devices:
            raise ShardingError(f"{who}: device {d} in the device order {shown} is not a device of mesh "
                                f"{mesh!r}")
    if len(set(flat)) != len(flat):
        dup = sorted({d for d in flat if flat.count(d) > 1})
        raise ShardingError(f"{who}: devices {dup} appear more than once in the device order {shown}")
    if len(sizes) != 1 or 0 in sizes:
        raise ShardingError(f"{who}: the device order {shown} has groups of sizes {sorted(sizes)}; "
                            f"every shard must have the same number of replicas to be expressible on "
                            f"mesh {mesh!r}")
    if len(flat) != mesh.size:
        raise ShardingError(f"{who}: the device order {shown} covers {len(flat)} of the {mesh.size} devices "
                            f"of mesh {mesh!r}; a tensor lives on every device of its mesh")
    if prod(counts) == 1:
        return ShardingSpec.replicated(mesh, rank)
    reps = sizes.pop()
    pos = {d: i for i, d in enumerate(mesh.devices)}
    arr = np.array([sorted(c, key=pos.__getitem__) for c in cells], dtype=np.int64)
    arr = arr.reshape([counts[a] for a in order] + [reps])
    arr = arr.transpose([order.index(a) for a in sorted(order)] + [len(order)])
    tiles = list(counts) + ([reps] if reps > 1 else [])
    arr = arr.reshape(tiles)
    text = ("{devices=[" + ",".join(map(str, tiles)) + "]" + ",".join(str(int(d)) for d in arr.reshape(-1))
            + (" last_tile_dim_replicate" if reps > 1 else "") + "}")
    try:
        return ShardingSpec.from_mhlo(mesh, text, rank)
    except ShardingError:
        raise ShardingError(
            f"{who}: the device order {shown} with shard counts {counts} per dim is not expressible on mesh "
            f"{mesh!r}: no assignment of its axes or sub-axes to the dims puts the shards on those devices"
        ) from None


def _dim_shards(sd: onnx.ShardedDimProto, axis: int, size: int | None, who: str) -> int:
    """The shard count of one dim; several ``simple_sharding``s (a dim fused from several) must amount
    to one contiguous split."""
    parts = list(sd.simple_sharding)
    if not parts:
        raise ShardingError(f"{who}: sharded_dim for dim {axis} has no simple_sharding")
    for p in parts:
        if not p.HasField("num_shards") or p.num_shards < 1:
            raise ShardingError(f"{who}: dim {axis}: num_shards must be a positive int, got "
                                f"{p.num_shards if p.HasField('num_shards') else 'none'}")
    if len(parts) == 1:
        p = parts[0]
        if size is not None and p.HasField("dim_value") and p.dim_value != size:
            raise ShardingError(f"{who}: dim {axis} has size {size} but its sharded_dim says dim_value "
                                f"{p.dim_value}")
        return int(p.num_shards)
    if not all(p.HasField("dim_value") for p in parts):
        raise ShardingError(f"{who}: dim {axis} fuses {len(parts)} dims, each needs a dim_value")
    dims = [int(p.dim_value) for p in parts]
    shards = [int(p.num_shards) for p in parts]
    if size is not None and prod(dims) != size:
        raise ShardingError(f"{who}: dim {axis} has size {size} but its fused dims {dims} multiply to "
                            f"{prod(dims)}")
    cut = [i for i, s in enumerate(shards) if s > 1]
    k = cut[-1] if cut else 0
    ok = dims[k] % shards[k] == 0 and all(shards[i] == dims[i] for i in range(k))
    if not ok:
        raise ShardingError(f"{who}: dim {axis} fuses dims {dims} sharded {shards} ways; only a contiguous "
                            f"split of the fused dim is expressible")
    return prod(shards)


def _order_text(devices: list[int], groups: dict[int, list[int]]) -> str:
    used = {v: groups[v] for v in devices if v in groups}
    return f"{devices}" + (f" with groups {used}" if used else "")


def spec_to_onnx(spec: ShardingSpec, tensor_name: str) -> onnx.ShardingSpecProto:
    """The ``ShardingSpecProto`` of ``spec``: one ``sharded_dim`` per sharded dim (in dim order), the
    devices of each shard in row-major order of the shards, and device groups (keys -1, -2, ..., as in
    the ONNX sharding formalism) when each shard has replicas. Open dims, priorities and ``replicated_axes`` are
    propagation hints ONNX has no place for; partial axes cannot be expressed and raise."""
    if not isinstance(spec, ShardingSpec):
        raise ShardingError(f"spec_to_onnx: expected a ShardingSpec, got {type(spec).__name__}")
    if spec.partial_axes:
        raise ShardingError(f"spec_to_onnx: tensor {tensor_name!r}: spec {spec!r} is partial over "
                            f"{list(spec.partial_axes)}; ONNX sharding specs hold no unreduced sums "
                            f"(reduce them first)")
    mesh = spec.mesh
    counts = tuple(spec.num_shards(d) for d in range(spec.rank))
    sharded = [d for d, n in enumerate(counts) if n > 1]
    cells: dict[tuple[int, ...], list[int]] = {}
    for dev in mesh.devices:  # a dim of n elements in n shards: shard i starts at element i
        at = spec.shard_slices(counts, dev)
        cells.setdefault(tuple(at[d].start for d in sharded), []).append(dev)
    proto = onnx.ShardingSpecProto(tensor_name=tensor_name)
    for d in sharded:
        proto.sharded_dim.append(onnx.ShardedDimProto(
            axis=d, simple_sharding=[onnx.SimpleShardedDimProto(num_shards=counts[d])]))
    for i, tile in enumerate(np.ndindex(*(counts[d] for d in sharded))):
        devs = cells[tile]
        if len(devs) == 1:
            proto.device.append(devs[0])
        else:
            proto.device.append(-(i + 1))
            proto.index_to_device_group_map.append(onnx.IntIntListEntryProto(key=-(i + 1), value=devs))
    return proto


# ---- configurations ---------------------------------------------------------------------------------


def config_mesh(config: onnx.DeviceConfigurationProto) -> DeviceMesh:
    """The 1-D mesh (axis ``"d"``) over a configuration's ``num_devices``, named after it."""
    if config.num_devices < 1:
        raise ShardingError(f"configuration {config.name!r}: num_devices is {config.num_devices}, "
                            f"must be at least 1")
    return DeviceMesh(config.name or "onnx", (config.num_devices,), (AXIS,))


def node_specs(node: onnx.NodeProto, config_id: str | None) -> list[onnx.ShardingSpecProto]:
    """The sharding specs ``node`` gives under configuration ``config_id`` (None: its first one)."""
    for c in node.device_configurations:
        if config_id is None or c.configuration_id == config_id:
            return list(c.sharding_spec)
    return []
