"""DimSpec and ShardingSpec: frozen, hashable, validated descriptions of how a tensor lies on a mesh.

Follows the Nabla sharding README (the Nabla sharding README) and Shardy's notation; the text formats live in ``formats``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from typing import Any, Iterable, Sequence

import numpy as np

from .errors import ShardingError
from .layout import shard_slices
from .args import MAX_RANK, bounded_tuple, is_int, short_repr
from .mesh import AxisRef, DeviceMesh, merge_adjacent

#: The most axes one dim (or the replicated or partial set) may name: more than any mesh can hold.
_MAX_AXES_PER_DIM = 64
#: Priorities are small ints in Shardy (p0, p1, ...); this only keeps a huge int out of reprs.
_MAX_PRIORITY = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class DimSpec:
    """How one dim is sharded: mesh axes major to minor, whether propagation may add axes, and priority."""

    axes: tuple[str, ...] = ()
    is_open: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        axes = self.axes
        if type(axes) is tuple and type(self.is_open) is bool and type(self.priority) is int and \
                0 <= self.priority <= _MAX_PRIORITY and len(axes) <= _MAX_AXES_PER_DIM and \
                all(type(a) is str for a in axes):
            return  # already canonical: the common case, kept cheap
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        axes = bounded_tuple(axes, "DimSpec: axes", _MAX_AXES_PER_DIM)
        for a in axes:
            if not isinstance(a, str):
                raise ShardingError(f"DimSpec: axis {short_repr(a)} in axes {short_repr(self.axes)} is not a str")
        if not isinstance(self.is_open, (bool, np.bool_)):
            raise ShardingError(f"DimSpec: is_open must be a bool, got {short_repr(self.is_open)}")
        if not is_int(self.priority) or not 0 <= self.priority <= _MAX_PRIORITY:
            raise ShardingError(f"DimSpec: priority must be an int in [0, 2**31), got {short_repr(self.priority)}")
        object.__setattr__(self, "axes", tuple(str(a) for a in axes))
        object.__setattr__(self, "is_open", bool(self.is_open))
        object.__setattr__(self, "priority", int(self.priority))

    def __repr__(self) -> str:
        parts = [f'"{a}"' for a in self.axes] + (["?"] if self.is_open else [])
        return "{" + ", ".join(parts) + "}" + (f"p{self.priority}" if self.priority else "")

    @staticmethod
    def coerce(entry: Any) -> "DimSpec":
        """Accept the JAX ``PartitionSpec`` shorthands: ``None``, one axis name, a tuple of names, and
        ``PartitionSpec.UNCONSTRAINED`` (an open dim)."""
        if isinstance(entry, DimSpec):
            return entry
        if entry is None:
            return _REPLICATED
        if isinstance(entry, str):
            return DimSpec((entry,))
        if isinstance(entry, (tuple, list)):
            return DimSpec(tuple(entry))
        if is_unconstrained(entry):
            return _OPEN
        raise ShardingError(f"a dim spec must be a DimSpec, None, a str or a tuple of str; got {short_repr(entry)}")


_REPLICATED = DimSpec()
_OPEN = DimSpec((), is_open=True)


def is_unconstrained(entry: Any) -> bool:
    """``jax.sharding.PartitionSpec.UNCONSTRAINED``, recognised without importing jax: it can only exist
    once jax is imported."""
    if "jax" not in sys.modules:
        return False
    from jax.sharding import PartitionSpec
    return entry is getattr(PartitionSpec, "UNCONSTRAINED", object())


def _check(mesh: DeviceMesh, dim_specs: Iterable[Any], replicated_axes: Iterable[str], partial_axes: Iterable[str]
           ) -> tuple:
    """A spec's canonical parts, checked: (dim specs, replicated axes, partial axes, parsed refs, hash)."""
    entries = bounded_tuple(dim_specs, "ShardingSpec: dim_specs (one entry per dim)", MAX_RANK)
    dims = []
    for i, d in enumerate(entries):
        try:
            dims.append(DimSpec.coerce(d))
        except ShardingError as e:
            raise ShardingError(f"ShardingSpec on @{mesh.name}, dim {i}: {e}") from None
    dims = tuple(dims)
    rep = _axis_tuple(replicated_axes, "replicated_axes")
    par = _axis_tuple(partial_axes, "partial_axes")
    # Canonical axis names: "x:(1)8" on an axis of size 8 is just "x".
    refs_by_dim = []
    raw: list[tuple[AxisRef, str]] = []  # every axis as written, before neighbours merge
    for i, d in enumerate(dims):
        written = [_ref(mesh, a, f"dim {i}") for a in d.axes]
        raw += [(r, f"dim {i}") for r in written]
        refs = merge_adjacent(written)
        refs_by_dim.append(refs)
        canon = tuple(str(r) for r in refs)
        if canon != d.axes:
            dims = dims[:i] + (DimSpec(canon, d.is_open, d.priority),) + dims[i + 1:]
    # replicated and partial axes are sets: kept in mesh order so equal specs compare equal
    in_mesh_order = lambda r: (mesh.axis_index(r.name), r.pre)  # noqa: E731
    # ... and neighbouring pieces of one axis merge: partial over {"x:(1)2", "x:(2)2"} is partial over {"x"}
    rep_written = [_ref(mesh, a, "replicated_axes") for a in rep]
    par_written = [_ref(mesh, a, "partial_axes") for a in par]
    raw += [(r, "replicated_axes") for r in rep_written] + [(r, "partial_axes") for r in par_written]
    rep_refs = merge_adjacent(sorted(rep_written, key=in_mesh_order))
    par_refs = merge_adjacent(sorted(par_written, key=in_mesh_order))
    # Checked as written: merging first would fold a repeated axis of size 1 ("x", "x") into one.
    for (a, wa), (b, wb) in combinations(raw, 2):
        if a.overlaps(b):
            what = "is used twice" if a == b else f"overlaps {str(b)!r}"
            raise ShardingError(
                f"ShardingSpec on @{mesh.name}: axis {str(a)!r} ({wa}) {what} ({wb}); an axis may appear "
                f"in one place of a spec only: one dim, or replicated_axes, or partial_axes")
    rep_s, par_s = tuple(str(r) for r in rep_refs), tuple(str(r) for r in par_refs)
    return dims, rep_s, par_s, (tuple(refs_by_dim), par_refs), hash((mesh, dims, rep_s, par_s))


#: specs of DimSpecs and axis names, checked once each (a search builds the same few hundred tens of thousands
#: of times); equal meshes give equal parts
_checked = lru_cache(maxsize=16384)(_check)


class ShardingSpec:
    """Per-dim axes plus explicitly replicated and partial (unreduced-sum) axes, on one mesh.

    Built only valid: every axis exists, sub-axes divide their axis, and no axis or overlapping
    sub-axis appears twice anywhere in the spec.
    """

    __slots__ = ("mesh", "dim_specs", "replicated_axes", "partial_axes", "_hash", "_refs", "_layout")

    def __init__(self, mesh: DeviceMesh, dim_specs: Iterable[Any], replicated_axes: Iterable[str] = (),
                 partial_axes: Iterable[str] = ()) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(f"ShardingSpec: mesh must be a DeviceMesh, got {type(mesh).__name__} {short_repr(mesh)}")
        if isinstance(dim_specs, (str, DimSpec)) or dim_specs is None:
            raise ShardingError(f"ShardingSpec: dim_specs must be a list with one entry per dim, got {short_repr(dim_specs)}")
        if type(dim_specs) in (tuple, list) and type(replicated_axes) in (tuple, list) and \
                type(partial_axes) in (tuple, list) and all(type(d) is DimSpec for d in dim_specs) and \
                all(type(a) is str for a in replicated_axes) and all(type(a) is str for a in partial_axes):
            # the executor's and the planner's specs (DimSpecs, axis names): checked once per distinct spec
            got = _checked(mesh, tuple(dim_specs), tuple(replicated_axes), tuple(partial_axes))
        else:
            got = _check(mesh, dim_specs, replicated_axes, partial_axes)
        dims, rep, par, refs, h = got
        set_ = object.__setattr__
        set_(self, "mesh", mesh)
        set_(self, "dim_specs", dims)
        set_(self, "replicated_axes", rep)
        set_(self, "partial_axes", par)
        set_(self, "_refs", refs)
        set_(self, "_hash", h)
        set_(self, "_layout", None)

    def __setattr__(self, key, value):
        raise AttributeError("ShardingSpec is immutable")

    def __reduce__(self):
        return (ShardingSpec, (self.mesh, self.dim_specs, self.replicated_axes, self.partial_axes))

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, ShardingSpec) and self._hash == other._hash
                                 and self.mesh == other.mesh and self.dim_specs == other.dim_specs
                                 and self.replicated_axes == other.replicated_axes
                                 and self.partial_axes == other.partial_axes)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        s = "[" + ", ".join(repr(d) for d in self.dim_specs) + "]"
        if self.replicated_axes:
            s += ", replicated={" + ", ".join(f'"{a}"' for a in self.replicated_axes) + "}"
        if self.partial_axes:
            s += ", partial={" + ", ".join(f'"{a}"' for a in self.partial_axes) + "}"
        return s

    # ---- structure -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return len(self.dim_specs)

    @property
    def dim_refs(self) -> tuple[tuple[AxisRef, ...], ...]:
        """Per dim, the parsed axes major to minor."""
        return self._refs[0]

    @property
    def partial_refs(self) -> tuple[AxisRef, ...]:
        return self._refs[1]

    def layout(self) -> "ShardingSpec":
        """The same placement with propagation hints dropped: closed dims, priority 0, no replicated_axes.

        Two specs with one layout hold identical blocks, so layout-level caches key on this.
        """
        if self._layout is None:
            plain = tuple(DimSpec(d.axes) for d in self.dim_specs)
            lay = self if (plain == self.dim_specs and not self.replicated_axes) else \
                ShardingSpec(self.mesh, plain, (), self.partial_axes)
            object.__setattr__(self, "_layout", lay)
        return self._layout

    def num_shards(self, dim: int) -> int:
        n = 1
        for r in self.dim_refs[dim]:
            n *= r.size
        return n

    @property
    def is_replicated(self) -> bool:
        return not self.partial_axes and not any(self.dim_refs)

    def check_rank(self, shape: Sequence[int], op: str = "shard", operand: str | int | None = None) -> None:
        if len(shape) != self.rank:
            who = f"{op}" + (f", operand {operand}" if operand is not None else "")
            raise ShardingError(
                f"{who}: spec {self!r} has {self.rank} dims but the tensor has shape {tuple(shape)} "
                f"(rank {len(shape)})")

    def shard_slices(self, global_shape: Sequence[int], device_id: int) -> tuple[slice, ...]:
        return shard_slices(self, _global_shape(self, global_shape, "shard_slices"),
                            _device_id(self, device_id, "shard_slices"))

    def shard_shape(self, global_shape: Sequence[int], device_id: int) -> tuple[int, ...]:
        shape = _global_shape(self, global_shape, "shard_shape")
        return tuple(s.stop - s.start for s in shard_slices(self, shape, _device_id(self, device_id, "shard_shape")))

    # ---- formats: to_mhlo, from_mhlo, to_partition_spec, from_partition_spec are set by ``nabla.formats``,
    # which builds on this module ------------------------------------------------------------------------

    @staticmethod
    def replicated(mesh: DeviceMesh, rank: int, is_open: bool = False) -> "ShardingSpec":
        return ShardingSpec(mesh, [DimSpec((), is_open)] * check_rank_arg(rank, "ShardingSpec.replicated"))


def _global_shape(spec: "ShardingSpec", shape: Any, who: str) -> tuple[int, ...]:
    """``shape`` as a tuple of ints >= 0 of the spec's rank, or a ``ShardingError`` naming it."""
    if isinstance(shape, (str, bytes, bytearray, set, frozenset, dict)) or shape is None or is_int(shape):
        raise ShardingError(f"{who}(global_shape, device_id): global_shape must be a sequence of ints, got "
                            f"{type(shape).__name__} {short_repr(shape)}")
    dims = bounded_tuple(shape, f"{who}: global_shape", MAX_RANK)
    for i, n in enumerate(dims):
        if not is_int(n) or n < 0:
            raise ShardingError(f"{who}(global_shape, device_id): global_shape {short_repr(shape)} has "
                                f"{type(n).__name__} {short_repr(n)} at position {i}; dims are ints >= 0")
    dims = tuple(int(n) for n in dims)
    spec.check_rank(dims, who)
    return dims


def _device_id(spec: "ShardingSpec", device_id: Any, who: str) -> int:
    if not is_int(device_id):
        raise ShardingError(f"{who}(global_shape, device_id): device_id must be an int (a device of "
                            f"{spec.mesh!r}), got {type(device_id).__name__} {short_repr(device_id)}")
    spec.mesh.coords(device_id)  # a ShardingError naming it when not in the mesh
    return int(device_id)


def _axis_tuple(axes: Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(axes, str):
        axes = (axes,)
    elif isinstance(axes, (set, frozenset)):  # a set of axes is fine here: the spec keeps them in mesh order
        axes = sorted(axes, key=lambda a: (not isinstance(a, str), str(a)))
    axes = bounded_tuple(axes, f"ShardingSpec: {what} (a sequence of axis names)", _MAX_AXES_PER_DIM)
    for a in axes:
        if not isinstance(a, str):
            raise ShardingError(f"ShardingSpec: {what} must hold axis names (str), got {short_repr(a)} in {short_repr(axes)}")
    return axes


def check_rank_arg(rank: Any, who: str, may_be_none: bool = False) -> int:
    """``rank`` as an int in ``[0, MAX_RANK]``, or a ``ShardingError`` naming it."""
    if not is_int(rank) or not 0 <= rank <= MAX_RANK:
        raise ShardingError(f"{who}: rank must be an int in [0, {MAX_RANK}]{' (or None)' if may_be_none else ''}, "
                            f"got {type(rank).__name__} {short_repr(rank)}")
    return int(rank)


def _ref(mesh: DeviceMesh, axis: str, where: str) -> AxisRef:
    try:
        return mesh.axis_ref(axis)
    except ShardingError as e:
        raise ShardingError(f"ShardingSpec ({where}): {e}") from None
