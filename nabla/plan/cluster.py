"""Cluster: nodes of identical devices; it makes meshes over its devices and says which link tier a collective
over some mesh axes runs on (NVLink inside a node, the network across nodes, or both: hierarchical)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import ShardingError
from ..args import is_int
from ..mesh import DeviceMesh
from .hardware import Hardware


class Tier(NamedTuple):
    """Where a collective's groups live. ``kind``: ``"nvlink"`` (each group inside one node), ``"network"``
    (each member of a group on a different node) or ``"hierarchical"`` (``k_in`` members in each of ``k_out``
    nodes). Always ``k_in * k_out`` is the group size."""

    kind: str
    k_in: int
    k_out: int

    @property
    def group(self) -> int:
        return self.k_in * self.k_out


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``devices_per_node`` devices of one ``hardware``; device ``d`` is on node
    ``d // devices_per_node``. Frozen and hashable."""

    hardware: Hardware
    nodes: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if not isinstance(self.hardware, Hardware):
            raise ShardingError(f"Cluster: hardware must be a Hardware (nb.Hardware.preset(...)), got "
                                f"{type(self.hardware).__name__}")
        for f in ("nodes", "devices_per_node"):
            v = getattr(self, f)
            if not is_int(v) or v < 1:
                raise ShardingError(f"Cluster: {f} must be an int >= 1, got {v!r}")
            object.__setattr__(self, f, int(v))

    @property
    def size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        if not is_int(device) or not 0 <= device < self.size:
            raise ShardingError(f"Cluster: device {device!r} is not in the cluster (devices 0..{self.size - 1})")
        return int(device) // self.devices_per_node

    def mesh(self, name: str, shape: int | Sequence[int], axis_names: str | Sequence[str]) -> DeviceMesh:
        """A ``DeviceMesh`` over every device of the cluster, ``0..N-1`` row-major (an ordinary mesh: hashable,
        equal by value); so the last axes vary fastest and, if they fit in a node, run on NVLink."""
        mesh = DeviceMesh(name, shape, axis_names)
        if mesh.size != self.size:
            raise ShardingError(f"Cluster.mesh {name!r}: mesh shape {mesh.shape} has {mesh.size} devices but the "
                                f"cluster has {self.nodes} nodes x {self.devices_per_node} devices = {self.size}")
        return mesh

    def tier(self, mesh: DeviceMesh, axes: Sequence[str]) -> Tier:
        """The link tier of a collective over ``axes`` (axes or sub-axes ``"x:(pre)size"``) of ``mesh``."""
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(f"Cluster.tier: expected a DeviceMesh, got {type(mesh).__name__}")
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in axes:
            mesh.axis_ref(a)  # validates, naming the axis
        return _tier(mesh, axes, self.nodes, self.devices_per_node)


@lru_cache(maxsize=1024)
def _tier(mesh: DeviceMesh, axes: tuple[str, ...], nodes: int, devices_per_node: int) -> Tier:
    top = max(mesh.devices)
    if top >= nodes * devices_per_node:
        raise ShardingError(f"Cluster.tier: mesh @{mesh.name} has device {top} but the cluster has devices "
                            f"0..{nodes * devices_per_node - 1} ({nodes} nodes x {devices_per_node})")
    refs = [mesh.axis_ref(a) for a in axes]
    k = prod(r.size for r in refs)
    if k == 1:
        return Tier("nvlink", 1, 1)
    coords = np.stack(np.unravel_index(np.arange(mesh.size), mesh.shape), axis=-1)
    rest = coords.copy()  # each device's coordinates with the collective's digits removed: its group
    for r in refs:
        a = mesh.axis_index(r.name)
        rest[:, a] -= ((coords[:, a] // r.minor) % r.size) * r.minor
    group = np.ravel_multi_index(tuple(rest.T), mesh.shape)  # one id per group (no row sort: 16k devices)
    node = np.asarray(mesh.devices, dtype=np.int64) // devices_per_node
    pairs, per_node = np.unique(group * nodes + node, return_counts=True)
    nodes_per_group = np.bincount(pairs // nodes)
    nodes_per_group = nodes_per_group[nodes_per_group > 0]
    if (nodes_per_group == 1).all():
        return Tier("nvlink", k, 1)
    if (per_node == 1).all():
        return Tier("network", 1, k)
    k_in = int(per_node[0])
    if (per_node == k_in).all():
        return Tier("hierarchical", k_in, k // k_in)
    # groups spread unevenly over nodes (a custom device order): every ring hop may cross the network
    return Tier("network", 1, k)
