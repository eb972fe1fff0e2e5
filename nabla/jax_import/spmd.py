"""Sharding and per-device code: ``sharding_constraint`` is ``with_sharding`` on the tensors' mesh (unconstrained
dims open), ``shard_map`` is ``nb.shard_map`` with the body imported, and the collectives inside it are
``nb.lax``'s (``psum``, ``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``, ``axis_index``)."""

from __future__ import annotations

from typing import Any

from .. import lax as L
from ..errors import ShardingError
from ..shard_map import shard_map as nb_shard_map
from ..spec import DimSpec
from .interpreter import compile_jaxpr
from .table import as_tensor, primitive


def _mesh(ev, e, sharding_mesh: Any = None):
    mesh = ev.mesh
    if mesh is None:
        raise ShardingError(f"{e.name} needs a mesh, and no argument is sharded: shard the arguments first")
    if sharding_mesh is not None:
        names = tuple(getattr(sharding_mesh, "axis_names", ()))
        if names and names != tuple(mesh.axis_names):
            raise ShardingError(f"{e.name} names mesh axes {names}, the tensors' mesh has {tuple(mesh.axis_names)}")
    return mesh


def _entry(x: Any, open_: bool) -> Any:
    if open_ or type(x).__name__ == "UnconstrainedSingleton":
        return DimSpec([], is_open=True)
    return x


@primitive("sharding_constraint")
def _constraint(ev, e, x):
    sh = e.params["sharding"]
    spec = getattr(sh, "spec", None)
    if spec is None:
        raise ShardingError(f"a sharding of type {type(sh).__name__} is not supported; use a NamedSharding or a "
                            f"PartitionSpec")
    return _laid_out(ev, e, as_tensor(x), sh, e.params.get("unconstrained_dims") or ())


def _laid_out(ev, e, x, sh, free) -> Any:
    """``x`` laid out as the NamedSharding ``sh`` on the tensors' mesh; dims in ``free`` (or unconstrained) open."""
    mesh = _mesh(ev, e, getattr(sh, "mesh", None))
    spec = tuple(sh.spec)
    entries = list(spec) + [None] * (x.ndim - len(spec))
    dims = [_entry(s, d in free) for d, s in enumerate(entries)]
    return x.shard(mesh, dims) if x.sharding is None else x.with_sharding(mesh, dims)


@primitive("reshard")
def _reshard(ev, e, x):
    """``jax.sharding.reshard``: a layout on a mesh (a constraint), nothing on the empty mesh JAX's own
    differentiation writes it with."""
    sh = e.params["dst_sharding"]
    if not tuple(getattr(getattr(sh, "mesh", None), "axis_names", ())):
        return x
    return _laid_out(ev, e, as_tensor(x), sh, ())


@primitive("device_put")
def _device_put(ev, e, *xs):
    """An identity, or a constraint when a device is a sharding."""
    out = []
    for x, dev in zip(xs, e.params.get("devices") or (None,) * len(xs)):
        out.append(x if getattr(dev, "spec", None) is None else _laid_out(ev, e, as_tensor(x), dev, ()))
    return out


def _shard_map_prepare(e):
    e.subs["body"] = compile_jaxpr(e.params["jaxpr"], e.site)


def _shard_map(ev, e, *args):
    p = e.params
    mesh = _mesh(ev, e, p.get("mesh"))
    manual = p.get("manual_axes") or p.get("newly_manual_axes") or frozenset(mesh.axis_names)
    if set(manual) != set(mesh.axis_names):
        raise ShardingError(f"shard_map manual over {sorted(manual)} of the mesh's axes {list(mesh.axis_names)}: "
                            f"nb.shard_map is manual over every axis")
    prog = e.subs["body"]

    def body(*xs):
        return list(ev.run(prog, (), list(xs)))
    outs = nb_shard_map(body, mesh, list(p["in_specs"]), list(p["out_specs"]))(*[as_tensor(a) for a in args])
    return list(outs)


_shard_map.prepare = _shard_map_prepare
primitive("shard_map", call=True)(_shard_map)


def _axes(e, key: str = "axis_name") -> tuple[str, ...]:
    a = e.params[key]
    axes = (a,) if isinstance(a, str) else tuple(a)
    if any(not isinstance(n, str) for n in axes):
        raise ShardingError(f"positional axes {axes} (pmap) are not supported; name mesh axes")
    if e.params.get("axis_index_groups") is not None:
        raise ShardingError("axis_index_groups are not supported")
    return axes


def _reducing(fn):
    def run(ev, e, *xs):
        out = [fn(as_tensor(x), _axes(e, "axes")) for x in xs]
        return out if e.multi else out[0]
    return run


primitive("psum", "psum_invariant")(_reducing(L.psum))
primitive("pmax")(_reducing(L.pmax))
primitive("pmin")(_reducing(L.pmin))


@primitive("all_gather", "all_gather_invariant")
def _all_gather(ev, e, x):
    return L.all_gather(x, _axes(e), axis=int(e.params["all_gather_dimension"]), tiled=bool(e.params["tiled"]))


@primitive("reduce_scatter")
def _reduce_scatter(ev, e, x):
    return L.psum_scatter(x, _axes(e), scatter_dimension=int(e.params["scatter_dimension"]),
                          tiled=bool(e.params["tiled"]))


@primitive("all_to_all")
def _all_to_all(ev, e, x):
    """The primitive splits and concatenates blocks along dims already shaped for it: nb.lax's tiled form."""
    return L.all_to_all(x, _axes(e), int(e.params["split_axis"]), int(e.params["concat_axis"]), tiled=True)


@primitive("ppermute")
def _ppermute(ev, e, x):
    return L.ppermute(x, _axes(e), [tuple(int(i) for i in pair) for pair in e.params["perm"]])


@primitive("axis_index")
def _axis_index(ev, e):
    return L.axis_index(_axes(e))
