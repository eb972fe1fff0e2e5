"""``nb.NamedSharding(mesh, spec)``: a mesh and a spec in one hashable value, as JAX's ``NamedSharding``; and
the one place that turns every spelling of a placement (dim list, ``ShardingSpec``, ``PartitionSpec``,
``NamedSharding``) into a ``ShardingSpec`` for a tensor of a given rank."""

from __future__ import annotations

from typing import Any, Sequence

from .errors import ShardingError
from .pytree import _outline, flatten
from .formats import _jax_pspec, from_partition_spec
from .args import short_repr
from .mesh import DeviceMesh
from .spec import DimSpec, ShardingSpec
from .interop.jax import jax_sharding


class NamedSharding:
    """Where a tensor lives: ``mesh`` and ``spec`` (a ``ShardingSpec``, possibly shorter than the tensors it
    is applied to: missing trailing dims are replicated, as JAX pads a short ``PartitionSpec`` with ``None``).

    ``spec`` may be given as a ``ShardingSpec``, a JAX ``PartitionSpec`` or a list of dim entries (``None``,
    an axis, a tuple of axes, a ``DimSpec``). ``t.shard(named)`` and ``t.with_sharding(named)`` take it
    without a mesh argument. Hashable, equal by value.
    """

    __slots__ = ("mesh", "spec", "_hash")

    def __init__(self, mesh: DeviceMesh, spec: Any = (), replicated_axes: Sequence[str] = (),
                 partial_axes: Sequence[str] = ()) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(f"NamedSharding(mesh, spec): mesh must be a nabla DeviceMesh, got "
                                f"{type(mesh).__name__} {short_repr(mesh)}")
        s = to_spec(mesh, spec, None, replicated_axes, partial_axes, "NamedSharding")
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "spec", s)
        object.__setattr__(self, "_hash", hash(("NamedSharding", s)))

    def __setattr__(self, key, value):
        raise AttributeError("NamedSharding is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NamedSharding) and self.spec == other.spec

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"NamedSharding(mesh={self.mesh!r}, spec={self.spec!r})"

    def __reduce__(self):
        return (NamedSharding, (self.mesh, self.spec))

    def spec_for(self, rank: int, op: str = "NamedSharding") -> ShardingSpec:
        """The spec for a tensor of ``rank`` dims (padded with replicated dims; too long raises)."""
        return pad(self.spec, rank, op)

    def shard_shape(self, global_shape: Sequence[int], device_id: int | None = None) -> tuple[int, ...]:
        """A device's block shape (by default the first device's: the largest, under the ceil rule)."""
        shape = tuple(global_shape)
        return self.spec_for(len(shape), "shard_shape").shard_shape(shape, self.mesh.devices[0]
                                                                    if device_id is None else device_id)

    def devices_indices_map(self, global_shape: Sequence[int]) -> dict[int, tuple[slice, ...]]:
        """Device id -> the slices of the global value it holds (JAX's ``devices_indices_map``)."""
        shape = tuple(global_shape)
        spec = self.spec_for(len(shape), "devices_indices_map")
        return {d: spec.shard_slices(shape, d) for d in self.mesh.devices}

    @property
    def device_set(self) -> frozenset[int]:
        return frozenset(self.mesh.devices)

    @property
    def is_fully_replicated(self) -> bool:
        return self.spec.is_replicated

    def to_jax(self):
        """The equivalent ``jax.sharding.NamedSharding`` (device ``d`` is ``jax.devices()[d]``)."""
        return jax_sharding(self.spec.layout())


def pad(spec: ShardingSpec, rank: int, op: str) -> ShardingSpec:
    """``spec`` with replicated dims appended up to ``rank`` (JAX's rule for a short ``PartitionSpec``)."""
    if spec.rank > rank:
        raise ShardingError(f"{op}: spec {spec!r} has {spec.rank} dims but the tensor has rank {rank}")
    if spec.rank == rank:
        return spec
    return ShardingSpec(spec.mesh, spec.dim_specs + (DimSpec(),) * (rank - spec.rank), spec.replicated_axes,
                        spec.partial_axes)


def _merge(a: Sequence[str], b: Sequence[str]) -> Sequence[str]:
    if not b:
        return a
    if not a:
        return b
    b = (b,) if isinstance(b, str) else tuple(b)
    return tuple(dict.fromkeys(tuple(a) + b))


def to_spec(mesh: Any, dim_specs: Any, rank: int | None, replicated_axes: Sequence[str] = (),
            partial_axes: Sequence[str] = (), op: str = "shard") -> ShardingSpec:
    """The ``ShardingSpec`` that ``op(mesh, dim_specs, replicated_axes, partial_axes)`` asks for, on a tensor of
    ``rank`` dims (``None``: any rank, no padding). Accepts every spelling users bring:

    - ``op(named_sharding)``: a ``NamedSharding`` (or a ``ShardingSpec``) in place of the mesh;
    - ``op(mesh, ShardingSpec)``: its dims, replicated and partial axes (plus any given separately);
    - ``op(mesh, PartitionSpec)``: JAX's, padded with ``None`` to the rank, ``UNCONSTRAINED`` an open dim,
      ``unreduced`` axes partial;
    - ``op(mesh, [entries])``: one entry per dim; ``op(mesh)`` alone: replicated.
    """
    if isinstance(mesh, (NamedSharding, ShardingSpec)):
        if dim_specs is not None:
            raise ShardingError(f"{op}: got a {type(mesh).__name__} {mesh!r} and also dim_specs {short_repr(dim_specs)}; "
                                f"pass one or the other")
        mesh, dim_specs = mesh.mesh, mesh
    if not isinstance(mesh, DeviceMesh):
        hint = ""
        if type(mesh).__module__.startswith("jax"):
            hint = " (a jax object: build a nabla DeviceMesh with the same axis names, or use nb.from_jax)"
        raise ShardingError(f"{op}(mesh, dim_specs): mesh must be a nabla DeviceMesh or NamedSharding, got "
                            f"{type(mesh).__name__} {short_repr(mesh)}{hint}")
    padded = False
    if isinstance(dim_specs, NamedSharding):
        dim_specs = dim_specs.spec
        padded = True
    if dim_specs is None:  # DTensor's and JAX's default placement: replicated
        dims, rep, par = (), (), ()
        padded = True
    elif isinstance(dim_specs, ShardingSpec):
        if dim_specs.mesh != mesh:
            raise ShardingError(f"{op}: spec {dim_specs!r} is on mesh {dim_specs.mesh!r}, not on the mesh given "
                                f"{mesh!r}")
        dims, rep, par = dim_specs.dim_specs, dim_specs.replicated_axes, dim_specs.partial_axes
    elif is_pspec(dim_specs):
        s = from_partition_spec(mesh, dim_specs)
        dims, rep, par = s.dim_specs, (), s.partial_axes
        padded = True
    else:
        if isinstance(dim_specs, (str, DimSpec)):
            raise ShardingError(f"{op}: dim_specs must be a list with one entry per dim (or a ShardingSpec, a "
                                f"PartitionSpec), got {short_repr(dim_specs)}; for a 1-D tensor write [{dim_specs!r}]")
        if not isinstance(dim_specs, (list, tuple)):
            raise ShardingError(f"{op}: dim_specs must be a list with one entry per dim (each None, an axis name, "
                                f"a tuple of axis names or a DimSpec), a ShardingSpec, a PartitionSpec or an "
                                f"nb.NamedSharding; got {type(dim_specs).__name__} {short_repr(dim_specs)}")
        dims, rep, par = dim_specs, (), ()
    spec = ShardingSpec(mesh, dims, _merge(rep, replicated_axes), _merge(par, partial_axes))
    if padded and rank is not None:
        spec = pad(spec, rank, op)
    return spec


def is_pspec(x: Any) -> bool:
    """A ``jax.sharding.PartitionSpec`` (False, with no import, when jax is not loaded)."""
    P = _jax_pspec()
    return P is not None and isinstance(x, P)


def specs_like(params: Any, specs: Any, what: str) -> list:
    """Per leaf of the pytree ``params``, the layout ``specs`` (a pytree like it, of ShardingSpecs, PartitionSpecs or
    dim-spec lists; None leaves and None ``specs``: the leaf's own) gives it: optimizer state, gradients."""
    leaves, tree = flatten(params)
    if specs is None:
        return [p.sharding for p in leaves]
    given, stree = flatten(specs, is_leaf=_is_spec_leaf)
    if stree != tree:
        raise ShardingError(f"{what}: specs must be a pytree like params ({_outline(params)[:200]}); got "
                            f"{_outline(specs)[:200]}")
    out = []
    for p, s in zip(leaves, given):
        if s is None:
            out.append(p.sharding)
            continue
        if p.sharding is None:
            raise ShardingError(f"{what}: a state spec {s!r} for a parameter of shape {p.shape} on no mesh; shard "
                                f"the parameters first")
        out.append(to_spec(p.sharding.mesh, s, p.ndim, op=f"{what} specs"))
    return out


def _is_spec_leaf(x: Any) -> bool:
    """A leaf of a ``specs`` pytree: a ShardingSpec, a PartitionSpec, or a list of dim entries (not a subtree)."""
    if isinstance(x, ShardingSpec) or is_pspec(x) or x is None:
        return True
    return isinstance(x, list) and all(e is None or isinstance(e, (str, tuple)) or hasattr(e, "axes") for e in x)
