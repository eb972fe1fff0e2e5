"""DeviceMesh: a named grid of devices, and AxisRef: an axis or a Shardy sub-axis ``x:(pre)size`` of it."""

from __future__ import annotations

import re
from functools import lru_cache
from math import prod
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from .errors import ShardingError

_SUB_AXIS = re.compile(r"^(?P<name>[^:()\s]+):\((?P<pre>\d+)\)(?P<size>\d+)$")


class AxisRef(NamedTuple):
    """The part of mesh axis ``name`` of size ``size`` whose more-major parts multiply to ``pre``.

    A full axis is ``AxisRef(name, 1, n, n)``. Coordinates: a device at position ``c`` on the axis
    sits at ``(c // minor) % size`` on the sub-axis, with ``minor = full // (pre * size)``.
    """

    name: str
    pre: int
    size: int
    full: int

    @property
    def is_full(self) -> bool:
        return self.pre == 1 and self.size == self.full

    @property
    def minor(self) -> int:
        return self.full // (self.pre * self.size)

    def __str__(self) -> str:
        return self.name if self.is_full else f"{self.name}:({self.pre}){self.size}"

    def coord(self, axis_coord: int) -> int:
        return (axis_coord // self.minor) % self.size

    def overlaps(self, other: "AxisRef") -> bool:
        """Two parts of one axis may both be used only if they are disjoint pieces of one factorisation."""
        if self.name != other.name:
            return False
        if self == other:  # also for axes of size 1, which occupy no room in the factorisation
            return True
        lo, hi = sorted((self, other), key=lambda r: r.pre)
        end = lo.pre * lo.size
        return not (end <= hi.pre and hi.pre % end == 0)


class DeviceMesh:
    """A logical grid of devices with named axes; hashable and equal by value, like ``jax.sharding.Mesh``."""

    __slots__ = ("name", "shape", "axis_names", "devices", "size", "_coords", "_grid", "_hash")

    def __init__(self, name: str, shape: Sequence[int], axis_names: Sequence[str],
                 devices: Iterable[int] | None = None) -> None:
        shape = tuple(shape)
        axis_names = tuple(axis_names)
        if not isinstance(name, str) or not name:
            raise ShardingError(f"DeviceMesh: name must be a non-empty str, got {name!r}")
        if len(shape) != len(axis_names):
            raise ShardingError(
                f"DeviceMesh {name!r}: {len(shape)} axis sizes {shape} but {len(axis_names)} names {axis_names}")
        for n, s in zip(axis_names, shape):
            if not isinstance(n, str) or not n or ":" in n or "(" in n:
                raise ShardingError(f"DeviceMesh {name!r}: axis name {n!r} must be a plain non-empty str")
            if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1:
                raise ShardingError(f"DeviceMesh {name!r}: axis {n!r} has size {s!r}; sizes must be ints >= 1")
        if len(set(axis_names)) != len(axis_names):
            raise ShardingError(f"DeviceMesh {name!r}: axis names {axis_names} are not distinct")
        size = prod(shape)
        if devices is None:
            devices = tuple(range(size))
        else:
            devices = tuple(devices)
            if any(not isinstance(d, (int, np.integer)) or isinstance(d, bool) for d in devices):
                raise ShardingError(f"DeviceMesh {name!r}: devices must be ints, got {devices}")
            devices = tuple(int(d) for d in devices)
            if len(devices) != size:
                raise ShardingError(
                    f"DeviceMesh {name!r}: shape {shape} needs {size} devices, got {len(devices)}")
            if len(set(devices)) != len(devices):
                dup = sorted({d for d in devices if devices.count(d) > 1})
                raise ShardingError(f"DeviceMesh {name!r}: devices are not distinct (repeated: {dup})")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "axis_names", axis_names)
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "size", size)
        grid = np.array(devices, dtype=np.int64).reshape(self.shape)
        grid.setflags(write=False)
        object.__setattr__(self, "_grid", grid)
        coords = {d: tuple(int(i) for i in np.unravel_index(k, self.shape)) for k, d in enumerate(devices)}
        object.__setattr__(self, "_coords", coords)
        object.__setattr__(self, "_hash", hash((name, self.shape, axis_names, devices)))

    def __setattr__(self, key, value):
        raise AttributeError("DeviceMesh is immutable")

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._hash == other._hash
                                 and (self.name, self.shape, self.axis_names, self.devices)
                                 == (other.name, other.shape, other.axis_names, other.devices))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        axes = ", ".join(f'"{n}"={s}' for n, s in zip(self.axis_names, self.shape))
        order = "" if self.devices == tuple(range(self.size)) else f", device_ids={list(self.devices)}"
        return f"@{self.name} = <[{axes}]{order}>"

    def __reduce__(self):
        return (DeviceMesh, (self.name, self.shape, self.axis_names, self.devices))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis_index(self, name: str) -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise ShardingError(
                f"mesh @{self.name}: unknown axis {name!r}; the mesh has axes {list(self.axis_names)}") from None

    def axis_ref(self, axis: str) -> AxisRef:
        """Parse ``"x"`` or ``"x:(pre)size"`` against this mesh, validating the sub-axis."""
        return _axis_ref(self, axis)

    def axis_size(self, axis: str) -> int:
        return self.axis_ref(axis).size

    def coords(self, device_id: int) -> tuple[int, ...]:
        try:
            return self._coords[device_id]
        except (KeyError, TypeError):
            raise ShardingError(
                f"mesh @{self.name}: device {device_id!r} is not in the mesh (devices {list(self.devices)})") from None

    def device_at(self, coords: Sequence[int]) -> int:
        return int(self._grid[tuple(coords)])


@lru_cache(maxsize=4096)
def _axis_ref(mesh: DeviceMesh, axis: str) -> AxisRef:
    if not isinstance(axis, str):
        raise ShardingError(f"mesh @{mesh.name}: an axis must be a str, got {axis!r}")
    m = _SUB_AXIS.match(axis)
    name = m.group("name") if m else axis
    n = mesh.shape[mesh.axis_index(name)]
    if not m:
        return AxisRef(name, 1, n, n)
    pre, size = int(m.group("pre")), int(m.group("size"))
    if pre < 1 or size < 1 or n % (pre * size):
        raise ShardingError(
            f"mesh @{mesh.name}: sub-axis {axis!r} does not divide axis {name!r} of size {n}: "
            f"pre {pre} x size {size} = {pre * size} must divide {n}")
    return AxisRef(name, pre, size, n)


def merge_adjacent(refs: Iterable[AxisRef]) -> tuple[AxisRef, ...]:
    """Neighbouring sub-axes of one axis that tile a larger piece (``x:(1)2, x:(2)2`` on x=4) become one."""
    out: list[AxisRef] = []
    for r in refs:
        if out and out[-1].name == r.name and out[-1].pre * out[-1].size == r.pre:
            p = out.pop()
            r = AxisRef(r.name, p.pre, p.size * r.size, r.full)
        out.append(r)
    return tuple(out)
