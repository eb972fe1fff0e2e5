"""Eager SPMD dispatch: propagate, reshard operands where the factors demand, let each factor kind prepare
its dims, run one local kernel over all devices at once, wrap the result. Everything that depends only on
(op, params, signatures, strategy, cost model) is decided once and cached as a ``Program``; when nothing
moves and the op is a plain numpy function, the cached program calls it directly (the fast path). What a value
is made of is ``value``'s; when a pending sum is made, ``pending`` decides (the executor carries it out)."""

from __future__ import annotations

from math import prod
from typing import Any, Callable, Sequence

import numpy as np

from . import backends, reshard
from . import collectives as C
from .cost import current as current_cost_model
from .errors import ShardingError
from .layout import chunks
from .opdef import Local, OpDef
from .pending import KEEPS, STRICT, breaks_linearity, overflowed, repeated_partials, reused_sum
from .program import MANUAL, Prep, Program, program_for, strip_partial
from .propagation import current_strategy
from .scoped import setting
from .spec import ShardingSpec
from .step import BUCKET, MOVE, PLACE as PLACE_STEP, RELAYOUT as RELAYOUT_STEP, Step, Use, read
from .trace import HUSK, _LINKS, _remat, entry, gathered_copy, keeping, link, linked_any, made, record, tracked
from .value import Value, serial
from .manual import manual_run
from .signatures import StaleSignature, result_dtype, sid_of, sig_id, signature
from .backends import ACTIVE as _BACKEND
from .collectives import _EPOCH
from .commlog import _logs as _LOGS
from .cost import _current as _COST_MODEL
from .propagation import _strategy as _STRATEGY

# the hot path's context reads, each a bound method made once (looked up per call, ``var.get`` makes one each time)
_remat_now, _logs_now, _strategy_now, _model_now, _strict_now, _backend_now = (
    _remat.get, _LOGS.get, _STRATEGY.get, _COST_MODEL.get, STRICT.get, _BACKEND.get)
_NDARRAY = np.ndarray  # (a global read, not a module attribute's)


def run(op: OpDef, args: Sequence[Any], params: tuple = (), make: Callable = Value) -> Any:
    """Apply ``op`` to ``args`` (Values or Python scalars); ``make(data, spec, shape, dtype, sid)`` wraps it.
    When an operand is traced, the result is linked on the tape (its op, params and program, with the operands
    its VJP keeps); when a comm log is open, the op's step (what moved, and why) is published there, and the link
    holds it too."""
    r = _remat_now()
    if r is None and not _logs_now() and not (_LINKS and linked_any(args)):  # (no call when nothing is linked)
        # the hot path: nothing logged or replayed; when no operand is traced or summed by an earlier use, all are on
        # numpy, and the program keeps no pending sum it must check (most eager calls), what follows would run the
        # program's kernel and nothing else: that is run here (else the program is looked up again below)
        sids, held = [], []  # each operand's signature id, and its stored blocks (a scalar as it is)
        for a in args:
            if isinstance(a, Value):
                d = a._data
                if a._moved or a._sid < 0 or type(d) is not _NDARRAY:
                    break
                sids.append(a._sid)
                held.append(d)
            else:
                sids.append(sid_of(a))
                held.append(a)
        else:
            try:
                prog = program_for(op, tuple(sids), params, _strategy_now(), _model_now(), _strict_now(), _EPOCH[0])
            except StaleSignature:
                prog = None
            if type(prog) is Program and prog.hot and _backend_now() == "numpy":
                kernel = prog.kernel
                return _run_numpy(op, args, held, prog, make) if kernel is None else \
                    make(kernel.call(held), prog.result, prog.result_shape, prog.dtype, prog.result_sid)
    elif r is not None and op.name in r.ops:
        if r.replay is not None:  # nb.checkpoint's recompute: this op's output was kept from the forward run
            return _replayed(r, op, params, args, make)
    rec = C.logging()
    track = tracked(args)
    if op.linear == "mul" and len(args) > 1:
        for a in repeated_partials(args):
            _sum_now(op, a)
    used = args
    for a in args:  # (the common case, no operand summed by an earlier use, costs one attribute test each)
        if getattr(a, "_moved", None):
            used = [reused_sum(a) for a in args]
            break
    sink = [None] * (len(used) + 1) if rec or track else None  # per operand (events, reused), then the result's moves
    moved = [] if r is not None and r.gather else None  # a recompute keeps the operands it gathered
    out, prog = _run(op, used, params, make, sink, moved)
    if type(prog) is Program and prog.checks and prog.checks[-1] is KEEPS and overflowed(out._data, prog):
        sink = [None] * (len(used) + 1) if rec or track else None
        out, prog = _rerun_strict(op, used, params, make, sink)
    if rec or track:
        keep = keeping(op, params, tuple(args), out, moved) if track else None
        step = _step(op, params, args, used, out, prog, sink, keep) if rec else None
        if track:  # (linked before it is published: a memory log reads what the link keeps)
            link(out, made(op, params, prog, keep, step))
        if rec:
            C.publish(step, [(u.value, a) for u, a in zip(step.uses, used)] + [(serial(out), out)])
    if r is not None and op.name in r.ops:
        r.saved.append((out, prog))
    return out


def _run_numpy(op: OpDef, args: Sequence[Any], held: list, prog: Program, make: Callable) -> Any:
    """The hot path's kernel on numpy operands (``held``: their stored blocks, a scalar as it is): each operand's
    stored blocks (or a view of them, or prepared by its factor kinds' local steps), the kernel, the result
    read-only."""
    if prog.as_stored:
        arrays = held
    else:
        arrays = []  # (loops: a comprehension is a call of its own)
        i = 0
        for p in prog.preps:
            arrays.append((held[i] if p.view is None else _view(held[i], p.view)) if p.direct else
                          _prepare(args[i], p, prog, op, backends.NUMPY, None, i))
            i += 1
    out = backends.NUMPY.kernel(op, arrays, prog)  # (an ndarray: made read-only here, as NUMPY.commit does)
    out.setflags(False)
    return make(out, prog.result, prog.result_shape, prog.dtype, prog.result_sid)


def _replayed(r: Any, op: OpDef, params: tuple, args: Sequence[Any], make: Callable) -> Any:
    """The output ``nb.checkpoint`` kept of this op in the forward run, as the recompute's result (nothing runs,
    nothing is logged: it was not recomputed); it is linked on the tape, so its gradient flows to its operands."""
    try:
        kept, prog = next(r.replay)
    except StopIteration:
        raise ShardingError(f"checkpoint: the recompute ran more {op.name} ops than the forward run; the function "
                            f"must run the same ops each time") from None
    # the same value: sums made of it are reused; its link keeps what the op's VJP reads of it (of ``kept``: the
    # same blocks, serial and sums)
    out = make(kept._data, kept._spec, kept._shape, kept._dtype, kept._sid, serial(kept), kept._moved)
    return record(out, op, params, args, result=kept, prog=prog) if tracked(args) else out


def _step(op: OpDef, params: tuple, args: Sequence[Any], used: Sequence[Any], out: Any, prog: Any,
          sink: list, keep: tuple | None = None) -> Step:
    """The step of one op as it ran (for the open comm logs); ``keep``: what its link on the tape keeps
    (``trace.keeping``), when it has one."""
    user = C.current_op() or op.name
    uses = []
    preps = prog.preps if type(prog) is Program else None
    kept = keep[0] if keep is not None and keep[2] is not None else ()  # what a pruned link holds
    for i, (orig, a) in enumerate(zip(args, used)):
        if not isinstance(a, Value):
            uses.append(read(a))
            continue
        got = sink[i]
        dst = preps[i].target if preps is not None and preps[i].target is not None else a._spec
        k = kept[i] if i < len(kept) else None
        copy = serial(k) if isinstance(k, Value) and k._serial and k is not orig and k._serial != serial(orig) and \
            k._spec == dst else 0  # the moved operand the link keeps (a recompute's gathered weight)
        if got is None:  # (nothing moved: most operands; positional, as keywords cost more)
            uses.append(Use(a._serial or serial(a), a._shape, a._dtype, a._spec, dst, (), False, None, (),
                            orig is not a, copy))
            continue
        events, reused, inside, cached = got
        uses.append(Use(a._serial or serial(a), a._shape, a._dtype, a._spec, dst,
                        tuple([C.stamped(e, user) for e in events]) if events else (), reused, None,
                        tuple([C.stamped(e, user) for e in inside]) if inside else (), orig is not a, copy, cached))
    post = tuple([C.stamped(e, user) for e in sink[-1]]) if sink[-1] else ()
    if type(prog) is Program:
        flops = prog.flops
    else:  # on the host, or per-device code: the op on whole operands (a per-device value is its block)
        shapes = tuple(u.shape for u in uses)
        flops = op.flops(shapes, out._shape, params) if op.flops is not None else prod(out._shape)
    alias = uses[0].value if op.view and type(prog) is Program and _views(prog) and not uses[0].events else 0
    saves, extra = _residual_record(op, params, out, uses, keep)
    step = Step(op, params, tuple(uses), serial(out), out._shape, out._dtype, out._spec, post, prog,
                C.step_user(user), C.current_phase(), int(flops), C.current_scope(), alias, saves, extra)
    return step


def _views(prog: Program) -> bool:
    """Whether the kernel's result is its operand's blocks seen anew (nothing moved, cut, padded or reduced)."""
    p = prog.preps[0]
    return p.direct and not p.local and prog.post is None and not prog.padded


def _residual_record(op: OpDef, params: tuple, out: Any, uses: list, keep: tuple | None) -> tuple[tuple, int]:
    """What the op's link keeps for the backward pass (serials), and the bytes per device it keeps besides."""
    if keep is None or keep[2] is None:
        return (), 0
    args, _, keep_out, regather = keep
    kept = [serial(a) for a in args if isinstance(a, Value) and a._serial is not None]  # (husks: None)
    kept += [serial(src) for _, src, _ in regather]
    if keep_out is not HUSK:
        kept.append(serial(out))
    saves = tuple(dict.fromkeys(k for k in kept if k))
    extra = 0
    if op.saved_extra is not None:
        blocks = tuple(chunks(u.dst, u.shape) if isinstance(u.dst, ShardingSpec) else u.shape for u in uses)
        out_block = chunks(out._spec, out._shape) if isinstance(out._spec, ShardingSpec) else out._shape
        extra = int(op.saved_extra(blocks, out_block, params))
    return saves, extra


def _sum_now(op: OpDef, a: Value) -> None:
    """Make ``a``'s pending sum before ``op`` (remembered on ``a``: later uses reuse it), and log the move."""
    target = strip_partial(a._spec)
    plan = reshard.plan(a._shape, a._dtype.itemsize, a._spec, target)
    _, reused = _move(a, plan, target.layout(), backends.holding(a._data))
    if not reused:  # (a sum made before is only read: no step)
        publish_move(a, target, plan, op.name)


def record_step(op: Any, params: tuple, args: Sequence[Any], out: Value, events: tuple = (), prog: Any = None,
                named: bool = False, tape: bool = False) -> None:
    """Publish the step of an op the executor did not plan (per-device code, ``nb.lax`` collectives, values
    crossing into and out of ``nb.shard_map``, a compiled call): each operand read as it is, ``events`` its moves
    (``named``: already stamped with the op and phase each ran for, as a compiled call's are); with ``tape``,
    ``out`` is linked to it on the tape."""
    step = None
    if C.logging():
        name = op if isinstance(op, str) else getattr(op, "name", str(op))
        user = C.current_op() or name
        uses = tuple([read(a) for a in args])
        if events and uses:
            uses = (uses[0]._replace(events=events if named else tuple(C.stamped(e, user) for e in events)),) + \
                uses[1:]
        step = Step(op, params, uses, serial(out), out._shape, out._dtype, out._spec, prog=prog,
                    user=C.step_user(user), phase=C.current_phase(), layer=C.current_scope())
    if tape:
        link(out, entry(op, params, tuple(args), prog=prog, step=step))
    if step is not None:
        C.publish(step, [(u.value, a) for u, a in zip(step.uses, args)] + [(serial(out), out)])


def publish_move(v: Value, target: Any, plan: Any, op: str) -> None:
    """The step of a value brought to another layout for later uses (a pending sum made once), carrying the plan
    it ran (readers lower or price it as it is, never planning it again)."""
    if not C.logging():
        return
    user = C.current_op() or op
    s = serial(v)
    use = Use(s, v._shape, v._dtype, v._spec, target, tuple(C.stamped(e, user) for e in plan.events))
    C.publish(Step(MOVE, (target,), (use,), s, v._shape, v._dtype, target, prog=plan, user=C.step_user(user),
                   phase=C.current_phase(), layer=C.current_scope()),
              [(s, v)])


def _run(op: OpDef, args: Sequence[Any], params: tuple, make: Callable, sink: list | None, moved: list | None = None
         ) -> tuple[Any, Program | None]:
    sids = tuple([a._sid if isinstance(a, Value) and a._sid >= 0 else sid_of(a) for a in args])
    strat, model = current_strategy(), current_cost_model()
    epoch = C.epoch()
    try:
        prog = program_for(op, sids, params, strat, model, STRICT.get(), epoch)
    except StaleSignature:  # the intern table was emptied since these values got their ids
        sids = tuple(a.signature_id(lambda a=a: sig_id(signature(a)), stale=True) if isinstance(a, Value) else
                     sid_of(a) for a in args)
        prog = program_for(op, sids, params, strat, model, STRICT.get(), epoch)
    if prog is None:
        return _run_host(op, args, params, make), None
    if prog is MANUAL:
        return manual_run(op, args, params, make), MANUAL
    if prog.checks and breaks_linearity(prog.checks, args):
        prog = program_for(op, sids, params, strat, model, True, epoch)
    kernel = prog.kernel
    if kernel is not None and backends.active() is backends.NUMPY and \
            all(type(a._data) is np.ndarray for a, view in zip(args, kernel.chains) if view is not False):
        return make(kernel.call([a._data if isinstance(a, Value) else a for a in args]), prog.result,
                    prog.result_shape, prog.dtype, prog.result_sid), prog
    be = backends.active()
    for a in args:
        if isinstance(a, Value):
            d = a._data
            if d is None:
                be = backends.SHAPES  # abstract: plan and log, compute nothing
                break
            if be is backends.NUMPY and type(d) is not np.ndarray:
                be = backends.of(d)
    arrays = [(a._data if p.view is None else _view(a._data, p.view))
              if p.direct and (be is backends.NUMPY or not p.plan.segments and be is not backends.SHAPES)
              else _prepare(a, p, prog, op, be, sink, i, moved) for i, (a, p) in enumerate(zip(args, prog.preps))]
    out = be.commit(be.kernel(op, arrays, prog), prog.result)
    if prog.post is not None and sink is not None:
        sink[-1] = prog.post.events
    return make(out, prog.result, prog.result_shape, prog.dtype, prog.result_sid), prog


def _prepare(a: Any, p: Prep, prog: Program, op: OpDef, be, sink: list | None, i: int, moved: list | None = None
             ) -> Any:
    local_events = p.local_events
    if p.kind == "scalar":
        if not p.mask_axes:
            return a
        a = Value(np.asarray(a, dtype=prog.dtype), None, (), prog.dtype)
        p = p._replace(kind="host")
    if p.kind == "sharded":
        cache = gathered_copy(a) if p.gathers else None
        x, reused = _move(a, p.plan, p.target, be, cache)
        if sink is not None:
            sink[i] = (() if reused else p.events, reused, local_events, cache is not None and not reused)
        if moved is not None and not reused and p.gathers:
            moved.append((i, x, p.target))  # (a recompute's gathered operand: its backward pass reads it)
    else:
        if sink is not None and local_events:
            sink[i] = ((), False, local_events, False)
        # a host value joining blocks on devices goes to the devices that own them
        x = be.place(a._data, p.target)
    return ready(x, p, be)


def ready(x: Any, p: Prep, be: backends.Backend) -> Any:
    """An operand's blocks, moved (or placed), as the kernel takes them: added once where it joins a partial
    sum, on the kernel's grid, through its factor kinds' local steps. Eager dispatch and ``nb.jit`` both run
    this; only the backend differs (every device's blocks, or one device's)."""
    if p.mask_axes:
        x = be.add_once(x, p.target, p.mask_axes, p.zero)
    x = be.regrid(x, p.grid_shape)
    for step in p.local:
        x = be.local(step, x)
    return x


def _move(v: Value, plan: reshard.Plan, target: ShardingSpec, be, cache: str | None = None) -> tuple[Any, bool]:
    """Carry out ``plan`` on ``v``'s blocks; a partial value's summed layouts (and, given ``cache``, the gathered
    copy a traced value keeps: ``trace.gathered_copy``) are remembered on the value, so a later use in the same
    layout reuses them (then the second result is True: nothing moved)."""
    if not plan.segments:
        return v._data, False
    key = target.layout() if not cache else (target.layout(), cache)
    keeps = v._spec.partial_axes or cache is not None
    if keeps and v._moved and key in v._moved:
        return v._moved[key], True
    x = be.move(v._data, plan, v._shape)
    if be is not backends.NUMPY:  # blocks that moved go to the devices that own them
        x = be.commit(x, target)
    if keeps:
        v.keep_sum(key, x)
    return x, False


def _view(x: Any, chain: tuple) -> Any:
    for kind, arg in chain:
        x = x.reshape(arg) if kind == "reshape" else x.transpose(arg)
    return x


def _rerun_strict(op: OpDef, args: Sequence[Any], params: tuple, make: Callable, sink: list | None
                  ) -> tuple[Any, Any]:
    """Redo an op with every pending sum made first (the strict program); what it gives is numpy's value."""
    with setting(STRICT, True):
        return _run(op, args, params, make, sink)


def _run_host(op: OpDef, args: Sequence[Any], params: tuple, make: Callable) -> Any:
    shapes = tuple(a._shape if isinstance(a, Value) else () for a in args)
    rule = op.rule(shapes, *params)  # validates shapes and gives the result shape
    shape = rule.result_shape
    if any(isinstance(a, Value) and a._data is None for a in args):
        sigs = tuple(signature(a) for a in args)
        return make(None, None, shape, result_dtype(op, sigs, params))
    arrays = [a._data if isinstance(a, Value) else a for a in args]
    out = np.asarray(op.kernel(arrays, Local(0, shape, params)))
    if out.shape != shape:
        raise ShardingError(f"internal: {op.name} kernel gave shape {out.shape}, rule says {shape}")
    if op.dtype != "sample":  # a dtype rule of its own (a bf16 matmul is bf16, whatever its kernel computes in)
        dt = result_dtype(op, tuple(signature(a) for a in args), params)
        if out.dtype != dt:
            out = out.astype(dt)
    if out.flags.writeable:
        out.flags.writeable = False
    return make(out, None, shape, out.dtype)


# ---- explicit relayout -----------------------------------------------------------------------------


def relayout(v: Value, target: ShardingSpec, make: Callable = Value) -> Any:
    """``with_sharding``: move stored blocks from their spec to ``target`` with planned collectives."""
    p = reshard.plan(v._shape, v._dtype.itemsize, v._spec, target)
    be = backends.holding(v._data)
    out, reused = _move(v, p, target.layout(), be)
    out = be.commit(out, target)
    res = make(out, target, v._shape, v._dtype, -1)
    step = None
    if C.logging():
        user = C.current_op() or RELAYOUT_STEP
        events = () if reused else tuple(C.stamped(e, user) for e in p.events)
        use = Use(serial(v), v._shape, v._dtype, v._spec, target, events, reused)
        alias = use.value if not p.segments else 0  # laid out as it was: the same blocks
        step = Step(RELAYOUT_STEP, (target,), (use,), serial(res), res._shape, res._dtype, target, (), p,
                    C.step_user(user), C.current_phase(), 0, C.current_scope(), alias)
    if tracked((v,)):
        link(res, entry(RELAYOUT_STEP, (target,), (v,), prog=p, step=step))
    if step is not None:
        C.publish(step, [(serial(v), v), (serial(res), res)])
    return res


def relayout_bucket(values: Sequence[Value], targets: Sequence[ShardingSpec], make: Callable = Value) -> list:
    """Several values laid out anew by one all_reduce over the same mesh axes (a bucket of gradients, as DDP
    fuses them into a flat buffer): each value's plan must be that one all_reduce; one step, one collective of
    their blocks' total bytes."""
    plans = [reshard.plan(v._shape, v._dtype.itemsize, v._spec, t) for v, t in zip(values, targets)]
    kinds = {tuple((s.kind, s.axes, s.group) for s in p.collectives) for p in plans}
    if len(kinds) != 1 or len(next(iter(kinds))) != 1 or next(iter(kinds))[0][0] != "all_reduce":
        raise ShardingError(f"bucket: every value must be summed by one all_reduce over the same axes; the plans "
                            f"are {[p.events for p in plans]}")
    (_, axes, group), = next(iter(kinds))
    outs, block = [], 0
    be = backends.holding(values[0]._data)
    summed = be.bucket(C.REGISTRY["bucket"], [v._data for v in values], tuple(plans), [v._shape for v in values])
    for v, t, x in zip(values, targets, summed):
        out = be.commit(x, t)
        v.keep_sum(t.layout(), out)  # a partial value's sum, made once (as ``_move`` keeps it)
        outs.append(make(out, t, v._shape, v._dtype))
        block += prod(chunks(ShardingSpec(t.mesh, t.dim_specs), v._shape)) * v._dtype.itemsize
    if C.logging():
        user = C.current_op() or BUCKET
        event = C.stamped(C.event("bucket", axes, block, group), user)
        uses = tuple(Use(serial(v), v._shape, v._dtype, v._spec, t) for v, t in zip(values, targets))
        first = outs[0]
        C.publish(Step(BUCKET, (tuple(targets), tuple(serial(o) for o in outs)), uses, serial(first), first._shape,
                       first._dtype, first._spec, (event,), tuple(plans), C.step_user(user), C.current_phase(), 0,
                       C.current_scope()), [(u.value, v) for u, v in zip(uses, values)] +
                  [(serial(o), o) for o in outs])
    return outs


def place(v: Value, spec: ShardingSpec, make: Callable = Value) -> Any:
    """``shard`` of a host value: each device keeps its block of it (no communication)."""
    data = (backends.SHAPES if v._data is None else backends.active()).place(v._data, spec)
    res = make(data, spec, v._shape, v._dtype, -1)
    step = None
    if C.logging():
        use = Use(serial(v), v._shape, v._dtype, v._spec, spec)
        step = Step(PLACE_STEP, (spec,), (use,), serial(res), res._shape, res._dtype, spec,
                    user=C.step_user(C.current_op() or PLACE_STEP), phase=C.current_phase(), layer=C.current_scope())
    if tracked((v,)):
        link(res, entry(PLACE_STEP, (spec,), (v,), step=step))
    if step is not None:
        C.publish(step, [(serial(v), v), (serial(res), res)])
    return res
