"""Per-device values (``nb.shard_map``'s): their layout, ``ManualSpec``, and how an op runs on them (the same kernel
on every device's block, nothing propagated or moved). Below the executor, which runs ops on them through here."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .backends import xp
from .errors import ShardingError
from .mesh import DeviceMesh
from .opdef import Local, OpDef
from .signatures import result_dtype
from .value import Value


class ManualSpec:
    """The layout of a per-device value: its mesh, and the mesh axes along which devices hold different
    values (JAX's "varying" axes). Stored as ``(*[size of each mesh axis, or 1], *block)``."""

    __slots__ = ("mesh", "varying", "partial_axes", "_hash")

    def __init__(self, mesh: DeviceMesh, varying: Sequence[str]) -> None:
        self.mesh = mesh
        self.varying = tuple(n for n in mesh.axis_names if n in set(varying))
        self.partial_axes = ()
        self._hash = hash((mesh, self.varying))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ManualSpec) and (self.mesh, self.varying) == (other.mesh, other.varying)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"manual(varying={{{', '.join(repr(a) for a in self.varying)}}})"

    def grid(self) -> tuple[int, ...]:
        return tuple(n if a in self.varying else 1 for a, n in zip(self.mesh.axis_names, self.mesh.shape))

    def layout(self) -> "ManualSpec":
        return self


def manual_run(op: OpDef, args: Sequence[Any], params: tuple, make: Callable) -> Any:
    """An op on per-device values: the same kernel on every device's block (no propagation, no movement)."""
    mesh = None
    varying: set[str] = set()
    arrays = []
    G = None
    abstract = False
    for i, a in enumerate(args):
        if isinstance(a, Value):
            if isinstance(a._spec, ManualSpec):
                if mesh is not None and a._spec.mesh != mesh:
                    raise ShardingError(f"{op.name}: per-device values of two meshes")
                mesh = a._spec.mesh
                varying |= set(a._spec.varying)
            elif a._spec is not None:
                raise ShardingError(f"{op.name}: operand {i} is a global tensor inside shard_map code; pass it in "
                                    f"through in_specs")
    G = mesh.ndim
    for a in args:
        if isinstance(a, Value):
            if a._data is None:
                abstract = True
                arrays.append(None)
            elif isinstance(a._spec, ManualSpec):
                arrays.append(a._data)
            else:
                arrays.append(np.asarray(a._data).reshape((1,) * G + a._shape))
        else:
            arrays.append(a)
    shapes = tuple(a._shape if isinstance(a, Value) else () for a in args)
    rule = op.rule(shapes, *params)
    shape = rule.result_shape
    spec = ManualSpec(mesh, varying)
    sigs = tuple(("h", a._shape, a._dtype, None) if isinstance(a, Value) else ("c", type(a)) for a in args)
    dtype = result_dtype(op, sigs, params)
    if abstract:
        return make(None, spec, shape, dtype)
    with np.errstate(all="ignore"):
        out = op.kernel(arrays, Local(G, shape, params))
    x = xp(out)
    out = x.asarray(out)
    if out.dtype != dtype:
        out = out.astype(dtype)
    out = x.broadcast_to(out, spec.grid() + shape)
    if x is np and out.flags.writeable:
        out.flags.writeable = False
    return make(out, spec, shape, dtype)
