"""Programs: what the executor decides once per (op, params, operand signatures, strategy, cost model) and caches:
the propagated layouts, each operand's reshard plan and local steps, the kernel's grid and the result's layout,
whether a pending sum may survive, and the fast path (nothing moves: the kernel reads the stored blocks, or views
of them). The executor (``executor.py``) carries programs out."""

from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import Any, NamedTuple

import numpy as np

from . import backends
from . import collectives as C
from . import reshard
from .errors import ShardingError
from .factors import LocalStep, OperandContext, merge_windows
from .fastpath import Kernel
from .layout import chunks, grid, merge_cuts, spec_cuts
from .opdef import Local, OpDef
from .pending import cheaper_to_sum_now, survival
from .propagation import propagate
from .rules.core import Rule
from .signatures import result_dtype, sig_id, signatures_of
from .spec import ShardingSpec

MANUAL = "manual"  # the program of an op on per-device values: the kernel on every block, nothing planned


# ---- planning (cached) ---------------------------------------------------------------------------


class Prep(NamedTuple):
    kind: str  # "sharded", "host", "scalar"
    target: ShardingSpec | None
    plan: reshard.Plan | None
    mask_axes: tuple[str, ...]  # partial axes this operand must be added once over
    grid_shape: tuple[int, ...]  # its stored shape in the kernel's common grid
    local: tuple[LocalStep, ...] = ()  # what the factor kinds do to it before the kernel
    direct: bool = False  # sharded, nothing moves (or only local cuts) and nothing changes: its stored blocks ...
    view: tuple | None = None  # ... seen through this chain of reshapes and transposes (None: as stored)
    zero: Any = None  # what the add-once mask leaves on other devices (None: -0.0, IEEE's additive identity)
    events: tuple = ()  # the plan's collectives (made once with the program, not per call)
    gathers: bool = False  # they are all_gathers only (a copy a later use may take again: trace.gathered_copy)
    local_events: tuple = ()  # what the local steps exchange (halo rows)


class Planned(NamedTuple):
    """What propagation decided for a program and under which constraints (``nb.explain`` tells it): the op's
    rule, the ``Decision`` (with each operand's opinions and the reasons), the pending sums kept and whether
    every sum had to be made first (True, or "cost" when passing it on would cost more)."""

    rule: Any
    decision: Any
    kept: tuple
    strict: bool | str


class Program(NamedTuple):
    preps: tuple[Prep, ...]
    G: int
    kspec: ShardingSpec  # the layout the kernel's output is in
    result: ShardingSpec  # the layout handed back (differs when max/min must be reduced across devices)
    result_shape: tuple[int, ...]
    out_grid: tuple[int, ...]  # the kernel's output on the common grid
    kspec_grid: tuple[int, ...]  # the same output on kspec's own grid
    local: Local
    post: reshard.Plan | None
    dtype: np.dtype
    result_sid: int  # the result's signature id
    padded: bool  # some block runs past its dim's end: what the padding computes is ignored, silently
    checks: tuple = ()  # (operand, "finite"|"nonzero"): a pending sum survives this product only if it holds
    final: tuple = ()  # the result's stored shape (its own grid, its block)
    folded: bool = False  # the kernel did the post plan's all_reduce (Local.fold): post only logs
    flops: int = 0  # of one device's kernel (the largest block)
    decision: Planned | None = None  # what propagation decided (per factor), for nb.explain to tell
    hot: bool = True  # the executor's hot path may run it: no check on a kept pending sum, not a product of two
    # pending sums (they may be one value, summed first: ``pending.repeated_partials`` asks which, by identity)
    as_stored: bool = False  # every operand is read as stored (a scalar as it is): nothing moves, no view or
    # local step
    after: bool = True  # the kernel's output is reshaped to ``final`` or moved by ``post`` (else it is the result)
    kernel: Kernel | None = None  # nothing moves and ``op.fast`` applies: it runs on the stored blocks (or views of
    # them, or packs), compiled once; None otherwise

    @property
    def fast(self) -> tuple | None:
        """Per operand, how ``op.fast`` reads its stored blocks (``Kernel.chains``); None: no fast path."""
        return None if self.kernel is None else self.kernel.chains

    @property
    def reorder(self) -> tuple[int, ...] | None:
        """The transpose taking ``op.fast``'s output, run in another axis order (``_kernel_order``), to the
        result as stored."""
        return None if self.kernel is None else self.kernel.reorder

    @property
    def into(self) -> int | None:
        """The operand whose copy (a pack) ``op.fast`` writes its output into."""
        return None if self.kernel is None else self.kernel.into


class _ShapeOnly:
    """Stands in for stored blocks while a plan of local cuts is run once on shapes only, to record the
    reshapes and transposes it amounts to; anything else (padding, trimming) is refused."""

    def __init__(self, shape: tuple[int, ...], ops: list) -> None:
        self.shape, self.ndim, self._ops = tuple(shape), len(shape), ops

    def reshape(self, shape):
        shape = tuple(shape)
        if prod(shape) != prod(self.shape):
            raise ValueError("not a reshape")
        self._ops.append(("reshape", shape))
        return _ShapeOnly(shape, self._ops)

    def transpose(self, perm):
        self._ops.append(("transpose", tuple(perm)))
        return _ShapeOnly(tuple(self.shape[a] for a in perm), self._ops)


def _local_only(plan: reshard.Plan) -> bool:
    return all(C.REGISTRY[s.kind].local for seg in plan.segments for s in seg.steps)


def _view_chain(stored: tuple[int, ...], plan: reshard.Plan, gshape: tuple[int, ...]) -> tuple | None:
    """A plan of local cuts as a chain of views (no copy, no Python per step), or None when it needs more."""
    ops: list = []
    try:
        out = backends.NUMPY.move(_ShapeOnly(stored, ops), plan).reshape(gshape)
    except (ValueError, TypeError, AttributeError, IndexError):
        return None
    chain: list = []
    shape = stored
    for kind, arg in ops:
        if kind == "transpose":
            if arg == tuple(range(len(arg))):
                continue
            shape = tuple(shape[a] for a in arg)
        elif arg == shape:
            continue  # a reshape to the shape it has
        else:
            if chain and chain[-1][0] == "reshape":
                chain.pop()  # two reshapes in a row are the last one
            shape = arg
        chain.append((kind, arg))
    return tuple(chain) if out.shape == gshape else None


@lru_cache(maxsize=4096)
def program_for(op: OpDef, sids: tuple[int, ...], params: tuple, strat: str, model,
             strict: bool | str = False, epoch: int = 0) -> Program | None:
    """``strict``: no pending sum survives the op (True: its values would break linearity; "cost": passing it
    on costs more than making it). ``epoch``: the collective registry's (a newly registered collective is
    planned with from then on)."""
    sigs = signatures_of(sids)
    if not any(s[0] == "s" for s in sigs):
        return None
    if any(s[0] == "s" and not isinstance(s[3], ShardingSpec) for s in sigs):
        return MANUAL  # per-device values inside nb.shard_map
    shapes = tuple(s[1] if s[0] != "c" else () for s in sigs)
    meshes = {s[3].mesh for s in sigs if s[0] == "s"}
    if len(meshes) > 1:
        ms = [(i, s[3].mesh) for i, s in enumerate(sigs) if s[0] == "s"]
        (i, a), (j, b) = ms[0], next((k, m) for k, m in ms if m != ms[0][1])
        same = (f" (two different meshes share the name {a.name!r}: a mesh is its name, axes and devices)"
                if a.name == b.name else "")
        how = ("move one with t.with_sharding(other_mesh, dims) (the meshes hold the same devices: a logged "
               "relabel)" if sorted(a.devices) == sorted(b.devices) else
               "the meshes hold different devices: copy one through the host, nb.tensor(t.numpy()).shard(...)")
        raise ShardingError(f"{op.name}: operand {i} is on mesh {a!r} but operand {j} is on mesh {b!r}{same}; "
                            f"{how}")
    mesh = meshes.pop()
    rule = op.rule(shapes, *params)
    dtype = result_dtype(op, sigs, params)
    pend = survival(op, sigs, shapes, dtype, strict)
    keep, keep_by = pend.keep, pend.keep_by
    reserved = tuple(sorted(keep))
    prop_specs = tuple(strip_partial(s[3]) if s[0] == "s" else None for s in sigs)
    dec = propagate(rule, prop_specs, mesh, strat, reserved)
    reduced = list(dec.result.partial_axes)
    result_shape = rule.result_shape
    result_partial = tuple(sorted(keep)) + tuple(reduced) if op.reduction == "sum" else tuple(sorted(keep))
    post_src = None
    computed, wanted = _result_dims(dec, result_shape, dtype, mesh)
    result = ShardingSpec(mesh, wanted, partial_axes=result_partial)
    if op.reduction != "sum" and reduced or computed != wanted:
        post_src = ShardingSpec(mesh, computed, partial_axes=tuple(sorted(keep)) + tuple(reduced)
                                if op.reduction != "sum" else result_partial)
    targets = []
    for i, s in enumerate(sigs):
        if s[0] == "c":
            targets.append(None)
            continue
        targets.append(ShardingSpec(mesh, dec.operands[i].dim_specs, partial_axes=sorted(keep_by[i])))
    kernel_specs = [t for t in targets if t is not None] + [post_src or result]
    cuts = merge_cuts(*(spec_cuts(t) for t in kernel_specs))
    if cuts is None:
        raise ShardingError(f"{op.name}: the operands' sub-axes do not nest into one device grid "
                            f"({[repr(t) for t in kernel_specs]})")
    G = len(grid(post_src or result, cuts).atoms)  # (the result may be cut finer: post slices it)
    preps = []
    for i, (s, t) in enumerate(zip(sigs, targets)):
        add_once, zero = pend.add_once[i], pend.zeros[i]
        if s[0] == "c":
            if not add_once:
                preps.append(Prep("scalar", None, None, (), ()))
                continue
            t = ShardingSpec(mesh, [])  # a scalar added to a partial sum: placed, then added once
        tt = t if not add_once else ShardingSpec(mesh, t.dim_specs,
                                                 partial_axes=sorted(set(t.partial_axes) | set(add_once)))
        gshape = grid(tt, cuts).shape + chunks(tt, shapes[i])
        local = _local_steps(rule, i, OperandContext(tt, cuts, shapes[i], s[2] if s[0] != "c" else dtype,
                                                     op.reduction, i))
        if s[0] == "c":
            preps.append(Prep("scalar", t, None, add_once, gshape, zero=zero))
        elif s[0] == "h":
            preps.append(Prep("host", t, None, add_once, gshape, local, zero=zero,
                              local_events=tuple(e for step in local for e in step.events)))
        else:
            plan = reshard.plan(shapes[i], s[2].itemsize, s[3], t)
            stored = grid(s[3]).shape + chunks(s[3], shapes[i])
            view = None if stored == gshape else (("reshape", gshape),)  # a chain of views to take
            direct = not add_once and not local and (not plan.segments or _local_only(plan))
            if direct and plan.segments:
                view = _view_chain(stored, plan, gshape)
                direct = view is not None
            events = plan.events
            preps.append(Prep("sharded", t, plan, add_once, gshape, local, direct, view, zero, events,
                              bool(events) and all(e.kind == "all_gather" for e in events),
                              tuple(e for step in local for e in step.events)))
    kspec = post_src or result
    out_grid = grid(kspec, cuts).shape + chunks(kspec, result_shape)
    post = reshard.plan(result_shape, dtype.itemsize, post_src, result) if post_src is not None else None
    padded = any(_padded(t, shp) for t, shp in zip(targets, shapes) if t is not None) or _padded(kspec, result_shape)
    result_sid = sig_id(("s", result_shape, dtype, result))
    aux = op.aux(kspec, cuts, shapes, params) if op.aux is not None else ()
    checks = pend.checks
    local = Local(G, chunks(kspec, result_shape), params, True, aux)
    final = grid(kspec).shape + chunks(kspec, result_shape)
    fold = _fold(op, post, G, out_grid) if not padded else ()
    if fold:  # the kernel does the all_reduce; the plan is still carried out for the log (on no data)
        out_grid = final = post.segments[0].end_grid + out_grid[G:]
        local = local._replace(fold=fold)
    if keep and op.linear == "mul" and op.fast is None and cheaper_to_sum_now(mesh, sigs, shapes, keep_by, result,
                                                                                 result_shape, dtype):
        return program_for(op, sids, params, strat, model, "cost", epoch)
    blocks = tuple(chunks(t, shp) if t is not None else () for t, shp in zip(targets, shapes))
    flops = op.flops(blocks, local.out_chunk, params) if op.flops is not None else prod(local.out_chunk)
    prog = Program(tuple(preps), G, kspec, result, result_shape, out_grid, grid(kspec).shape, local, post, dtype,
                   result_sid, padded, checks, final, bool(fold), int(flops),
                   Planned(rule, dec, reserved, strict),
                   not checks and (op.linear != "mul" or
                                   sum(1 for s in sigs if s[0] == "s" and s[3].partial_axes) < 2))
    fast = _fast_views(op, prog, sigs)
    as_stored = all(p.kind == "scalar" and not p.mask_axes or p.kind == "sharded" and p.direct and p.view is None
                    for p in prog.preps)  # (read where there is no kernel)
    reorder = into = None
    if fast is not None and any(fast):  # (some operand is read through views)
        stored = tuple(grid(s[3]).shape + chunks(s[3], s[1]) if s[0] == "s" else () for s in sigs)
        dtypes = tuple(s[2] if s[0] == "s" else None for s in sigs)
        fast, reorder, packed = _kernel_order(fast, stored, dtypes, prog.G, out_grid)
        if packed and isinstance(op.fast, np.ufunc) and op.fast.nout == 1 and \
                all(d == dtype for d in dtypes if d is not None):
            # a packed operand broadcasts nowhere (``_packs``): its copy has the output's shape, and here its dtype,
            # which numpy's loop for these dtypes gives too: the output is written there
            into = packed[0]
    kernel = Kernel(op, fast, into, reorder, bool(checks), dtype) if fast is not None else None
    return prog._replace(as_stored=as_stored, kernel=kernel,
                         after=out_grid != final or post is not None and not prog.folded)


def _fold(op: OpDef, post: reshard.Plan | None, G: int, out_grid: tuple[int, ...]) -> tuple[int, ...]:
    """The grid axes of a max/min whose post plan is one all_reduce of the kernel's own grid: the kernel can
    reduce over them too, in the same call (what XLA fuses as well: a reduce feeding an all-reduce)."""
    if not op.folds or post is None or len(post.segments) != 1:
        return ()
    seg = post.segments[0]
    if len(seg.steps) != 1 or seg.steps[0].kind != "all_reduce" or seg.enter != (G, G) or \
            seg.start_grid != out_grid[:G]:
        return ()
    atoms = seg.steps[0].atoms
    if seg.end_grid != tuple(1 if i in atoms else n for i, n in enumerate(seg.start_grid)):
        return ()
    return tuple(sorted(atoms))


def _result_dims(dec, shape: tuple[int, ...], dtype: np.dtype, mesh) -> tuple[tuple, tuple]:
    """The result's dims as the kernel computes them, and as handed back: propagation may give the result
    factors its operands' dims cannot hold (Shardy's reshape keeps them); the kernel's output is then sliced
    to that layout on each device, when that moves no data (else the computed layout is handed back)."""
    if dec.computed is None or dec.computed.dim_specs == dec.result.dim_specs:
        return dec.result.dim_specs, dec.result.dim_specs
    src, dst = ShardingSpec(mesh, dec.computed.dim_specs), ShardingSpec(mesh, dec.result.dim_specs)
    if reshard.plan(shape, dtype.itemsize, src, dst).collectives:
        return dec.computed.dim_specs, dec.computed.dim_specs
    return dec.computed.dim_specs, dec.result.dim_specs


def _padded(spec: ShardingSpec, shape: tuple[int, ...]) -> bool:
    return any(n % spec.num_shards(d) for d, n in enumerate(shape))


def _fast_views(op: OpDef, prog: Program, sigs: tuple) -> tuple | None:
    """When nothing moves, nothing is padded and no factor kind acts, ``op.fast`` runs on the stored blocks
    as they are (viewed on the common grid): per operand, None for as is, False for a scalar, or a chain of
    views (a reshape to the common grid, or the local cuts of an operand only cut locally). Otherwise None."""
    if op.fast is None or prog.padded or prog.post is not None or prog.kspec_grid + prog.local.out_chunk != \
            prog.out_grid:
        return None
    views = []
    grids = []
    for s, p in zip(sigs, prog.preps):
        if p.kind == "scalar" and not p.mask_axes:
            views.append(False)
            continue
        if p.kind != "sharded" or p.mask_axes or p.local or len(p.grid_shape) != len(prog.out_grid) or \
                p.plan.segments and not (p.direct and p.view):
            return None
        stored = grid(s[3]).shape + chunks(s[3], s[1])
        views.append(p.view if p.plan.segments else None if stored == p.grid_shape else (("reshape", p.grid_shape),))
        grids.append(p.grid_shape[:prog.G])
    if np.broadcast_shapes(*grids) != prog.out_grid[:prog.G]:
        return None
    return tuple(views)


# numpy's cost of an elementwise call over views, in instructions (callgrind, numpy 2): each inner-loop call when the
# iteration has at most 3 dims once adjacent dims that step alike are merged, each one when it has more (numpy's
# iterator has no specialised step past 3), the iterator itself when there is more than one inner loop (numpy 2.4: an
# add of contiguous float32 blocks costs ~4,500 instructions with its allocation, the same add with one operand in 2
# to 8 strided runs ~9,200 to ~9,500), and each reshape or transpose that makes a view; a pack (``_pack_cost``) adds
# two views and a copy's call (its allocation included: ~3,500 for a copy of 8 KiB, of which ~300 an allocation the
# ufunc then skips when it writes into the copy). Past ``_PACK_BYTES`` an operand is not packed: the copy's extra pass
# through memory costs more than numpy's loops (on this 2 MiB-L2 Xeon, A[dp,-] + B[-,tp] in float32 with 1 MiB
# operands ran 17-18% faster packed, with 4 MiB 5-8% slower; a machine-dependent bound)
_LOOP, _DEEP_LOOP, _VIEW_CALL, _COPY_CALL, _ITERATOR = 75, 130, 2000, 3000, 4700
_PACK_BYTES = 1 << 20


def _kernel_order(views: tuple, stored: tuple, dtypes: tuple, G: int, out_grid: tuple[int, ...]
                  ) -> tuple[tuple, tuple | None, tuple[int, ...]]:
    """The axis order ``op.fast`` runs in when operands are views of their stored blocks: the grid order of one
    operand's stored blocks when numpy's loops over it cost less (an operand cut locally holds its blocks with
    the grid axes in another order than the result's: in the result's order numpy steps through every row of
    every block on its own), else the result's. Only grid axes move: each device's result block is contiguous
    either way. An operand still strided in that order is packed first when that costs less than numpy's
    loops over its short runs. The views with the order's transpose (and packs) appended, the transpose taking
    the kernel's output to the result as stored (None: none), and the operands packed."""
    same = tuple(range(len(out_grid)))
    # per operand seen through its view: its shape and strides (None: a scalar, or a copying view)
    held = [None if v is False else _viewed(st, v or ()) for v, st in zip(views, stored)]
    orders = {same}
    for h in held:
        if h is not None:
            shape, strides = h
            orders.add(tuple(sorted(range(G), key=lambda a: (shape[a] > 1, -strides[a]))) + same[G:])

    def cost(order: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """What the kernel costs in this order, with the packs that make it cheapest."""
        calls = sum(len(_then(v or (), order)) for v in views if v is not False) + (order != same)
        shape = tuple(out_grid[a] for a in order)
        steps = {i: tuple(0 if h[0][a] == 1 else h[1][a] for a in order) for i, h in enumerate(held)
                 if h is not None}
        flat = tuple(0 if n == 1 else s for n, s in zip(shape, _c_strides(shape)))  # (as ``steps``: 0 on 1s)
        packable = [i for i, st in steps.items()
                    if st != flat and _packs(shape, st) and prod(shape) * dtypes[i].itemsize <= _PACK_BYTES]
        # a pack read from the stored void items makes its views there instead (``_void_chain``)
        voids = {i: _void_chain(stored[i], _then(views[i] or (), order), shape[-1]) for i in packable}
        cheapest = None
        for chosen in range(1 << len(packable)):
            packed = tuple(i for k, i in enumerate(packable) if chosen >> k & 1)
            runs, dims = _loops(shape, [flat if i in packed else st for i, st in steps.items()] + [flat])
            c = runs * (_LOOP if dims <= 3 else _DEEP_LOOP) + (runs > 1) * _ITERATOR + calls * _VIEW_CALL + \
                sum(_pack_cost(shape, steps[i], dtypes[i].itemsize) - _VIEW_CALL * (
                    0 if voids[i] is None else len(_then(views[i] or (), order)) - len(voids[i])) for i in packed)
            if cheapest is None or c < cheapest[0]:
                cheapest = (c, packed, voids)
        return cheapest

    costs = {o: cost(o) for o in sorted(orders)}
    best = min(costs, key=lambda o: (costs[o][0], o != same))
    _, packed, voids = costs[best]
    run = out_grid[best[-1]]
    views = tuple(v if v is False else (_then(v or (), best) + (
        (("pack", (np.dtype(f"V{run * dtypes[i].itemsize}"), dtypes[i], voids[i])),) if i in packed else ())) or None
        for i, v in enumerate(views))
    return views, (None if best == same else tuple(sorted(range(len(best)), key=best.__getitem__))), packed


def _packs(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether an operand with these strides (in elements, 0 where it broadcasts) on the kernel's ``shape`` can
    be packed (copied contiguous, each run of its last dim as one void item): its last dim holds more than one
    element, one after the other, and it broadcasts nowhere (a pack copies it whole)."""
    return len(shape) > 0 and shape[-1] > 1 and strides[-1] == 1 and 0 not in shape and \
        all(s != 0 for s, n in zip(strides, shape) if n > 1)


def _pack_cost(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    """numpy's cost of a pack: two views, a copy, and per run of the last dim (one void item) its move (items of 8
    or 16 bytes have a copy loop of their own, ~6 instructions each; others a memmove, ~16 and one per 8 bytes),
    with the copy's inner-loop calls."""
    items = prod(shape[:-1])
    size = shape[-1] * itemsize
    runs, _ = _loops(shape[:-1], [strides[:-1], _c_strides(shape[:-1])])
    return 2 * _VIEW_CALL + _COPY_CALL + items * (6 if size in (8, 16) else 16 + size // 8) + runs * _LOOP


def _void_chain(stored: tuple[int, ...], chain: tuple, run: int) -> tuple | None:
    """The views of the stored blocks' void items (each ``run`` elements of their last dim, one after the other)
    that give ``chain``'s view with each run of its last dim one item (a trailing dim of 1): a pack read that way
    makes its views on ``run`` times fewer elements, and a reshape that only moves dims of 1 is folded into the
    transpose. None when the runs are not whole void items of the stored blocks, or the view is not a reshape
    and transpose of them. Reshapes and transposes are logical, so this holds of blocks held in any order in
    memory (a lazy transpose's reshape may copy); only numpy's void view needs a contiguous last axis."""
    viewed = _viewed(stored, chain)
    if viewed is None or not stored or stored[-1] % run:
        return None
    shape, strides = viewed
    if shape[-1] != run or (run > 1 and strides[-1] != 1) or \
            any(n > 1 and s % run for n, s in zip(shape[:-1], strides)):
        return None
    have = stored[:-1] + (stored[-1] // run,)  # the void items (strides below: as if C-contiguous)
    want, steps = shape[:-1] + (1,), tuple(s // run for s in strides[:-1]) + (0,)
    order = sorted(range(len(want)), key=lambda a: (want[a] > 1, -steps[a]))  # dims of 1 first, then by stride
    lay = tuple(want[a] for a in order)  # the wanted dims in memory order
    if any(n > 1 and c != steps[a] for a, n, c in zip(order, lay, _c_strides(lay))):
        return None
    back = tuple(sorted(range(len(order)), key=order.__getitem__))
    if [n for n in have if n > 1] == [n for n in lay if n > 1] and len(have) == len(lay):
        # the reshape only moves dims of 1: each wanted dim is one of the stored ones (dims of 1 in turn)
        ones = iter(a for a, n in enumerate(have) if n == 1)
        big = iter(a for a, n in enumerate(have) if n > 1)
        src = [next(big) if n > 1 else next(ones) for n in lay]
        perm = tuple(src[b] for b in back)
        return (("transpose", perm),) if perm != tuple(range(len(perm))) else ()
    return ((("reshape", lay),) if lay != have else ()) + _then((), back)


def _then(chain: tuple, order: tuple[int, ...]) -> tuple:
    """A chain of views followed by a transpose to ``order`` (merged into its last transpose, if any)."""
    if order == tuple(range(len(order))):
        return chain
    if chain and chain[-1][0] == "transpose":
        last = chain[-1][1]
        order = tuple(last[a] for a in order)
        return chain[:-1] + ((("transpose", order),) if order != tuple(range(len(order))) else ())
    return chain + (("transpose", order),)


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a C-contiguous array of ``shape``."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _viewed(stored: tuple[int, ...], chain: tuple) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shape and strides, in elements, of ``chain``'s view of C-contiguous blocks of shape ``stored`` (as
    placing and kernels lay them out), or None when a reshape in it would copy."""
    shape, strides = stored, _c_strides(stored)
    for kind, arg in chain:
        if kind == "transpose":
            shape, strides = tuple(shape[a] for a in arg), tuple(strides[a] for a in arg)
            continue
        strides = _view_strides(shape, strides, arg)
        if strides is None:
            return None
        shape = arg
    return shape, strides


def _view_strides(shape: tuple[int, ...], strides: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides numpy gives ``reshape(new)`` of an array of ``shape`` and ``strides`` when it makes a view, or
    None when it copies (numpy's ``_attempt_nocopy_reshape``: each group of dims merged or split must be
    contiguous)."""
    if 0 in shape:
        return _c_strides(new)
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    out = [1] * len(new)
    i = j = 0
    while i < len(old) and j < len(new):
        first_old, first_new = i, j
        have, want = old[i][0], new[j]
        i, j = i + 1, j + 1
        while have != want:
            if want < have:
                want *= new[j]
                j += 1
            else:
                have *= old[i][0]
                i += 1
        if any(old[k][1] != old[k + 1][0] * old[k + 1][1] for k in range(first_old, i - 1)):
            return None
        out[j - 1] = old[i - 1][1]
        for k in range(j - 1, first_new, -1):
            out[k - 1] = out[k] * new[k]
    return tuple(out)


def _loops(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[int, int]:
    """numpy's iteration of an elementwise call over ``shape`` in this axis order, given each array's strides
    (0 where it broadcasts): its inner-loop calls, and its dims once adjacent dims that step alike are merged."""
    dims: list[list] = []  # innermost first: [size, strides]
    for a in reversed(range(len(shape))):
        n = shape[a]
        if n == 1:
            continue
        st = [s[a] for s in strides]
        if dims and all(x == y * dims[-1][0] for x, y in zip(st, dims[-1][1])):
            dims[-1][0] *= n
        else:
            dims.append([n, st])
    return (prod(d[0] for d in dims[1:]) if dims else 0), len(dims)


def _local_steps(rule: Rule, i: int, ctx: OperandContext) -> tuple[LocalStep, ...]:
    """Ask each factor kind of operand ``i`` what it does to the dims holding it (grouped per kind)."""
    by_kind: dict[Any, list[int]] = {}
    for d, factors in enumerate(rule.operands[i]):
        for f in factors:
            by_kind.setdefault(rule.kinds[f], [])
            if d not in by_kind[rule.kinds[f]]:
                by_kind[rule.kinds[f]].append(d)
    steps = []
    for kind, dims in by_kind.items():
        step = kind.prepare(ctx, tuple(dims))
        if step is not None:
            steps.append(step)
    return merge_windows(steps)


def strip_partial(spec: ShardingSpec) -> ShardingSpec:
    """``spec`` without its partial axes (what propagation reads of a pending sum's layout)."""
    return spec if not spec.partial_axes else ShardingSpec(spec.mesh, spec.dim_specs, spec.replicated_axes)
