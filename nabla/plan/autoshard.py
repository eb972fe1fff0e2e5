"""``nb.autoshard``: the argument shardings with the least estimated step time within a memory limit. Layers
(layers.py) are priced by replaying their recorded steps under candidate layouts, one chosen per layer class by
a MILP (milp.py), and the choice checked with the estimator against DP, FSDP, Megatron TP and SP."""

from __future__ import annotations

import time as _time
from functools import lru_cache
from itertools import combinations, product
from math import prod
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .. import collectives as C
from .. import reshard
from ..autodiff import _arg_name, _paths
from ..pytree import flatten, unflatten
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..spec import DimSpec, ShardingSpec
from ..tensor import Tensor
from . import layers as L
from . import milp
from .cluster import Cluster
from .estimate import _priced, estimate
from .report import Report, estimate_steps

#: a class whose arguments have at most this many layouts together is searched over all of them
EXHAUSTIVE = 256
#: more combinations of per-axis options than this: each axis's options are screened alone first, and the
#: KEEP_FAST fastest and KEEP_SMALL smallest (with the standard layouts') are combined
SCREEN, KEEP_FAST, KEEP_SMALL = 48, 3, 2
#: a class fed by another is priced under the layouts the FEEDS fastest of its producer's candidates hand over
#: (and the standard layouts'); producer candidates handing over anything else are left out
FEEDS = 3


class Option(NamedTuple):
    """What one mesh axis does in a layer: the dim classes it shards (each value on its first dim of one of
    them) and ``fsdp``: parameters it shards no dim of are cut on their largest dim over it (ZeRO-3)."""

    classes: frozenset
    fsdp: bool = False


class Candidate(NamedTuple):
    layouts: tuple  # per class input, its ShardingSpec (None: a host value)
    options: tuple | None  # per mesh axis, an Option (None: an exhaustive candidate)


class Priced(NamedTuple):
    steps: tuple  # the replay's steps (forward, backward, gradient reductions), as the estimator reads them
    time: float  # seconds of one instance
    held: float  # bytes per device held until the backward pass: parameters, optimizer state, inputs, saved values
    transient: float  # bytes per device alive only while an instance runs
    inputs: tuple  # the layouts the instance was priced with (a steady state: what the previous one gives)
    outputs: tuple  # the layouts of its outputs
    late: float  # bytes per device held at the end of the backward pass: parameters, optimizer state, inputs and
    # the gradients, each summed into its parameter's layout when the backward pass completes it
    gradients: tuple  # per input, the layout of the gradient the backward pass hands back (None: none)


class ShardingPlan:
    """What ``nb.autoshard`` chose: ``specs`` (a pytree of ``ShardingSpec`` shaped like the arguments), ``report``
    (``nb.estimate``'s report of the chosen layout, with ``.baselines``: name -> report of each standard layout),
    ``memory`` (bytes per device the choice needs, optimizer state included), ``layouts`` (name -> the specs of
    each standard layout), ``apply(*args)``;
    ``print(plan)`` says what it chose per layer, in words, against each baseline."""

    def __init__(self, specs, tree, paths, report, baselines, memory, memory_limit, source, words, seconds,
                 assumed_optimizer, mesh, exact, same=(), compared=None):
        self.specs = specs
        self._tree, self.paths = tree, paths
        self.report = report
        self.baselines = baselines
        self.memory = memory
        self.memory_limit = memory_limit
        self.source = source  # "search" or the name of the baseline that was kept
        self._words = words
        self.seconds = seconds
        self.assumed_optimizer = assumed_optimizer
        self.mesh = mesh
        self.exact = exact  # every compared layout ran in full (else: the baselines are stitched from layers)
        self.same = tuple(same)  # the baselines whose layout is the one chosen
        self.compared = compared or report  # the chosen layout priced as the baselines were (stitched or in full)

    @property
    def step_time(self) -> float:
        return self.report.step_time

    def apply(self, *args: Any) -> Any:
        """``args`` laid out as chosen (a placed tensor moves with ``with_sharding``, an unplaced one is placed);
        one argument gives one result, several a tuple."""
        leaves, tree = flatten(args)
        specs, _ = flatten(self.specs)
        if len(leaves) != len(specs):
            raise ShardingError(f"autoshard: apply got {len(leaves)} argument leaves, the plan has {len(specs)} "
                                f"({', '.join(self.paths)})")
        out = []
        for x, s in zip(leaves, specs):
            if isinstance(x, Tensor) and s is not None:
                x = x.with_sharding(s) if x.sharding is not None else x.shard(s)
            out.append(x)
        res = unflatten(tree, out)
        return res[0] if len(args) == 1 else res

    def jax_shardings(self, jax_mesh: Any) -> Any:
        """The chosen layouts as ``jax.sharding.NamedSharding``s on ``jax_mesh`` (a ``jax.sharding.Mesh`` with this
        plan's axis names and sizes), shaped like the arguments: ``jax.jit(fn, in_shardings=plan.jax_shardings(m))``
        runs the JAX program as nabla planned it."""
        from jax.sharding import NamedSharding  # (only this method needs jax)
        sizes = dict(zip(getattr(jax_mesh, "axis_names", ()), getattr(jax_mesh, "axis_sizes", ())))
        want = dict(zip(self.mesh.axis_names, self.mesh.shape))
        if sizes != want:
            raise ShardingError(f"autoshard: jax_shardings needs a jax mesh with axes {want}, got {sizes}")
        leaves, tree = flatten(self.specs)
        closed = [ShardingSpec(s.mesh, [DimSpec(d.axes) for d in s.dim_specs]) for s in leaves]  # (no UNCONSTRAINED)
        return unflatten(tree, [NamedSharding(jax_mesh, s.to_partition_spec()) for s in closed])

    def __str__(self) -> str:
        gib = 2 ** 30
        how = ("searched" + (f" (the {' and '.join(self.same)} layout)" if self.same else "")
               if self.source == "search" else f"the {self.source} baseline (the search found nothing faster)")
        lines = [f"autoshard on {self.mesh!r}: {how}, in {self.seconds:.2f} s"]
        lines += [f"  {w}" for w in self._words]
        extra = f" (incl. {self.assumed_optimizer / gib:.2f} GiB of Adam state the program does not hold)" \
            if self.assumed_optimizer else ""
        lines.append(f"chosen: step {self.report.step_time * 1e3:.3f} ms, memory {self.memory / gib:.2f} GiB per "
                     f"device of {self.memory_limit / gib:.2f}{extra}")
        ref = self.compared.step_time
        how = "ran in full" if self.exact else (f"stitched from replayed layers, as is the choice: "
                                                f"{ref * 1e3:.3f} ms")
        lines.append(f"baselines ({how}):")
        for name, (rep, mem) in self.baselines.items():
            fits = "" if mem <= self.memory_limit else "  (over the limit)"
            lines.append(f"  vs {name:<16} step {rep.step_time * 1e3:>10.3f} ms ({rep.step_time / ref:.2f}x), "
                         f"memory {mem / gib:.2f} GiB{fits}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"ShardingPlan(step_time={self.step_time:.6g}, memory={self.memory}, source={self.source!r})"


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
    names = [_arg_name(f, i) for i in range(n)]
    if any(nm.startswith("args[") for nm in names):  # nb.grad / nb.value_and_grad: the function they wrap
        inner = next((c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                      if callable(c.cell_contents) and not isinstance(c.cell_contents, type)), None)
        if inner is not None:
            names = [_arg_name(inner, i) for i in range(n)]
    return names


def _mesh_of(leaves: Sequence, cluster: Cluster) -> DeviceMesh:
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
        s = ShardingSpec(mesh, spec)
    s.check_rank((0,) * rank, "autoshard", path)
    return s


def _leaves(args: tuple, fn: Callable, mesh: DeviceMesh, fixed: dict | None) -> tuple[list, list[Leaf], Any]:
    leaves, tree = flatten(args)
    names = _names(fn, len(args))
    paths = [p for a, nm in zip(args, names) for p in _paths(a, nm)]
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


def _given(mesh: DeviceMesh, leaf: Leaf) -> ShardingSpec:
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
    data: bool  # carries the batch (an activation, or an argument that is not a parameter)
    given: Any  # the layout it keeps when it is not free at all (None: a host value)


def _layout(mesh: DeviceMesh, slot: Slot, options: Sequence[Option]) -> Any:
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


def _all_layouts(mesh: DeviceMesh, slot: Slot) -> list:
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


def _options(cls: L.LayerClass, slots: Sequence[Slot]) -> list:
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


def _megatron(cls: L.LayerClass, slots: Sequence[Slot]) -> frozenset:
    """The set of batch-free classes that cuts the most parameter bytes (column- then row-parallel)."""
    data = {c for s in slots if s.data for c in s.classes}
    inner = sorted({c for s in slots if s.param for c, f in zip(s.classes, s.free) if f} - data)
    best, score = frozenset(), 0
    for cl in _cliques(inner, cls.compatible):
        sc = sum(prod(s.shape) * s.dtype.itemsize for s in slots if s.param and set(s.classes) & cl)
        if sc > score:
            best, score = cl, sc
    return best


def _batch(slots: Sequence[Slot]) -> tuple[frozenset, frozenset]:
    """(the class of the batch dim, of the sequence dim) of the first input that carries the batch."""
    for s in slots:
        if s.data and s.shape:
            return frozenset(s.classes[:1]), frozenset(s.classes[1:2]) if len(s.shape) >= 3 else frozenset()
    return frozenset(), frozenset()


def baseline_options(mesh: DeviceMesh, cls: L.LayerClass, slots: Sequence[Slot]) -> dict[str, tuple]:
    """The standard layouts as per-axis options: DP (the batch over every axis), FSDP (and the parameters cut
    over them), Megatron TP over the last axis with DP or FSDP over the others, and the same with the sequence
    of the batch-carrying inputs cut over the tp axis too (sequence parallelism)."""
    axes = [a for a in mesh.axis_names if mesh.axis_size(a) > 1]
    b, s = _batch(slots)
    tp = _megatron(cls, slots)
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


# ---- pricing ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=65536)
def _reshard_time(shape: tuple, itemsize: int, src: ShardingSpec, dst: ShardingSpec, cluster: Cluster) -> float:
    """A lower bound on the time to bring a value from ``src`` to ``dst``: the bytes no plan can beat
    (``reshard.lower_bound``) over the bandwidth of the slowest link the axes that change use."""
    if _key(src) == _key(dst):
        return 0.0
    try:
        nbytes = reshard.lower_bound(shape, itemsize, src, dst)
    except ShardingError:
        return 0.0
    a, b = _key(src), _key(dst)
    moved = {x for d in a[0] + b[0] for x in d} | set(a[1]) | set(b[1])
    moved -= {x for da, db in zip(a[0], b[0]) if da == db for x in da}
    tier = cluster.tier(src.mesh, sorted(moved)).kind if moved else "nvlink"
    latency, bandwidth = cluster.hardware.link("nvlink" if tier == "nvlink" else "network")
    return latency + nbytes / bandwidth


def _key(spec: Any) -> Any:
    """A layout as the blocks see it: axes per dim and partial axes (open or closed alike)."""
    if spec is None:
        return None
    return tuple(d.axes for d in spec.dim_specs), tuple(spec.partial_axes)


_strip = L.without_partial


class _Search:
    """Everything one autoshard call learns about the program."""

    def __init__(self, fn, cluster, args, memory_limit, fixed, overlap):
        self.fn, self.cluster, self.overlap = fn, cluster, overlap
        self.t0 = _time.perf_counter()
        leaves, _ = flatten(args)
        self.mesh = _mesh_of(leaves, cluster)
        self.leaves, self.info, self.tree = _leaves(args, fn, self.mesh, fixed)
        self.limit = float(cluster.hardware.hbm_bytes if memory_limit is None else memory_limit)
        self._prices: dict = {}
        self.refined: dict = {}  # (producer, its candidate, consumer, its candidate) -> Priced
        self.has_tp = False  # some class has parameters Megatron's cut applies to
        self.record()

    # -- the program --
    def abstract(self, specs: Sequence[Any]) -> tuple:
        out = [Tensor(None, s, x.shape, x.dtype) if isinstance(x, Tensor) else x for x, s in zip(self.leaves, specs)]
        return unflatten(self.tree, out)

    def record(self) -> None:
        mesh = self.mesh
        specs = []
        for x, lf in zip(self.leaves, self.info):
            if not isinstance(x, Tensor):
                specs.append(None)
            elif lf.fixed is not None:
                specs.append(lf.fixed)
            else:
                specs.append(ShardingSpec(mesh, [DimSpec(b, is_open=f) for b, f in zip(lf.base, lf.free)]))
        rec = L.Recorder(stop_at_backward=True)
        args = self.abstract(specs)
        self.serials = {}
        for i, x in enumerate(flatten(args)[0]):
            if isinstance(x, Tensor):
                self.serials[L.serial(x)] = i
        try:
            with C.recording(rec):
                self.fn(*args)
        except L.Stop:  # the forward program is all the search reads: the backward pass is replayed per layer
            pass
        self.tags = rec.tags
        fwd, self.train = L.forward_program(rec.steps, frozenset(self.serials))
        if not fwd:
            raise ShardingError("autoshard: the function ran no op; there is nothing to shard")
        self.segs = L.segments(fwd)
        self.classes = L.classes(self.segs, self.serials)
        self.params = {i for s, i in self.serials.items() if self.tags.get(s) == "params"}
        opt = [(s, k) for s, k in rec.tags.items() if k == "optimizer"]
        self.opt_ratio = self._optimizer_ratio(rec.steps, opt)
        self.first_reader = {}
        for s in fwd:
            for u in s.uses:
                if u.value in self.serials:
                    self.first_reader.setdefault(self.serials[u.value], s)

    def _optimizer_ratio(self, steps, opt) -> tuple[float, bool]:
        """Bytes of optimizer state per byte of parameter: as recorded, else mixed-precision Adam's (fp32 master
        copy and two moments: 12 bytes per 16-bit parameter, or two moments, 8 bytes, per 32-bit one)."""
        if not self.train:
            return 0.0, False
        if opt:
            sizes = {}
            for s in steps:
                sizes.setdefault(s.out, prod(s.out_shape) * s.out_dtype.itemsize)
                for u in s.uses:
                    if u.value:
                        sizes.setdefault(u.value, prod(u.shape) * u.dtype.itemsize)
            pbytes = sum(prod(self.info[i].shape) * np.dtype(self.info[i].dtype).itemsize for i in self.params)
            return sum(sizes.get(s, 0) for s, _ in opt) / max(1, pbytes), False
        items = [np.dtype(self.info[i].dtype).itemsize for i in self.params]
        item = max(items, default=4)
        return (12.0 / item if item <= 2 else 8.0 / item), True

    # -- slots and candidates --
    def slots(self, cls: L.LayerClass) -> list[Slot]:
        rep = cls.rep
        info = {}
        for s in rep.steps:
            for u in s.uses:
                if u.value:
                    info.setdefault(u.value, u)
        out = []
        for e, v in enumerate(rep.inputs):
            u = info[v]
            leaf = self.serials.get(v)
            lf = self.info[leaf] if leaf is not None else None
            param = cls.params[e] and leaf in self.params if self.train else cls.params[e]
            if lf is not None:
                base, free, used = lf.base, lf.free, lf.used
                given = _given(self.mesh, lf)
            elif u.src is None:
                base, free, used, given = ((),) * len(u.shape), (False,) * len(u.shape), frozenset(), None
            else:
                base, free, used = ((),) * len(u.shape), (True,) * len(u.shape), frozenset()
                given = _strip(u.src)
            data = not param and (u.src is not None or lf is not None) and bool(u.shape) and \
                np.dtype(u.dtype).kind in "fcV"
            if not self.train and lf is not None and cls.params[e]:
                data = self.first_reader.get(leaf) is rep.steps[0] and len(u.shape) >= 2
            out.append(Slot(tuple(u.shape), np.dtype(u.dtype) if (u.src is not None or lf is not None) else None,
                            cls.dims[e], base, free, used, param, data, given))
        return out

    def candidates(self, cls: L.LayerClass, slots: list[Slot]) -> tuple[list[Candidate], dict[str, int]]:
        """The layouts to price for one class (the standard layouts first), and each standard layout's index."""
        mesh = self.mesh
        cands: dict[tuple, Candidate] = {}
        base = baseline_options(mesh, cls, slots)
        if _megatron(cls, slots):
            self.has_tp = True
        named = {}
        for name, opts in base.items():
            lay = tuple(_layout(mesh, s, opts) for s in slots)
            cands.setdefault(lay, Candidate(lay, opts))
            named[name] = list(cands).index(lay)
        each = [_all_layouts(mesh, s) for s in slots]
        if len(cls.instances) == 1 and prod(len(e) for e in each) <= EXHAUSTIVE:
            for lay in product(*each):
                cands.setdefault(tuple(lay), Candidate(tuple(lay), None))
        else:
            opts = _options(cls, slots)
            live = [a for a in mesh.axis_names if mesh.axis_size(a) > 1]
            keep = {a: opts for a in live}
            if len(live) > 1 and len(opts) ** len(live) > SCREEN:
                keep = {a: self._screen(cls, slots, opts, a, [o[mesh.axis_names.index(a)] for o in base.values()])
                        for a in live}
            for choice in product(*(keep[a] for a in live)):
                full = iter(choice)
                per_axis = tuple(next(full) if a in live else None for a in mesh.axis_names)
                lay = tuple(_layout(mesh, s, per_axis) for s in slots)
                cands.setdefault(lay, Candidate(lay, per_axis))
        return list(cands.values()), named

    def _screen(self, cls: L.LayerClass, slots: list[Slot], opts: list, axis: str, given: list) -> list:
        """The options worth combining on ``axis``: each priced alone (the other axes doing nothing), the
        fastest few and the most frugal few kept, with those the standard layouts use."""
        mesh = self.mesh
        scored = []
        for o in opts:
            per_axis = tuple(o if a == axis else None for a in mesh.axis_names)
            lay = tuple(_layout(mesh, s, per_axis) for s in slots)
            p = self.price(cls, slots, Candidate(lay, per_axis))
            scored.append((p.time, p.held + p.transient, opts.index(o), o))
        fast = [o for *_, o in sorted(scored, key=lambda t: (t[0], t[1], t[2]))[:KEEP_FAST]]
        small = [o for *_, o in sorted(scored, key=lambda t: (t[1], t[0], t[2]))[:KEEP_SMALL]]
        return list(dict.fromkeys(fast + small + given))

    # -- pricing one class --
    def feeds(self, cls: L.LayerClass) -> dict[int, int]:
        """Inputs of ``cls`` that the previous instance's output ``j`` gives (the class repeats: a steady state)."""
        if len(cls.instances) < 2:
            return {}
        a, b = cls.instances[0], cls.instances[1]
        outs = {a.steps[k].out: j for j, k in enumerate(a.outputs)}
        return {e: outs[v] for e, v in enumerate(b.inputs) if v in outs}

    def price(self, cls: L.LayerClass, slots: list[Slot], cand: Candidate) -> Priced:
        key = (id(cls), cand.layouts)
        if key not in self._prices:
            self._prices[key] = self._price(cls, slots, cand)
        return self._prices[key]

    def _price(self, cls: L.LayerClass, slots: list[Slot], cand: Candidate, cotangents: list | None = None) -> Priced:
        shapes = [s.shape for s in slots]
        dtypes = [s.dtype if s.dtype is not None else np.float32 for s in slots]
        # differentiated: parameters, and values flowing in from other layers (in a repeated class, the first
        # instance's input may be an argument: the others' is the layer before's output)
        diff = [s.param or (not cls.params[e] and s.given is not None) or
                self.serials.get(cls.rep.inputs[e]) in self.params for e, s in enumerate(slots)]
        layouts = list(cand.layouts)
        params = [sl.param for sl in slots]
        cts = None if cotangents is None else list(cotangents)
        r = L.replay(cls, layouts, shapes, dtypes, diff, self.train, cts, params)
        feeds = self.feeds(cls)
        # a repeated layer's steady state: its input as the one before hands it over, its output's cotangent as
        # the next one's input gradient comes back (one more replay settles it; from a given cotangent, the
        # layers' backward passes may take a few to settle)
        for _ in range(1 if cotangents is None else 3):
            if not feeds:
                break
            new = [None] * len(r.outputs)
            for e, j in feeds.items():
                new[j] = r.gradients[e]
            now = cts if cts is not None else [_strip(o) for o in r.outputs]
            if all(_key(r.outputs[j]) == _key(layouts[e]) and (new[j] is None or _key(new[j]) == _key(now[j]))
                   for e, j in feeds.items()):
                break
            for e, j in feeds.items():
                layouts[e] = r.outputs[j]
            cts = new
            r = L.replay(cls, layouts, shapes, dtypes, diff, self.train, cts, params)
        steps = tuple(_priced(s) for s in r.steps)
        rep = estimate_steps(steps, self.cluster, self.mesh, self.overlap, memory=r.memory)
        opt = self.opt_ratio[0]
        held = params = 0.0
        for e, (s, lay) in enumerate(zip(slots, cand.layouts)):
            if s.dtype is None:
                continue
            b = L.block_bytes(lay, s.shape, s.dtype.itemsize)
            if s.param:
                params += b
            elif not s.data or cls.rep.inputs[e] in self.serials:
                held += b  # an argument the program reads (a batch, targets) stays all step (the values flowing
                # from layer to layer are counted where they are saved)
        by = r.memory.by_kind
        saved = max(by.get("activations", {}).values(), default=0)
        peak = max(r.memory.peak.values(), default=0)
        base = sum(max(by.get(k, {}).values(), default=0) for k in ("params", "grads", "activations"))
        # what the backward pass of this layer leaves behind: its parameters' gradients, each summed into the
        # parameter's layout as soon as the pass completes it (nb.grad finishes gradients as DDP/FSDP do, so one
        # layer's raw partial gradients never wait for the next layer's): one parameter's bytes again
        held += params * (1 + opt)
        late = held + params if self.train else held
        held += saved
        return Priced(steps, rep.step_time, held, max(0.0, peak - base), tuple(layouts), r.outputs, late, r.gradients)

    # -- the program as a MILP --
    def solve(self):
        where = self._producers()
        self.slot_of, self.cands, self.named, self.prices, self.fed = [], [], [], [], []
        for ci, cls in enumerate(self.classes):
            slots = self.slots(cls)
            fed = self._fed(ci, cls, where)
            if fed is None:
                cands, named = self.candidates(cls, slots)
                self.fed.append(None)
            else:
                cands, named, feeds = self._fed_candidates(cls, slots, *fed)
                self.fed.append((fed[0], feeds))
            self.slot_of.append(slots)
            self.cands.append(cands)
            self.named.append(named)
            self.prices.append([self.price(cls, slots, c) for c in cands])
        groups = []
        for cls, prices in zip(self.classes, self.prices):
            n = len(cls.instances)
            groups.append(milp.Group([p.time * n for p in prices], [p.held * n for p in prices],
                                     [p.transient for p in prices], [p.late * n for p in prices]))
        self.groups = groups
        self.edges = self._edges()
        self.priced_seconds = _time.perf_counter() - self.t0

    def refine(self, choice: Sequence[int]) -> bool:
        """Price each repeated class of ``choice`` that feeds another from the gradient that one hands back (a
        layer's backward pass starts from what the next class's gives it, not from its own steady state); the
        difference goes on the MILP's edge between the two. Whether anything new was priced."""
        changed = False
        for cj, fed in enumerate(self.fed):
            if fed is None or len(self.classes[fed[0]].instances) < 2:
                continue
            ci, (a, b) = fed[0], (choice[fed[0]], choice[cj])
            if (ci, a, cj, b) in self.refined:
                continue
            _, js = self._fed(cj, self.classes[cj], self._producers())
            back = self.prices[cj][b].gradients
            cts = [None] * len(self.prices[ci][a].outputs)
            for e, j in js.items():
                cts[j] = back[e]
            p = self._price(self.classes[ci], self.slot_of[ci], self.cands[ci][a], cts)
            self.refined[(ci, a, cj, b)] = p
            edge = next(k for k, ed in enumerate(self.edges) if (ed.a, ed.b) == (ci, cj))
            self.edges[edge].cost[a, b] += len(self.classes[ci].instances) * (p.time - self.prices[ci][a].time)
            changed = True
        return changed

    def part(self, choice: Sequence[int], ci: int) -> Priced:
        """Class ``ci``'s pricing under ``choice`` (refined where its consumer's gradient was taken into account)."""
        for cj, fed in enumerate(self.fed):
            if fed is not None and fed[0] == ci and (ci, choice[ci], cj, choice[cj]) in self.refined:
                return self.refined[(ci, choice[ci], cj, choice[cj])]
        return self.prices[ci][choice[ci]]

    def _producers(self) -> dict[int, tuple[int, int]]:
        """Serial -> (class, output) of the segment that makes it."""
        where = {}
        for ci, cls in enumerate(self.classes):
            for inst in cls.instances:
                for j, k in enumerate(inst.outputs):
                    where[inst.steps[k].out] = (ci, j)
        return where

    def _fed(self, ci: int, cls: L.LayerClass, where: dict) -> tuple[int, dict[int, int]] | None:
        """(the earlier class, input -> its output) when every activation flowing into ``cls`` comes from one
        earlier class: then ``cls`` is priced as that class's outputs reach it, not as it would like them."""
        src, feeds = None, {}
        for inst in cls.instances:
            for e, v in enumerate(inst.inputs):
                if v in self.serials or v not in where or where[v][0] == ci:
                    continue
                pa, j = where[v]
                if pa > ci or src not in (None, pa) or feeds.get(e, j) != j:
                    return None
                src, feeds[e] = pa, j
        return (src, feeds) if src is not None else None

    def _fed_candidates(self, cls: L.LayerClass, slots: list[Slot], pa: int, js: dict[int, int]):
        """The candidates of a class fed by class ``pa``: for each layout that class's candidates hand over, this
        class's own choices with its activations laid out so. Also per candidate, the layout it is fed."""
        by_feed: dict[tuple, dict] = {}
        ranked = sorted(range(len(self.prices[pa])), key=lambda a: self.prices[pa][a].time)
        wanted = set(self.named[pa].values())
        for a in ranked:  # the layouts the fastest producers hand over, and the standard layouts'
            p = self.prices[pa][a]
            lay = {e: p.outputs[j] for e, j in js.items()}
            key = tuple(_key(lay[e]) for e in sorted(lay))
            if key in by_feed or (len(by_feed) >= FEEDS and a not in wanted):
                continue
            by_feed[key] = lay
        cands, feeds, named_by = [], [], {}
        for key, lay in by_feed.items():
            fslots = [sl._replace(free=(False,) * len(sl.shape), given=lay[e]) if e in lay else sl
                      for e, sl in enumerate(slots)]
            c, nm = self.candidates(cls, fslots)
            named_by[key] = {n: len(cands) + i for n, i in nm.items()}
            cands += c
            feeds += [key] * len(c)
        named = {}
        for n, a in self.named[pa].items():
            p = self.prices[pa][a]
            key = tuple(_key(p.outputs[js[e]]) for e in sorted(js))
            if n in named_by.get(key, {}):
                named[n] = named_by[key][n]
        return cands, named, feeds

    def _edges(self) -> list[milp.Edge]:
        where = {}  # serial -> (class index, output index) of the segment that makes it
        seg_class = {}
        for ci, cls in enumerate(self.classes):
            for inst in cls.instances:
                seg_class[id(inst)] = ci
                for j, k in enumerate(inst.outputs):
                    where[inst.steps[k].out] = (ci, j, inst.steps[k])
        costs: dict[tuple, np.ndarray] = {}
        big = 10.0 * sum(max(g.time) for g in self.groups) + 1.0
        for ci, fed in enumerate(self.fed):  # a fed class's candidate takes only what its producer hands over
            if fed is not None:
                pa, feeds = fed
                _, js = self._fed(ci, self.classes[ci], self._producers())
                given = [tuple(_key(p.outputs[js[e]]) for e in sorted(js)) for p in self.prices[pa]]
                costs[(pa, ci)] = np.array([[0.0 if g == f else big for f in feeds] for g in given])
        for ci, cls in enumerate(self.classes):
            for inst in cls.instances:
                for e, v in enumerate(inst.inputs):
                    if v not in where or where[v][0] == ci:
                        continue
                    if self.fed[ci] is not None and where[v][0] == self.fed[ci][0]:
                        continue
                    pa, j, st = where[v]
                    shape, item = st.out_shape, st.out_dtype.itemsize
                    src = [p.outputs[j] for p in self.prices[pa]]
                    dst = [p.inputs[e] for p in self.prices[ci]]
                    m = np.zeros((len(src), len(dst)))
                    for a, s in enumerate(src):
                        for b, d in enumerate(dst):
                            if s is None or d is None:
                                continue
                            t = _reshard_time(shape, item, s, _strip(d), self.cluster)
                            if self.train:
                                t += _reshard_time(shape, item, _strip(d), _strip(s), self.cluster)
                            m[a, b] = t
                    key = (pa, ci)
                    costs[key] = costs.get(key, 0) + m
        fed = {(f[0], ci) for ci, f in enumerate(self.fed) if f is not None}
        return [milp.Edge(a, b, np.array(m, dtype=float)) for (a, b), m in costs.items() if np.any(m) or (a, b) in fed]

    def realize(self, choice: Sequence[int]) -> list:
        """Per leaf, its spec under ``choice`` (a candidate per class; the first class that reads a leaf sets it)."""
        specs: list = [None] * len(self.leaves)
        for ci, cls in enumerate(self.classes):
            cand = self.cands[ci][choice[ci]]
            for inst in cls.instances:
                for e, v in enumerate(inst.inputs):
                    i = self.serials.get(v)
                    if i is not None and specs[i] is None and cand.layouts[e] is not None:
                        specs[i] = _strip(cand.layouts[e])
        for i, (x, lf) in enumerate(zip(self.leaves, self.info)):
            if isinstance(x, Tensor) and specs[i] is None:
                specs[i] = _given(self.mesh, lf)
            if lf.fixed is not None:
                specs[i] = lf.fixed
        return specs

    def measure(self, specs: Sequence[Any]) -> tuple[Report, float, float]:
        """The real estimate of ``specs``; memory per device including optimizer state the program lacks."""
        rep = estimate(self.fn, self.cluster, self.overlap)(*self.abstract(specs))
        peak = max(rep.memory.peak.values(), default=0)
        extra = self.assumed(specs)
        return rep, peak + extra, extra

    def assumed(self, specs: Sequence[Any]) -> float:
        """Bytes per device of the optimizer state the program does not hold (mixed-precision Adam's)."""
        ratio, assumed = self.opt_ratio
        if not assumed:
            return 0.0
        return sum(L.block_bytes(specs[i], self.info[i].shape, np.dtype(self.info[i].dtype).itemsize)
                   for i in self.params) * ratio

    def stitched(self, choice: Sequence[int]) -> tuple[Report, float, float]:
        """The estimate of ``choice`` from the replayed layers laid end to end as the program runs them: every
        segment's forward steps, then their backward steps in reverse, then the gradient reductions; memory as
        the model counts it (held values of every segment, plus the largest transient)."""
        order = [(ci, inst) for inst in self.segs for ci, cls in enumerate(self.classes) if inst in cls.instances]
        self.refine(choice)
        parts = {ci: self.part(choice, ci) for ci in range(len(self.classes))}
        fwd, bwd, fin = [], [], []
        for ci, _ in order:
            st = parts[ci].steps
            fwd.append([x for x in st if x.phase != "backward"])
            bwd.append([x for x in st if x.phase == "backward" and not str(x.user).startswith("grad of")])
            fin.append([x for x in st if x.phase == "backward" and str(x.user).startswith("grad of")])
        steps = [x for f in fwd for x in f] + [x for b in reversed(bwd) for x in b] + [x for f in fin for x in f]
        t, mem = milp.evaluate(self.groups, self.edges, choice)
        extra = self.assumed(self.realize(choice))
        held = sum(parts[ci].held * len(self.classes[ci].instances) for ci in parts)
        top = max((p.transient for p in parts.values()), default=0.0)
        record = _Modelled({d: int(mem) for d in self.mesh.devices},
                           {"held (parameters, gradients, optimizer, saved values)": {d: int(held) for d in self.mesh.devices},
                            "temporaries": {d: int(top) for d in self.mesh.devices}})
        rep = estimate_steps(steps, self.cluster, self.mesh, self.overlap, memory=record)
        return rep, mem, extra


class _Modelled(NamedTuple):
    """A memory record the model made (not ``nb.memory_log``'s): what a stitched estimate reports."""

    peak: dict
    by_kind: dict


#: stitched estimates within this fraction of the best are told apart by running both in full
CLOSE = 0.03
#: a forward program of at most this many steps is priced by running it (every layout compared runs the real
#: estimator); a larger one by its replayed layers laid end to end, and only the choice runs in full
EXACT_STEPS = 600


class _Tried(NamedTuple):
    name: str
    choice: tuple
    specs: list
    report: Report
    memory: float  # bytes per device (optimizer state the program lacks included)
    extra: float


def autoshard(fn: Callable, cluster: Cluster, *args: Any, memory_limit: float | None = None,
              fixed: dict | None = None, overlap: str = "grads") -> ShardingPlan:
    """The shardings of ``args`` for which ``nb.estimate(fn, cluster, overlap)`` gives the least step time within
    ``memory_limit`` bytes per device (default: the device's HBM), ties toward less memory.

    ``args`` are tensors (or ``nb.abstract`` ones) on a mesh made by ``cluster.mesh(...)``: closed dims are kept,
    open dims (``nb.DimSpec([], is_open=True)``) and unplaced tensors are chosen. ``fixed`` maps argument paths
    (``"x"``, ``"p['w1']"``) to specs to keep. Memory counts what the program holds plus, for a training step
    without an optimizer, mixed-precision Adam's state (16 bytes per parameter with its bf16 copy and gradient).
    Never slower than the standard layouts (DP, FSDP, Megatron TP x DP or x FSDP, with sequence parallelism):
    each is priced, and kept when the search does not beat it. An infeasible limit raises ``ShardingError``
    naming the least memory any layout reaches and what dominates it."""
    if not isinstance(cluster, Cluster):
        raise ShardingError(f"autoshard: cluster must be an nb.Cluster, got {type(cluster).__name__}")
    if overlap not in ("none", "grads"):
        raise ShardingError(f"autoshard: overlap must be 'none' or 'grads', got {overlap!r}")
    if memory_limit is not None and (not isinstance(memory_limit, (int, float)) or memory_limit <= 0):
        raise ShardingError(f"autoshard: memory_limit must be a number of bytes > 0, got {memory_limit!r}")
    s = _Search(fn, cluster, args, memory_limit, fixed, overlap)
    s.solve()
    exact = sum(len(seg.steps) for seg in s.segs) <= EXACT_STEPS
    tried: dict[tuple, _Tried] = {}

    def price(name: str, choice: Sequence[int]) -> _Tried:
        specs = s.realize(choice)
        key = tuple(specs)
        if key not in tried:
            rep, mem, extra = s.measure(specs) if exact else s.stitched(choice)
            tried[key] = _Tried(name, tuple(choice), specs, rep, mem, extra)
        return tried[key]

    baselines = {}
    for name in s.named[0]:
        if all(name in nm for nm in s.named) and (s.has_tp or not name.startswith("TP")):
            baselines[name] = price(name, [nm[name] for nm in s.named])
    found, limit, excluded, loosened = [], s.limit, [], False
    for _ in range(12):  # the model's memory is checked by the estimate: tightened where it fell short, loosened
        # once where it was cautious (the choice's estimate needed less than the model said); a choice whose
        # layers' backward passes were priced from their own gradients is priced again from its consumer's
        sol = milp.solve(s.groups, s.edges, limit, excluded)
        if sol is not None and s.refine(sol.choice):
            continue
        if sol is None or any(f.choice == sol.choice for f in found):
            break
        t = price("search", sol.choice)
        found.append(t._replace(choice=sol.choice))
        if t.memory > s.limit:
            excluded.append(sol.choice)
            limit = limit * s.limit / t.memory
        elif not loosened and np.isfinite(limit) and t.memory < 0.97 * sol.memory:
            loosened, limit = True, limit * sol.memory / max(t.memory, 1.0)
        else:
            break
    fits = sorted((t for t in found + list(baselines.values()) if t.memory <= s.limit),
                  key=lambda t: (t.report.step_time, t.memory, t.name != "search"))
    ran: list = []

    def in_full(t: _Tried) -> _Tried | None:
        """``t`` run through the estimator (as priced, when every layout ran in full), once; itself if it fits."""
        for r in ran:
            if r.specs == t.specs:
                return r if r.memory <= s.limit else None
        rep, mem, extra = (t.report, t.memory, t.extra) if exact else s.measure(t.specs)
        ran.append(t._replace(report=rep, memory=mem, extra=extra, choice=()))
        return ran[-1] if mem <= s.limit else None

    chosen, short = None, 1.0
    for t in fits[:3]:  # run the winner in full (a stitched estimate is checked), the next if it does not fit;
        # where the model fell short, the others are taken as short by as much
        if t.memory * short > s.limit:
            continue
        chosen = in_full(t)
        if chosen is not None:
            break
        short = max(short, ran[-1].memory / max(t.memory, 1.0))
    pool = fits + sorted((t for t in baselines.values() if all(t is not f for f in fits)),
                         key=lambda t: t.report.step_time)
    if chosen is None:  # the model can err either way: the others that fit by it, then the standard layouts
        chosen = next((c for c in map(in_full, pool) if c is not None), None)
    if chosen is None:  # the least memory: as the model counts it where nothing fits by it, else as run in full
        least = [price("the least-memory layout", milp.least_memory(s.groups, s.edges).choice)] + found + \
            list(baselines.values()) if not fits else ran
        raise ShardingError(_infeasible(s, min(least, key=lambda t: t.memory)))
    if not exact:  # a close second (stitched estimates err by a few percent) runs in full too: the faster wins
        ahead = next(t for t in pool if t.specs == chosen.specs).report.step_time
        close = [t for t in fits if t.specs != chosen.specs and t.report.step_time <= ahead * (1 + CLOSE)
                 and all(r.specs != t.specs for r in ran)]
        second = in_full(close[0]) if close else None
        if second is not None and (second.report.step_time, second.memory) < (chosen.report.step_time, chosen.memory):
            chosen = second
    source = "search" if any(f.specs == chosen.specs for f in found) else chosen.name
    same = [n for n, t in baselines.items() if t.specs == chosen.specs]
    compared = next(t for t in pool if t.specs == chosen.specs).report  # as the baselines were priced
    report = _with_baselines(chosen.report, {n: t.report for n, t in baselines.items()})
    words = _words(s, chosen.specs, chosen.report)
    out_specs = unflatten(s.tree, [sp if isinstance(x, Tensor) else None for x, sp in zip(s.leaves, chosen.specs)])
    plan = ShardingPlan(out_specs, s.tree, [lf.path for lf in s.info], report,
                        {n: (t.report, t.memory) for n, t in baselines.items()}, chosen.memory, s.limit, source,
                        words, _time.perf_counter() - s.t0, chosen.extra, s.mesh, exact, same, compared)
    plan.layouts = {n: unflatten(s.tree, [sp if isinstance(x, Tensor) else None for x, sp in zip(s.leaves, t.specs)])
                    for n, t in baselines.items()}
    return plan


def _with_baselines(rep: Report, baselines: dict) -> Report:
    object.__setattr__(rep, "baselines", baselines)
    return rep


def _who(cls: L.LayerClass) -> str:
    labels = [i.label or "-" for i in cls.instances]
    return labels[0] if len(labels) == 1 else f"{labels[0]} .. {labels[-1]} ({len(labels)} alike)"


def _infeasible(s: _Search, best: _Tried) -> str:
    """What the least memory is, where it goes (by kind, per layer class) and the largest argument blocks."""
    gib = 2 ** 30
    by = {k: max(v.values(), default=0) for k, v in best.report.memory.by_kind.items()}
    if best.extra:
        by["optimizer state (Adam, assumed)"] = best.extra
    if best.choice:
        mult = 1.0 + s.opt_ratio[0]
        per = []
        for ci, cls in enumerate(s.classes):
            p, n = s.prices[ci][best.choice[ci]], len(cls.instances)
            lay = s.cands[ci][best.choice[ci]].layouts
            w = sum(L.block_bytes(l, sl.shape, sl.dtype.itemsize) * mult
                    for sl, l in zip(s.slot_of[ci], lay) if sl.param and sl.dtype is not None)
            who = _who(cls)
            per += [(n * w, f"parameters and optimizer state of {who}"),
                    (n * (p.held - w), f"values saved for the backward pass in {who}"),
                    (n * (p.late - w), f"gradients of {who} (laid out as their parameters)"),
                    (p.transient, f"temporaries while one instance of {who} runs")]
        by = {k: v for v, k in per}
    kinds = sorted(by.items(), key=lambda kv: -kv[1])[:3]
    big = sorted(((L.block_bytes(sp, s.info[i].shape, np.dtype(s.info[i].dtype).itemsize), s.info[i].path)
                  for i, sp in enumerate(best.specs) if sp is not None), reverse=True)[:3]
    return (f"autoshard: no layout fits in {s.limit / gib:.2f} GiB per device; the least memory any layout reaches "
            f"is {best.memory / gib:.2f} GiB per device ({best.name}), dominated by "
            + ", ".join(f"{k}: {v / gib:.2f} GiB" for k, v in kinds)
            + "; the largest argument blocks per device: " + ", ".join(f"{p} {b / gib:.3f} GiB" for b, p in big))


# ---- in words ---------------------------------------------------------------------------------------------


def _describe(spec: ShardingSpec, shape: tuple, batch_axes: set, seq_axes: set = frozenset()) -> str:
    """A parameter's layout in words: FSDP where its axis also cuts the batch, column/row-parallel otherwise."""
    if spec is None:
        return "on the host"
    cut = [(d, ax) for d, ds in enumerate(spec.dim_specs) for ax in ds.axes]
    if not cut:
        return "replicated"
    parts = []
    for d, ax in cut:
        if ax in batch_axes:
            parts.append(f"sharded over {ax} (FSDP: gathered for use)")
        elif len(shape) == 2:
            seq = f" (the sequence cut over {ax} too)" if ax in seq_axes else ""
            parts.append(f"{'column' if d == 1 else 'row'}-parallel over {ax}{seq}")
        else:
            parts.append(f"dim {d} over {ax}")
    return ", ".join(parts)


def _words(s: _Search, specs: Sequence[Any], rep: Report) -> list[str]:
    """Per layer class: each parameter's layout, the batch-carrying inputs', and how gradients are reduced."""
    grads = _grad_moves(rep, s)
    lines = []
    for ci, cls in enumerate(s.classes):
        inst = cls.instances
        slots = s.slot_of[ci]
        labels = [i.label or "-" for i in inst]
        who = _who(cls)
        batch_axes: set = set()
        seq_axes: set = set()
        acts = []
        for e, sl in enumerate(slots):
            if not sl.data:
                continue
            i = s.serials.get(inst[0].inputs[e])
            lay = _strip(specs[i] if i is not None else s.prices[ci][0].inputs[e])
            for d, ds in enumerate(lay.dim_specs if lay is not None else ()):
                for ax in ds.axes:
                    (batch_axes if d == 0 else seq_axes).add(ax)
                    acts.append(f"{'batch' if d == 0 else 'sequence' if d == 1 else f'dim {d}'}-sharded over {ax}")
        ws, kinds = [], set()
        for e, sl in enumerate(slots):
            i = s.serials.get(inst[0].inputs[e])
            if not sl.param or i is None:
                continue
            path = s.info[i].path
            name = path.rsplit("[", 1)[-1].strip("]'\"") if "[" in path else path
            ws.append(f"{name} {_describe(specs[i], sl.shape, batch_axes, seq_axes)}")
            for j in inst:
                k = s.serials.get(j.inputs[e])
                if k is not None:
                    kinds |= grads.get(s.info[k].path, set())
        text = f"{who}: " + ("; ".join(ws) if ws else "no parameters")
        text += "; activations " + (", ".join(dict.fromkeys(acts)) if acts else "replicated")
        if kinds:
            text += "; gradients " + " and ".join(_VERB.get(k, k) for k in sorted(kinds))
        inside = _backward_moves(rep, set(labels))
        if inside:
            text += "; backward: " + ", ".join(f"{k} x{n}" for k, n in sorted(inside.items()))
        lines.append(text)
    return lines


_VERB = {"all_reduce": "summed over the batch (all_reduce)", "reduce_scatter": "reduce-scattered to their shards",
         "all_gather": "gathered",
         "all_to_all": "exchanged (all_to_all)", "collective_permute": "permuted"}


def _backward_moves(rep: Report, labels: set) -> dict[str, int]:
    """Collective kind -> how many the backward steps of the layers ``labels`` run (one layer's worth)."""
    phase = {c.index: c.phase for c in rep.timeline.costs}
    counts: dict[str, int] = {}
    for iv in rep.timeline.intervals:
        if iv.stream == "comm" and (iv.layer or "-") in labels and phase.get(iv.step) == "backward" \
                and not str(iv.user).startswith("grad of"):
            counts[iv.name] = counts.get(iv.name, 0) + 1
    return {k: max(1, n // len(labels)) for k, n in counts.items()}


def _grad_moves(rep: Report, s: _Search) -> dict[str, set]:
    """Parameter path -> the collectives and axes of its gradient's reduction in the chosen layout's estimate."""
    out: dict[str, set] = {}
    for iv in rep.timeline.intervals:
        user = str(iv.user)
        if iv.stream == "comm" and user.startswith("grad of "):
            out.setdefault(user[len("grad of "):], set()).add(iv.name)
    return out
