"""``nb.jit``: nabla plans, XLA runs. A function is traced once per input signature (on data-free twins of
its arguments, so planning costs no compute), and the trace (every op's program: reshard plans, local
steps, kernel) is replayed inside ``jax.shard_map`` over a jax mesh with one axis per mesh atom: kernels in
``jax.numpy`` on each device's block, each planned collective as its ``jax.lax`` twin. Nothing is
re-planned, so the compiled program moves what the comm log says. Needs jax (``nabla-spmd[jax]``)."""

from __future__ import annotations

import contextlib
import functools
from math import prod
from typing import Any, Callable

import numpy as np

from . import backends, reshard, storage
from . import collectives as C
from .autodiff import flatten, unflatten
from .errors import ShardingError
from .executor import Local, Value
from .layout import chunk, chunks, grid, merge_cuts, spec_cuts
from .mesh import AxisRef, DeviceMesh
from .spec import ShardingSpec
from .tensor import Tensor
from .shard_map import SM_IN, SM_OUT, ManualSpec
from .trace import LEAF, LEAF_NODE, PLACE, RELAYOUT, topological, whole


def jit(fn: Callable) -> "Jitted":
    """Compile ``fn`` (called with tensors, or pytrees of them) through shard_map and jax.jit."""
    return Jitted(fn)


class Jitted:
    """``nb.jit(fn)``: call it like ``fn``; ``.lower(*args)`` gives the compiled program and its comm log."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._cache: dict = {}
        functools.update_wrapper(self, fn)

    def lower(self, *args: Any) -> "Lowered":
        leaves, tree = flatten(args)
        key = (tree, tuple(_signature(x) for x in leaves))
        if key not in self._cache:
            self._cache[key] = Lowered(self.fn, leaves, tree)
        lowered = self._cache[key]
        lowered._example = args
        return lowered

    def __call__(self, *args: Any) -> Any:
        return self.lower(*args)(*args)


def _signature(x: Any) -> Any:
    if isinstance(x, Tensor):
        return ("t", x.shape, x.dtype.str, x.sharding)
    try:
        hash(x)
    except TypeError:
        raise ShardingError(f"jit: arguments must be tensors or hashable constants, got {type(x).__name__}") from None
    return ("c", type(x), x)


class Lowered:
    """One trace of ``fn`` and its compiled program: ``comm_log`` (nabla's planned collectives), ``as_text()``
    (the compiled HLO), and calling it runs the program on jax devices."""

    def __init__(self, fn: Callable, leaves: list, tree: Any) -> None:
        import jax
        backends.get("jax")  # jax arrays inside the trace are seen as jax's
        self._jax = jax
        twins = []
        for x in leaves:
            if isinstance(x, Tensor):
                t = Tensor(None, x.sharding, x.shape, x.dtype)
                t._node = LEAF_NODE
                twins.append(t)
            else:
                twins.append(x)
        with whole(), C.comm_log() as log:
            out = fn(*unflatten(tree, twins))
        self.comm_log = log
        outs, self._out_tree = flatten(out)
        for o in outs:
            if not isinstance(o, Tensor):
                raise ShardingError(f"jit: the function must return tensors (or pytrees of them), got "
                                    f"{type(o).__name__}")
        self._inputs = [i for i, x in enumerate(twins) if isinstance(x, Tensor)]
        self._program = _Program(twins, outs)
        self._compiled = None

    def _arrays(self, args: tuple) -> list:
        leaves, _ = flatten(args)
        return self._program.inputs([leaves[i] for i in self._inputs])

    def compiled(self, args: tuple):
        with _x64():
            arrays = self._arrays(args)
            if self._compiled is None:
                self._compiled = self._program.jitted().lower(*arrays).compile()
        return self._compiled, arrays

    def as_text(self, *args: Any) -> str:
        """The compiled HLO (for the arguments this was lowered with, or ``args``)."""
        return self.compiled(args or self._example)[0].as_text()

    def __call__(self, *args: Any) -> Any:
        fn, arrays = self.compiled(args)
        with _x64():
            outs = fn(*arrays)
        return unflatten(self._out_tree, self._program.outputs(outs))


@contextlib.contextmanager
def _x64():
    """numpy's dtypes on jax: float64 and int64 stay 64-bit while compiling and running (restored after)."""
    be = backends.get("jax")
    token = be.enter()
    try:
        yield
    finally:
        be.leave(token)


# ---- the per-device program ---------------------------------------------------------------------------


class _Program:
    """The trace turned into one function of every device's blocks, run under shard_map."""

    def __init__(self, twins: list, outs: list) -> None:
        self.twins = [t for t in twins if isinstance(t, Tensor)]
        self.outs = outs
        self.order = topological(outs)
        self.consts: list[tuple[Any, Any]] = []  # (value, spec it is placed with): extra inputs
        self._const_index: dict = {}
        mesh = self._mesh()
        self.mesh = mesh
        specs = [t.sharding for t in self.twins + self.outs if t.sharding is not None]
        for v in self.order:
            node = v._node
            specs.append(v.sharding)
            if node.op in (RELAYOUT, PLACE, SM_IN, SM_OUT):
                specs.append(node.params[0])
            elif node.op != LEAF and node.prog is not None and node.prog != "manual":
                prog = node.prog
                specs += [p.target for p in prog.preps if p.target is not None] + [prog.kspec, prog.result]
        cuts = merge_cuts(*(spec_cuts(s) for s in specs if isinstance(s, ShardingSpec)))
        if cuts is None:
            raise ShardingError("jit: the sub-axes this function uses do not nest into one jax mesh")
        self.cuts = cuts
        atoms = []
        for name, n, c in zip(mesh.axis_names, mesh.shape, cuts):
            pts = sorted(set(c) | {1, n})
            atoms += [AxisRef(name, a, b // a, n) for a, b in zip(pts, pts[1:])]
        self.atoms = tuple(atoms)
        from .backends.jax import atom_mesh, atom_name
        self.jmesh = atom_mesh(mesh, self.atoms)
        self.names = tuple(atom_name(a) for a in self.atoms)
        self.body = _Body(self)  # finds the constants, which become inputs after the arguments

    def _mesh(self) -> DeviceMesh:
        meshes = {t.sharding.mesh for t in self.twins + self.outs if t.sharding is not None}
        for v in self.order:
            if v.sharding is not None:
                meshes.add(v.sharding.mesh)
        if len(meshes) != 1:
            raise ShardingError(f"jit: the function must use exactly one mesh, it uses {len(meshes)}")
        return meshes.pop()

    # -- layout of blocks as jax arrays --
    def pspec(self, spec: ShardingSpec | None, rank: int):
        from jax.sharding import PartitionSpec
        if spec is None:  # a host value: every device holds all of it
            return PartitionSpec(*([None] * (len(self.atoms) + rank)))
        g = grid(spec, self.cuts)
        return PartitionSpec(*[n if s > 1 else None for n, s in zip(self.names, g.shape)], *([None] * rank))

    def global_array(self, v: Value, spec: ShardingSpec | None):
        """A tensor's stored blocks as the jax global array shard_map splits over the atoms."""
        if spec is None:
            data = np.asarray(v._data)
            return data.reshape((1,) * len(self.atoms) + data.shape)
        data = v._data
        if data is None:
            raise ShardingError("jit: an abstract tensor (nb.abstract) cannot be run; call .lower(...) to plan only")
        g = grid(spec, self.cuts)
        return data.reshape(g.shape + data.shape[len(grid(spec).shape):])

    def const(self, value: Any, spec: ShardingSpec | None) -> int:
        key = (id(value), spec)
        if key not in self._const_index:
            self._const_index[key] = len(self.consts)
            self.consts.append((value, spec))
        return self._const_index[key]

    def inputs(self, leaves: list) -> list:
        import jax
        from jax.sharding import NamedSharding
        arrays = []
        for t, x in zip(self.twins, leaves):
            if not isinstance(x, Tensor) or x.sharding != t.sharding or x.shape != t.shape:
                raise ShardingError(f"jit: expected a tensor of shape {t.shape} laid out {t.sharding!r}")
            target = NamedSharding(self.jmesh, self.pspec(x.sharding, x.ndim))
            arr = self.global_array(x, x.sharding)
            if isinstance(arr, jax.Array) and arr.sharding.is_equivalent_to(target, arr.ndim):
                arrays.append(arr)  # already on its devices (e.g. loaded per process)
            else:
                arrays.append(jax.device_put(arr, target))
        for value, spec in self.consts:
            arrays.append(jax.device_put(self.global_array(value, spec),
                                         NamedSharding(self.jmesh, self.pspec(spec, len(value._shape)))))
        return arrays

    def outputs(self, arrays) -> list:
        out = []
        for o, a in zip(self.outs, arrays):
            if o.sharding is None:
                out.append(Tensor(np.asarray(a).reshape(o.shape), None, o.shape, o.dtype))
                continue
            g = grid(o.sharding)
            out.append(Tensor(a.reshape(g.shape + a.shape[len(self.atoms):]), o.sharding, o.shape, o.dtype))
        return out

    def jitted(self):
        import jax
        in_specs = tuple([self.pspec(t.sharding, t.ndim) for t in self.twins] +
                         [self.pspec(spec, len(v._shape)) for v, spec in self.consts])
        out_specs = tuple(self.pspec(o.sharding, o.ndim) for o in self.outs)
        fn = jax.shard_map(self.body, mesh=self.jmesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)
        return jax.jit(fn)


class _Device:
    """What a lowering needs about the device it runs on: coordinates along any (sub-)axis, its mesh position,
    and ppermute between mesh positions."""

    def __init__(self, prog: _Program) -> None:
        import jax
        self.lax = jax.lax
        self.xp = jax.numpy
        self.prog = prog
        self.mesh = prog.mesh

    def axis_names(self, refs) -> tuple[str, ...]:
        """The jax mesh axes (atoms) that make up ``refs``, major to minor."""
        out = []
        for r in refs:
            for a, n in zip(self.prog.atoms, self.prog.names):
                if a.name == r.name and r.pre <= a.pre and a.pre * a.size <= r.pre * r.size:
                    out.append(n)
        return tuple(out)

    def linear(self, refs):
        """This device's position along ``refs`` (mixed radix, major first)."""
        names = self.axis_names(refs)
        return self.lax.axis_index(names) if names else 0

    def position(self):
        return self.lax.axis_index(self.prog.names) if self.prog.names else 0

    def pairs(self, fn: Callable[[int], int | None], refs) -> list[tuple[int, int]]:
        """(source, target) mesh positions: each device sends to the one whose position along ``refs`` is
        ``fn`` of its own, all else equal (targets outside the axis are dropped)."""
        mesh = self.mesh
        k = prod(r.size for r in refs)
        out = []
        for u, d in enumerate(mesh.devices):
            coords = list(mesh.coords(d))
            q = 0
            for r in refs:
                q = q * r.size + r.coord(coords[mesh.axis_index(r.name)])
            t = fn(q)
            if t is None or not 0 <= t < k:
                continue
            new = list(coords)
            rest = t
            for r in reversed(refs):
                digit = rest % r.size
                rest //= r.size
                i = mesh.axis_index(r.name)
                new[i] += (digit - r.coord(new[i])) * r.minor
            out.append((u, mesh.devices.index(mesh.device_at(new))))
        return out

    def ppermute(self, x, pairs):
        """Device ``u`` sends ``x`` to ``v`` for each pair; a device no one sends to receives zeros."""
        if not self.prog.names:
            return x
        return self.lax.ppermute(x, self.prog.names, perm=pairs)


def _fit(xp, x, axis: int, n: int):
    c = x.shape[axis]
    if c == n:
        return x
    if c > n:
        return x[(slice(None),) * axis + (slice(0, n),)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - c)
    return xp.pad(x, pad)


class _Body:
    """The function every device runs: the trace replayed on its blocks."""

    def __init__(self, prog: _Program) -> None:
        self.prog = prog
        # walk once without jax to find the constants (they become inputs)
        for v in prog.order:
            node = v._node
            if node.op in (LEAF, RELAYOUT, SM_IN, SM_OUT):
                continue
            if node.prog == "manual":
                for a in node.args:
                    if isinstance(a, Value) and a._node is None:
                        if isinstance(a._spec, ManualSpec):
                            raise ShardingError("jit: a per-device constant inside shard_map code (make it inside "
                                                "the function from its inputs)")
                        prog.const(a, a._spec)
                continue
            if node.op == PLACE:
                if node.args[0]._node is None:
                    prog.const(node.args[0], None)
                continue
            for a, p in zip(node.args, node.prog.preps if node.prog is not None else ()):
                if isinstance(a, Value) and a._node is None:
                    if p.kind == "host":
                        prog.const(a, None)
                    elif p.kind == "sharded":
                        prog.const(a, a._spec)
            if node.prog is None:
                for a in node.args:
                    if isinstance(a, Value) and a._node is None:
                        prog.const(a, a._spec)
        for o in prog.outs:
            if o._node is None and not any(o is t for t in prog.twins):
                prog.const(o, o._spec)

    def __call__(self, *arrays):
        prog = self.prog
        dev = _Device(prog)
        xp = dev.xp
        G = len(prog.atoms)
        strip = lambda a: a.reshape(a.shape[G:])  # noqa: E731 - each device's block without its grid
        env: dict[int, Any] = {}
        for t, a in zip(prog.twins, arrays):
            env[id(t)] = strip(a)
        consts = [strip(a) for a in arrays[len(prog.twins):]]
        moved: dict = {}

        def value_of(a):
            if id(a) in env:
                return env[id(a)]
            return consts[prog._const_index[(id(a), a._spec if a._spec is not None else None)]]

        def host_of(a):
            if id(a) in env:
                return env[id(a)]
            return consts[prog._const_index[(id(a), None)]]

        for v in prog.order:
            node = v._node
            if node.op == LEAF:
                if node.args:  # a differentiation variable made from a traced value: the same blocks
                    env[id(v)] = value_of(node.args[0])
                continue
            if node.op == RELAYOUT:
                a = node.args[0]
                x = _lower_plan(value_of(a), node.prog, a._shape, dev)
                if a._spec.partial_axes:
                    moved[(id(a), node.params[0].layout())] = x
                env[id(v)] = x
                continue
            if node.op == PLACE:
                env[id(v)] = _place_local(host_of(node.args[0]), node.params[0], dev)
                continue
            if node.op in (SM_IN, SM_OUT):  # a global value seen per device, and back: the same blocks
                x = value_of(node.args[0])
                env[id(v)] = x.reshape(v.shape) if node.op == SM_IN else x.reshape(tuple(
                    n // node.params[0].num_shards(d) for d, n in enumerate(v.shape)))
                continue
            if node.prog == "manual":  # per-device code: the op on this device's block, or a lax collective
                ins = [value_of(a) if isinstance(a, Value) else a for a in node.args]
                if hasattr(node.op, "lower"):
                    env[id(v)] = node.op.lower(ins[0] if ins else None, dev)
                else:
                    env[id(v)] = xp.asarray(node.op.kernel(ins, Local(0, v.shape, node.params)))
                continue
            if node.prog is None:  # an op on host values only: the same on every device
                arrays_ = [host_of(a) if isinstance(a, Value) else a for a in node.args]
                env[id(v)] = xp.asarray(node.op.kernel(arrays_, Local(0, v.shape, node.params)))
                continue
            env[id(v)] = _lower_op(v, node, value_of, host_of, moved, dev)
        outs = []
        for o in prog.outs:
            x = env[id(o)] if id(o) in env else value_of(o)
            outs.append(x.reshape((1,) * G + tuple(x.shape)))
        return tuple(outs)


def _lower_op(v, node, value_of, host_of, moved, dev):
    xp = dev.xp
    prog = node.prog
    op = node.op
    settled = node.settled or (None,) * len(node.args)
    arrays = []
    for a, p, s in zip(node.args, prog.preps, settled):
        if p.kind == "scalar" and not p.mask_axes:
            arrays.append(a)
            continue
        if p.kind == "scalar":
            x = xp.asarray(a, dtype=prog.dtype).reshape(())
        elif p.kind == "host":
            x = _place_local(host_of(a), p.target, dev)
        else:
            # a partial operand is summed once, by whichever use the program reaches first (the trace has
            # no order between independent uses: the forward and backward passes' uses of one value)
            layout = s.layout() if s is not None else p.target.layout()
            key = (id(a), layout)
            if key in moved:
                x = moved[key]
            else:
                plan = reshard.plan(a._shape, a._dtype.itemsize, a._spec, s) if s is not None else p.plan
                x = _lower_plan(value_of(a), plan, a._shape, dev)
                if a._spec.partial_axes and plan.segments:
                    moved[key] = x
        if p.mask_axes:  # a value added to a partial sum counts once per group: on coordinate 0 only
            first = xp.asarray(True)
            for name in p.mask_axes:
                first = first & (dev.linear([dev.mesh.axis_ref(name)]) == 0)
            x = xp.where(first, x, xp.zeros((), dtype=x.dtype))
        for step in p.local:
            if step.lower is None:
                raise ShardingError(f"jit: a local step of {op.name} has no lowering")
            x = step.lower(x, dev)
        arrays.append(x)
    aux = tuple(_aux_local(a, prog, dev) for a in prog.local.aux)
    out = op.kernel(arrays, Local(0, prog.local.out_chunk, prog.local.params, True, aux))
    out = xp.asarray(out)
    if out.dtype != prog.dtype:
        out = out.astype(prog.dtype)
    if tuple(out.shape) != prog.local.out_chunk:
        out = xp.broadcast_to(out, prog.local.out_chunk)
    if prog.post is not None:
        out = _lower_plan(out, prog.post, prog.result_shape, dev, op.reduction)
    return out


def _aux_local(a, prog, dev):
    """This device's part of a per-layout constant shaped (*grid of the op's atoms, ...)."""
    if not isinstance(a, np.ndarray):
        return a
    cut_grid = grid(prog.kspec, _cuts_of(prog))
    G = len(cut_grid.shape)
    if a.ndim < G:
        return dev.xp.asarray(a)
    idx = tuple(dev.linear([atom]) if a.shape[j] > 1 else 0 for j, atom in enumerate(cut_grid.atoms))
    return dev.xp.asarray(a)[idx]


def _cuts_of(prog):
    specs = [p.target for p in prog.preps if p.target is not None] + [prog.kspec]
    return merge_cuts(*(spec_cuts(s) for s in specs))


def _place_local(full, spec: ShardingSpec, dev):
    """A host value's block on this device (every device holds the whole value: cut, no communication)."""
    xp = dev.xp
    x = xp.asarray(full)
    for d, (refs, n) in enumerate(zip(spec.dim_refs, x.shape)):
        k = prod(r.size for r in refs)
        if k == 1:
            continue
        c = chunk(n, k)
        x = _fit(xp, x, d, k * c)
        x = dev.lax.dynamic_slice_in_dim(x, dev.linear(refs) * c, c, axis=d)
    if spec.partial_axes:  # the whole value on coordinate 0 of each partial group, zeros elsewhere
        first = xp.asarray(True)
        for r in spec.partial_refs:
            first = first & (dev.linear([r]) == 0)
        x = xp.where(first, x, xp.zeros((), dtype=x.dtype))
    return x


def _lower_plan(x, plan: reshard.Plan, shape: tuple[int, ...], dev, reduce_op: str = "sum"):
    """A reshard plan as jax.lax collectives on one device's block."""
    lax, xp = dev.lax, dev.xp
    for seg in plan.segments:
        for s in seg.steps:
            if s.fused:
                continue
            refs = [seg.atoms[a] for a in s.atoms]
            names = dev.axis_names(refs)
            k = prod(s.sizes) if s.sizes else 1
            if s.kind == "slice" and s.held:  # each of prod(held) major pieces cut alike
                h, c = prod(s.held), s.dst_chunk
                x = _fit(xp, x, s.dst, h * k * c)
                x = x.reshape(x.shape[:s.dst] + (h, k * c) + x.shape[s.dst + 1:])
                x = lax.dynamic_slice_in_dim(x, dev.linear(refs) * c, c, axis=s.dst + 1)
                x = x.reshape(x.shape[:s.dst] + (h * c,) + x.shape[s.dst + 2:])
            elif s.kind == "slice":
                x = _fit(xp, x, s.dst, k * s.dst_chunk)
                x = lax.dynamic_slice_in_dim(x, dev.linear(refs) * s.dst_chunk, s.dst_chunk, axis=s.dst)
            elif s.kind == "all_gather":
                x = _fit(xp, lax.all_gather(x, names, axis=s.src, tiled=True), s.src, s.src_chunk)
            elif s.kind == "all_reduce":
                x = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[reduce_op](x, names)
            elif s.kind == "reduce_scatter":
                x = _fit(xp, x, s.dst, k * s.dst_chunk)
                if reduce_op == "sum":
                    x = lax.psum_scatter(x, names, scatter_dimension=s.dst, tiled=True)
                else:
                    x = {"max": lax.pmax, "min": lax.pmin}[reduce_op](x, names)
                    x = lax.dynamic_slice_in_dim(x, dev.linear(refs) * s.dst_chunk, s.dst_chunk, axis=s.dst)
            elif s.kind == "all_to_all":
                x = _fit(xp, x, s.dst, k * s.dst_chunk)
                x = lax.all_to_all(x, names, split_axis=s.dst, concat_axis=s.src, tiled=True)
                x = _fit(xp, x, s.src, s.src_chunk)
            elif s.kind == "collective_permute" and s.exchange:
                x = _lower_exchange(x, s.exchange[0], s.exchange[1], shape, dev)
            else:
                raise ShardingError(f"jit: no lowering for a {s.kind} step (a move to another device order "
                                    f"cannot be compiled; keep one mesh inside nb.jit)")
    return x


def _lower_exchange(x, src: ShardingSpec, dst: ShardingSpec, shape, dev):
    """Every device keeps what it holds of its target block and receives the rest, one ppermute a round."""
    xp, lax = dev.xp, dev.lax
    rounds = reshard.exchange_detail(tuple(shape), src, dst)
    sb, tb = reshard._boxes(src, tuple(shape)), reshard._boxes(dst, tuple(shape))
    mesh = src.mesh
    n = len(mesh.devices)
    cs, ct = chunks(src, shape), chunks(dst, shape)
    # block origins (unclipped ceil-rule starts) per mesh position
    s_origin = np.array([[_origin(src, shape, p, j) for j in range(len(shape))] for p in range(n)],
                        dtype=np.int64).reshape(n, len(shape))
    t_origin = np.array([[_origin(dst, shape, p, j) for j in range(len(shape))] for p in range(n)],
                        dtype=np.int64).reshape(n, len(shape))
    me = dev.position()
    out = xp.zeros(ct, dtype=x.dtype)

    def write(out, piece, recv_off, size):
        slab = piece.shape
        big = xp.pad(out, [(0, s) for s in slab])
        region = lax.dynamic_slice(big, tuple(recv_off), slab)
        mask = xp.asarray(True)
        for j, s in enumerate(slab):
            iota = xp.arange(s).reshape((-1,) + (1,) * (len(slab) - j - 1))
            mask = mask & (iota < size[j])
        big = lax.dynamic_update_slice(big, xp.where(mask, piece, region), tuple(recv_off))
        return big[tuple(slice(0, c) for c in ct)]

    # what this device already holds of its target block
    lo = np.maximum(sb[..., 0], tb[..., 0])
    hi = np.minimum(sb[..., 1], tb[..., 1])
    size = np.maximum(hi - lo, 0)
    has = (size > 0).all(axis=1)
    size = np.where(has[:, None], size, 0)
    send_off = np.where(has[:, None], lo - s_origin, 0)
    recv_off = np.where(has[:, None], lo - t_origin, 0)
    slab = tuple(int(v) for v in size.max(axis=0)) if n else ()
    if all(slab):
        src_block = xp.pad(x, [(0, s) for s in slab])
        piece = lax.dynamic_slice(src_block, tuple(xp.asarray(send_off)[me]), slab)
        out = write(out, piece, xp.asarray(recv_off)[me], xp.asarray(size)[me])
    for r in rounds:
        if not all(r.slab):
            continue
        send = np.zeros((n, len(shape)), dtype=np.int64)
        recv = np.zeros((n, len(shape)), dtype=np.int64)
        sizes = np.zeros((n, len(shape)), dtype=np.int64)
        pairs = []
        for u, v, box in r.pieces:
            start = np.array([b[0] for b in box])
            send[u] = start - s_origin[u]
            recv[v] = start - t_origin[v]
            sizes[v] = [b[1] - b[0] for b in box]
            pairs.append((u, v))
        src_block = xp.pad(x, [(0, s) for s in r.slab])
        piece = lax.dynamic_slice(src_block, tuple(xp.asarray(send)[me]), r.slab)
        got = lax.ppermute(piece, dev.prog.names, perm=pairs)
        out = write(out, got, xp.asarray(recv)[me], xp.asarray(sizes)[me])
    return out


def _origin(spec: ShardingSpec, shape, p: int, j: int) -> int:
    """Global index of local row 0 of dim ``j`` on the device at mesh position ``p`` (the ceil rule, unclipped)."""
    from .layout import dim_position
    mesh = spec.mesh
    coords = mesh.coords(mesh.devices[p])
    return dim_position(spec.dim_refs[j], mesh, coords) * chunk(shape[j], spec.num_shards(j))
