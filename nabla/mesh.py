"""DeviceMesh: a named grid of devices, and AxisRef: an axis or a Shardy sub-axis ``x:(pre)size`` of it."""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache
from math import prod
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from .args import bounded_tuple, is_int, short_repr
from .errors import ShardingError

_SUB_AXIS = re.compile(r"^(?P<name>[^:()\s]+):\((?P<pre>[0-9]+)\)(?P<size>[0-9]+)$")

#: The most devices a mesh may have. nabla simulates every device on one host, so this bounds the
#: memory a bad shape (``(10**12,)``) or a hostile HLO string could ask for before anything is built.
MAX_DEVICES = 1 << 20  # a mesh (planned without data: nb.abstract)
#: the most devices a mesh holding data may have (every block lives on this host)
MAX_DATA_DEVICES = 1 << 16
#: The most axes a mesh may have (as many as a tensor may have dims, ``nabla.args.MAX_RANK``).
MAX_AXES = 32
#: Device ids are int64 on every backend.
MAX_DEVICE_ID = (1 << 63) - 1


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
        lo, hi = sorted((self, other), key=lambda r: (r.pre, r.size))
        end = lo.pre * lo.size
        return not (end <= hi.pre and hi.pre % end == 0)


class DeviceMesh:
    """A logical grid of devices with named axes; hashable and equal by value, like ``jax.sharding.Mesh``."""

    __slots__ = ("name", "shape", "axis_names", "devices", "size", "_coords", "_grid", "_hash")

    def __init__(self, name: str, shape: int | Sequence[int], axis_names: str | Sequence[str],
                 devices: Iterable[int] | None = None) -> None:
        """``shape`` is a sequence of axis sizes, or one int for a 1-D mesh (numpy's habit: ``np.zeros(8)``),
        so ``DeviceMesh("m", 8, "x")`` is ``DeviceMesh("m", (8,), ("x",))``; likewise one str names the one
        axis. ``devices`` (default ``range(size)``) lists distinct ids in ``[0, 2**63)``, row-major over
        the mesh (a numpy array of the mesh's shape also works). At most ``MAX_DEVICES`` devices and
        ``MAX_AXES`` axes; anything else raises ``ShardingError`` naming the argument."""
        if not isinstance(name, str) or not name:
            raise ShardingError(f"DeviceMesh: name must be a non-empty str, got {short_repr(name)}")
        who = f"DeviceMesh {short_repr(name)}"
        if isinstance(shape, np.ndarray) and shape.ndim == 0 and shape.dtype.kind in "iu":
            shape = shape.item()
        shape = (shape,) if is_int(shape) else bounded_tuple(shape, f"{who}: shape", MAX_AXES)
        axis_names = (axis_names,) if isinstance(axis_names, str) else \
            bounded_tuple(axis_names, f"{who}: axis_names", MAX_AXES)
        if len(shape) != len(axis_names):
            raise ShardingError(f"{who}: {len(shape)} axis sizes {short_repr(shape)} but {len(axis_names)} names "
                                f"{short_repr(axis_names)}")
        for n, s in zip(axis_names, shape):
            if not isinstance(n, str) or not n or any(c in n for c in ":()") or any(c.isspace() for c in n):
                raise ShardingError(f"{who}: axis name {short_repr(n)} must be a non-empty str without ':', '(', "
                                    f"')' or spaces")
            if not is_int(s) or s < 1:
                raise ShardingError(f"{who}: axis {n!r} has size {short_repr(s)}; sizes must be ints >= 1")
        if len(set(axis_names)) != len(axis_names):
            raise ShardingError(f"{who}: axis names {axis_names} are not distinct")
        shape = tuple(int(s) for s in shape)
        size = 1
        for s in shape:  # stops at the first size past the limit: no product of huge ints
            size *= s
            if size > MAX_DEVICES:
                raise ShardingError(f"{who}: shape {short_repr(shape)} has more than {MAX_DEVICES:,} devices "
                                    f"(MAX_DEVICES; meshes holding data are limited to {MAX_DATA_DEVICES:,}, "
                                    f"as every device's block lives on this host)")
        if devices is None:
            devices = tuple(range(size))
        else:
            if isinstance(devices, np.ndarray) and devices.ndim > 1 and devices.shape != shape:
                raise ShardingError(f"{who}: devices array has shape {devices.shape}, not the mesh's {shape}")
            devices = bounded_tuple(devices, f"{who}: devices", size,
                                 too_long=f"{who}: shape {shape} needs {size} devices, got more")
            bad = [d for d in devices if not is_int(d)]
            if bad:
                raise ShardingError(f"{who}: devices must be ints, got {short_repr(bad[0])} in {short_repr(devices)}")
            devices = tuple(int(d) for d in devices)
            if len(devices) != size:
                raise ShardingError(f"{who}: shape {shape} needs {size} devices, got {len(devices)}")
            bad = [d for d in devices if not 0 <= d <= MAX_DEVICE_ID]
            if bad:
                raise ShardingError(f"{who}: device id {short_repr(bad[0])} is out of range; ids are ints in [0, 2**63)")
            if len(set(devices)) != len(devices):
                dup = sorted(d for d, k in Counter(devices).items() if k > 1)
                raise ShardingError(f"{who}: devices are not distinct (repeated: {short_repr(dup)})")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", axis_names)
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "size", size)
        grid = np.array(devices, dtype=np.int64).reshape(self.shape)
        grid.setflags(write=False)
        object.__setattr__(self, "_grid", grid)
        coords = np.stack(np.unravel_index(np.arange(size), shape), axis=-1).tolist() if shape else [[]]
        object.__setattr__(self, "_coords", {d: tuple(c) for d, c in zip(devices, coords)})
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
                f"mesh @{self.name}: unknown axis {short_repr(name)}; the mesh has axes {list(self.axis_names)}") from None

    def axis_ref(self, axis: str) -> AxisRef:
        """Parse ``"x"`` or ``"x:(pre)size"`` against this mesh, validating the sub-axis."""
        if not isinstance(axis, str):
            raise ShardingError(f"mesh @{self.name}: an axis must be a str, got {short_repr(axis)}")
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
        try:
            c = tuple(coords)
            if len(c) != self.ndim or not all(is_int(i) and 0 <= i < n for i, n in zip(c, self.shape)):
                raise ValueError
        except (TypeError, ValueError):
            raise ShardingError(f"mesh @{self.name}: coords {short_repr(coords)} are not {self.ndim} ints within the "
                                f"mesh shape {self.shape}") from None
        return int(self._grid[c])


@lru_cache(maxsize=4096)
def _axis_ref(mesh: DeviceMesh, axis: str) -> AxisRef:
    m = _SUB_AXIS.match(axis)
    name = m.group("name") if m else axis
    n = mesh.shape[mesh.axis_index(name)]
    if not m:
        return AxisRef(name, 1, n, n)
    digits = m.group("pre"), m.group("size")
    if any(len(d.lstrip("0")) > 18 for d in digits):  # past any mesh size: refused before int() of a huge string
        raise ShardingError(f"mesh @{mesh.name}: sub-axis {axis[:80]!r} of axis {name!r} (size {n}) has a "
                            f"pre-size or size far past the axis size")
    pre, size = int(digits[0]), int(digits[1])
    if pre < 1 or size < 1 or n % (pre * size):
        raise ShardingError(
            f"mesh @{mesh.name}: sub-axis {axis!r} does not divide axis {name!r} of size {n}: "
            f"pre {pre} x size {size} = {pre * size} must divide {n}")
    if size == 1 and n != 1:  # as in Shardy: a size-1 piece occupies no room and would alias every other
        raise ShardingError(f"mesh @{mesh.name}: sub-axis {axis!r} has size 1; sub-axis sizes must be greater "
                            f"than 1 (axis {name!r} has size {n})")
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
