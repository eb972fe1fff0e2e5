"""Autoshard's candidates: the arguments as leaves (kept, open and fixed dims), each layer class's inputs as
slots, per-axis options (dim classes a mesh axis cuts, FSDP) and the layouts they give, the standard layouts
(DP, FSDP, Megatron TP, SP) as options, and what comparing two layouts costs. Pricing and choosing are
search.py's."""

from __future__ import annotations

from functools import lru_cache
from itertools import combinations, product
from math import prod
from typing import Any, Callable, NamedTuple, Sequence

from .. import reshard
from ..autodiff import arg_names
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..pytree import flatten, leaf_paths
from ..spec import DimSpec, ShardingSpec
from ..tensor import Tensor
from . import layers as L
from .cluster import Cluster

class Option(NamedTuple):
    """What one mesh axis does in a layer: the dim classes it shards (each value on its first dim of one of
    them) and ``fsdp``: parameters it shards no dim of are cut on their largest dim over it (ZeRO-3)."""

    classes: frozenset
    fsdp: bool = False


class Candidate(NamedTuple):
    layouts: tuple  # per class input, its ShardingSpec (None: a host value)
    options: tuple | None  # per mesh axis, an Option (None: an exhaustive candidate)


# ---- arguments ---------------------------------------------------------------------------------------------


class Leaf(NamedTuple):
    path: str
    shape: tuple
    dtype: Any
    base: tuple  # per dim, the axes it keeps
    free: tuple  # per dim, whether more axes may be put there
    used: frozenset  # axes the leaf's spec uses already (closed dims, replicated axes)
    fixed: ShardingSpec | None


def _names(fn: Callable, n: int) -> list[str]:
    f = fn
    names = arg_names(f, n)
    if any(nm.startswith("args[") for nm in names):  # nb.grad / nb.value_and_grad: the function they wrap
        inner = next((c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                      if callable(c.cell_contents) and not isinstance(c.cell_contents, type)), None)
        if inner is not None:
            names = arg_names(inner, n)
    return names


def mesh_of(leaves: Sequence, cluster: Cluster) -> DeviceMesh:
    meshes = {x.sharding.mesh for x in leaves if isinstance(x, Tensor) and x.sharding is not None}
    if not meshes:
        raise ShardingError("autoshard: no argument is on a mesh; place them on one made by cluster.mesh(...) "
                            "(open dims, nb.DimSpec([], is_open=True), are the ones autoshard chooses)")
    if len(meshes) > 1:
        raise ShardingError(f"autoshard: the arguments are on {len(meshes)} meshes ({sorted(map(repr, meshes))}); "
                            f"they must share one made by cluster.mesh(...)")
    mesh = meshes.pop()
    if sorted(mesh.devices) != list(range(cluster.size)):
        raise ShardingError(f"autoshard: mesh {mesh!r} has devices {_short(mesh.devices)} but the cluster has "
                            f"devices 0..{cluster.size - 1} ({cluster.nodes} nodes x {cluster.devices_per_node}); "
                            f"make the mesh with cluster.mesh(...)")
    return mesh


def _short(devs: Sequence[int]) -> str:
    devs = list(devs)
    return str(devs) if len(devs) <= 8 else f"[{', '.join(map(str, devs[:4]))}, ..., {devs[-1]}] ({len(devs)})"


def _as_spec(mesh: DeviceMesh, spec: Any, rank: int, path: str) -> ShardingSpec:
    if isinstance(spec, ShardingSpec):
        if spec.mesh != mesh:
            raise ShardingError(f"autoshard: fixed spec for {path} is on {spec.mesh!r}, the arguments on {mesh!r}")
        s = spec
    else:
        try:
            s = ShardingSpec(mesh, spec)
        except ShardingError as e:  # (the spec's own error, told as the call's: which fixed entry)
            raise ShardingError(f"autoshard: fixed[{path!r}] = {spec!r}: {e}") from None
    s.check_rank((0,) * rank, "autoshard", path)
    return s


def arg_leaves(args: tuple, fn: Callable, mesh: DeviceMesh, fixed: dict | None) -> tuple[list, list[Leaf], Any]:
    leaves, tree = flatten(args)
    names = _names(fn, len(args))
    paths = [p for a, nm in zip(args, names) for p in leaf_paths(a, nm)]
    fixed = dict(fixed or {})
    unknown = [k for k in fixed if k not in paths]
    if unknown:
        raise ShardingError(f"autoshard: fixed names {unknown}, which are not argument paths; the paths are "
                            f"{paths}")
    out = []
    for x, p in zip(leaves, paths):
        if not isinstance(x, Tensor):
            out.append(Leaf(p, (), None, (), (), frozenset(), None))
            continue
        fx = _as_spec(mesh, fixed[p], x.ndim, p) if p in fixed else None
        spec = fx or x.sharding
        if spec is None:
            base, free, used = ((),) * x.ndim, (True,) * x.ndim, frozenset()
        else:
            base = tuple(tuple(d.axes) for d in spec.dim_specs)
            free = tuple(d.is_open and fx is None for d in spec.dim_specs)
            used = frozenset(a for d in spec.dim_specs for a in d.axes) | frozenset(spec.replicated_axes) | \
                frozenset(spec.partial_axes)
        out.append(Leaf(p, tuple(x.shape), x.dtype, base, free, used, fx))
    return leaves, out, tree


def _closed(mesh: DeviceMesh, leaf: Leaf, dims: Sequence[Sequence[str]]) -> ShardingSpec:
    return ShardingSpec(mesh, [DimSpec(tuple(d)) for d in dims])


def given_layout(mesh: DeviceMesh, leaf: Leaf) -> ShardingSpec:
    """A leaf's layout when nothing is chosen for it: its fixed spec, or its kept axes (open dims replicated)."""
    return leaf.fixed if leaf.fixed is not None else _closed(mesh, leaf, leaf.base)


# ---- layouts of a class ------------------------------------------------------------------------------------


class Slot(NamedTuple):
    """One input of a layer class, as the search sees it."""

    shape: tuple
    dtype: Any
    classes: tuple  # dim class per dim
    base: tuple
    free: tuple
    used: frozenset
    param: bool  # a parameter (cut further by fsdp)
    data: bool  # carries the batch (an activation, or an argument with a dim in the batch's class)
    given: Any  # the layout it keeps when it is not free at all (None: a host value)
    roles: tuple = ()  # per dim, "batch", "sequence" or "": its class program-wide
    leaf: bool = False  # an argument of the program
    constrained: bool = False  # an argument with dims the user closed or fixed (or axes it keeps replicated)
    recorded: Any = None  # the dtype the program gave it (a host value's too: the replay's input has it)

    def opened(self) -> "Slot":
        """The slot with every dim free: what a standard layout would make of it if the user had kept nothing."""
        n = len(self.shape)
        return self._replace(base=((),) * n, free=(True,) * n, used=frozenset())


def layout_of(mesh: DeviceMesh, slot: Slot, options: Sequence[Option]) -> Any:
    if slot.given is None and slot.dtype is None:
        return None
    if not any(slot.free):
        return slot.given
    dims = [list(b) for b in slot.base]
    taken = set(slot.used)
    for axis, opt in zip(mesh.axis_names, options):
        if opt is None or axis in taken or mesh.axis_size(axis) == 1:
            continue
        k = mesh.axis_size(axis)
        placed = False
        for d, c in enumerate(slot.classes):
            if slot.free[d] and c in opt.classes and slot.shape[d] % (_ways(mesh, dims[d]) * k) == 0:
                dims[d].append(axis)
                placed = True
                break
        if not placed and opt.fsdp and slot.param:
            best = max((d for d in range(len(slot.shape)) if slot.free[d]
                        and slot.shape[d] % (_ways(mesh, dims[d]) * k) == 0),
                       key=lambda d: slot.shape[d] // _ways(mesh, dims[d]), default=None)
            if best is not None:
                dims[best].append(axis)
                placed = True
        if placed:
            taken.add(axis)
    return ShardingSpec(mesh, [DimSpec(tuple(d)) for d in dims])


def _ways(mesh: DeviceMesh, axes: Sequence[str]) -> int:
    return prod(mesh.axis_size(a) for a in axes)


def all_layouts(mesh: DeviceMesh, slot: Slot) -> list:
    """Every layout of one slot: each free axis on one free dim (mesh order within a dim) or on none."""
    if slot.given is None and slot.dtype is None:
        return [None]
    if not any(slot.free):
        return [slot.given]
    axes = [a for a in mesh.axis_names if a not in slot.used and mesh.axis_size(a) > 1]
    dims_free = [d for d in range(len(slot.shape)) if slot.free[d]]
    out = []
    for where in product([None] + dims_free, repeat=len(axes)):
        dims = [list(b) for b in slot.base]
        ok = True
        for a, d in zip(axes, where):
            if d is not None:
                dims[d].append(a)
        for d in dims_free:
            if slot.shape[d] % _ways(mesh, dims[d]):
                ok = False
        if ok:
            out.append(ShardingSpec(mesh, [DimSpec(tuple(d)) for d in dims]))
    return list(dict.fromkeys(out))


def axis_options(cls: L.LayerClass, slots: Sequence[Slot]) -> list:
    """Per-axis options: nothing; one dim class; a largest set of classes no value has two of, among those that
    carry no batch (Megatron's column- then row-parallel cut); each with fsdp where the axis cuts the batch."""
    relevant = sorted({c for s in slots for c, f in zip(s.classes, s.free) if f and (s.param or s.data)})
    data = {c for s in slots if s.data for c in s.classes}
    inner = [c for c in relevant if c not in data]
    opts = [None] + [Option(frozenset([c])) for c in relevant]
    opts += [Option(s) for s in _cliques(inner, cls.compatible) if len(s) > 1]
    opts += [Option(o.classes, True) for o in opts if o is not None and o.classes & data]
    if any(s.param for s in slots):
        opts.append(Option(frozenset(), True))
    return opts


def _cliques(classes: Sequence[int], compatible: frozenset) -> list[frozenset]:
    """The largest sets of classes that no value has two of (all of them, for up to 12 classes)."""
    classes = list(classes)[:12]
    ok = [s for r in range(len(classes), 0, -1) for s in combinations(classes, r)
          if all(frozenset(p) in compatible for p in combinations(s, 2))]
    out: list[frozenset] = []
    for s in ok:
        fs = frozenset(s)
        if not any(fs < o for o in out):
            out.append(fs)
    return out


def megatron_classes(cls: L.LayerClass, slots: Sequence[Slot]) -> frozenset:
    """The set of batch-free classes that cuts the most parameter bytes (column- then row-parallel)."""
    data = {c for s in slots if s.data for c in s.classes}
    inner = sorted({c for s in slots if s.param for c, f in zip(s.classes, s.free) if f} - data)
    best, score = frozenset(), 0
    for cl in _cliques(inner, cls.compatible):
        sc = sum(prod(s.shape) * s.dtype.itemsize for s in slots if s.param and set(s.classes) & cl)
        if sc > score:
            best, score = cl, sc
    return best


def batch_classes(slots: Sequence[Slot]) -> tuple[frozenset, frozenset]:
    """(the classes of the batch's dims, of the sequence's) among a layer class's inputs: every dim the program
    joins to the batch, so DP cuts the token ids, the targets and the masks as it cuts the activations."""
    def having(role: str) -> frozenset:
        return frozenset(c for s in slots for c, r in zip(s.classes, s.roles) if r == role)

    return having("batch"), having("sequence")


def baseline_options(mesh: DeviceMesh, cls: L.LayerClass, slots: Sequence[Slot]) -> dict[str, tuple]:
    """The standard layouts as per-axis options: DP (the batch over every axis), FSDP (and the parameters cut
    over them), Megatron TP over the last axis with DP or FSDP over the others, and the same with the sequence
    of the batch-carrying inputs cut over the tp axis too (sequence parallelism)."""
    axes = [a for a in mesh.axis_names if mesh.axis_size(a) > 1]
    b, s = batch_classes(slots)
    tp = megatron_classes(cls, slots)
    out = {"DP": tuple(Option(b) if a in axes else None for a in mesh.axis_names),
           "FSDP": tuple(Option(b, True) if a in axes else None for a in mesh.axis_names)}
    if axes:  # (a class without parameters to cut runs the batch as DP does; autoshard drops the name when
        # no class has any)
        last = axes[-1]
        for name, fsdp in ((("TP x DP", False), ("TP x FSDP", True)) if len(axes) > 1 else (("TP", False),)):
            out[name] = tuple(None if a not in axes else Option(tp) if a == last else Option(b, fsdp)
                              for a in mesh.axis_names)
            if s:
                out[name + " + SP"] = tuple(None if a not in axes else Option(tp | s) if a == last else
                                            Option(b, fsdp) for a in mesh.axis_names)
    return out


# ---- layouts compared -----------------------------------------------------------------------------------


@lru_cache(maxsize=65536)
def reshard_time(shape: tuple, itemsize: int, src: ShardingSpec, dst: ShardingSpec, cluster: Cluster) -> float:
    """A lower bound on the time to bring a value from ``src`` to ``dst``: the bytes no plan can beat
    (``reshard.lower_bound``) over the bandwidth of the slowest link the axes that change use."""
    if layout_key(src) == layout_key(dst):
        return 0.0
    try:
        nbytes = reshard.lower_bound(shape, itemsize, src, dst)
    except ShardingError:
        return 0.0
    a, b = layout_key(src), layout_key(dst)
    moved = {x for d in a[0] + b[0] for x in d} | set(a[1]) | set(b[1])
    moved -= {x for da, db in zip(a[0], b[0]) if da == db for x in da}
    tier = cluster.tier(src.mesh, sorted(moved)).kind if moved else "nvlink"
    latency, bandwidth = cluster.hardware.link("nvlink" if tier == "nvlink" else "network")
    return latency + nbytes / bandwidth


def layout_key(spec: Any) -> Any:
    """A layout as the blocks see it: axes per dim and partial axes (open or closed alike)."""
    if spec is None:
        return None
    return tuple(d.axes for d in spec.dim_specs), tuple(spec.partial_axes)


def data_dims_only(spec: Any, slot: Slot) -> bool:
    """Whether ``spec`` cuts only dims of ``slot`` that are the batch or the sequence (a sum may be pending: a
    row-parallel layer's output, or a vocabulary-parallel lookup's)."""
    if spec is None:
        return True
    return all(not ds.axes or (d < len(slot.roles) and slot.roles[d] in ("batch", "sequence"))
               for d, ds in enumerate(spec.dim_specs))
