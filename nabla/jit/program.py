"""A traced function's recorded steps as a program of instructions, and the rewrites ``nb.jit`` makes on it:
a move made once per value and layout, duplicate ops merged, values that read no input data folded, dead code
dropped. Pure data (no jax): every move a rewrite removes is kept with its reason, and the compiled program's
comm log is read from the instructions left, never by subtracting events after the fact."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from .. import collectives as C
from ..errors import ShardingError
from ..program import MANUAL, Program
from ..value import Value
from ..spec import DimSpec, ShardingSpec
from ..step import BUCKET, MOVE, PLACE, RELAYOUT, Step
from .. import backends, interpret
from ..backends.grid import blocks_of

#: ``Step.op`` of a compiled call's results (published when a jitted function runs)
CALL = "jit_call"
#: the steps of values crossing into and out of ``nb.shard_map`` (a global value seen per device, and back)
SM_IN, SM_OUT = "shard_map_in", "shard_map_out"

Key = tuple  # (serial, layout): a value in one layout (layout None: a host value)


def layout(spec: Any) -> Any:
    """A value's placement as a key: the spec's layout, without mesh axes of size 1 (``[{"y"}, {}]`` on a mesh
    whose ``y`` has one device places the blocks as ``[{}, {}]`` does: moving a value to both is one move)."""
    if spec is None:
        return None
    lay = spec.layout()
    if not isinstance(lay, ShardingSpec) or not any(r.size == 1 for refs in lay.dim_refs for r in refs) and \
            not any(r.size == 1 for r in lay.partial_refs):
        return lay
    dims = [DimSpec(tuple(str(r) for r in refs if r.size > 1)) for refs in lay.dim_refs]
    partial = [a for a, r in zip(lay.partial_axes, lay.partial_refs) if r.size > 1]
    return ShardingSpec(lay.mesh, dims, (), partial)


class Instr(NamedTuple):
    """One instruction: ``kind`` is "move" (a value to another layout, by ``plan``), "kernel" (a planned op),
    "alias" (``with_sharding``'s result is the moved value), "place" (a host value cut on each device), "view"
    (into or out of shard_map), "manual" (an op or ``nb.lax`` collective on per-device values), "host" (an op on
    host values) or "call" (a compiled call); ``reads`` the keys it takes (None for a Python scalar), ``writes``
    the key it makes, ``events`` the moves it makes, ``use`` the operand a move is for."""

    kind: str
    step: Step
    reads: tuple
    writes: Key
    events: tuple = ()
    plan: Any = None
    use: int = -1
    more: tuple = ()  # further keys it makes (a bucket makes one per value it sums)


class Removed(NamedTuple):
    """A move the compiled program does not make, and why: "repeated" (the value was moved to that layout
    before), "duplicate" (the same op of the same operands was computed before), "dead" (nothing reads the
    result), "folded" (it reads no input data: computed while tracing, a constant of the program)."""

    event: Any
    reason: str
    step: Step


def instructions(steps: Sequence[Step]) -> list[Instr]:
    """The steps as instructions, in the order they ran."""
    out: list[Instr] = []
    for s in steps:
        if s.op in (MOVE, RELAYOUT):
            u = s.uses[0]
            src, dst = (u.value, layout(u.src)), (u.value, layout(u.dst))
            if not u.reused and src != dst:
                out += _hops(s, u, u.src, u.dst, s.prog, 0)  # (the plan the move ran, recorded with it)
            if s.op == RELAYOUT:
                out.append(Instr("alias", s, (dst,), (s.out, layout(s.out_spec))))
        elif s.op == BUCKET:
            targets, outs = s.params
            keys = tuple((o, layout(t)) for o, t in zip(outs, targets))
            out.append(Instr("bucket", s, tuple((u.value, layout(u.src)) for u in s.uses), keys[0], s.post, s.prog,
                             more=keys[1:]))
        elif s.op == PLACE:
            out.append(Instr("place", s, ((s.uses[0].value, None),), (s.out, layout(s.out_spec))))
        elif s.op in (SM_IN, SM_OUT):
            u = s.uses[0]
            out.append(Instr("view", s, ((u.value, layout(u.src)),), (s.out, layout(s.out_spec)), u.events))
        elif s.op == CALL:
            out.append(Instr("call", s, tuple((u.value, layout(u.src)) if u.value else None for u in s.uses),
                             (s.out, layout(s.out_spec)), s.events))
        elif s.prog is MANUAL or s.prog == "manual":
            out.append(Instr("manual", s, tuple((u.value, layout(u.src)) if u.value else None for u in s.uses),
                             (s.out, layout(s.out_spec)), tuple(e for u in s.uses for e in u.events)))
        elif s.prog is None:
            out.append(Instr("host", s, tuple((u.value, None) if u.value else None for u in s.uses),
                             (s.out, None)))
        elif isinstance(s.prog, Program):
            reads = []
            for i, (u, p) in enumerate(zip(s.uses, s.prog.preps)):
                if not u.value:
                    reads.append(None)
                    continue
                if p.kind != "sharded":
                    reads.append((u.value, None))
                    continue
                src, dst = (u.value, layout(u.src)), (u.value, layout(p.target))
                if not u.reused and src != dst:
                    out += _hops(s, u, u.src, p.target, p.plan, i)
                reads.append(dst)
            out.append(Instr("kernel", s, tuple(reads), (s.out, layout(s.out_spec)),
                             tuple(e for u in s.uses for e in u.inside) + tuple(s.post)))
        else:
            raise ShardingError(f"internal: jit cannot lower the recorded step {s.name!r}")
    return out


def _hops(s: Step, u: Any, src: Any, dst: Any, plan: Any, i: int) -> list[Instr]:
    """A move of several collectives as one move per collective, each writing the layout it reaches, when the
    planner found that planning each hop anew sends what the whole plan sends (``Plan.hops``): a later move to
    one of those layouts is then made once (XLA's CSE merges a collective a later move repeats). Otherwise the
    move as one instruction. Read from the plan the move ran: nothing is planned here."""
    hops = plan.hops
    if not hops or not isinstance(src, ShardingSpec) or len(u.events) != len(plan.events):
        return [Instr("move", s, ((u.value, layout(src)),), (u.value, layout(dst)), u.events, plan, i)]
    specs = [src] + [h.dst for h in hops[:-1]] + [dst]
    out, k = [], 0
    for a, b, h in zip(specs, specs[1:], hops):
        n = len(h.plan.events)
        out.append(Instr("move", s, ((u.value, layout(a)),), (u.value, layout(b)), u.events[k:k + n], h.plan, i))
        k += n
    return out


class Rewritten(NamedTuple):
    instrs: tuple[Instr, ...]
    removed: tuple[Removed, ...]
    consts: tuple[Key, ...]  # keys read that no instruction makes and no input is: constants of the program
    folded: dict  # key -> the value computed while tracing (a folded instruction's result)


def rewrite(instrs: Sequence[Instr], inputs: set, outputs: Sequence[Key], values: dict) -> Rewritten:
    """The rewrites, in order: moves made once, duplicate ops merged, folding, dead code (see the module)."""
    removed: list[Removed] = []
    alias: dict[Key, Key] = {}

    def canon(k):
        while k in alias:
            k = alias[k]
        return k

    made: set = set(inputs)
    kept: list[Instr] = []
    seen_ops: dict = {}
    for ins in instrs:
        ins = ins._replace(reads=tuple(None if r is None else canon(r) for r in ins.reads))
        if ins.kind == "move" and ins.reads[0][0] != ins.writes[0]:  # a move of a value merged with another
            alias[ins.writes] = (ins.reads[0][0], ins.writes[1])
            ins = ins._replace(writes=alias[ins.writes])
        if ins.kind == "move" and ins.writes in made:
            removed += [Removed(e, "repeated", ins.step) for e in ins.events]
            continue
        key = _op_key(ins)
        if key is not None and key in seen_ops:
            alias[ins.writes] = seen_ops[key]
            removed += [Removed(e, "duplicate", ins.step) for e in ins.events]
            continue
        if key is not None:
            seen_ops[key] = ins.writes
        made.add(ins.writes)
        made.update(ins.more)
        kept.append(ins)
    outputs = [canon(k) for k in outputs]
    kept, folded = _fold(kept, inputs, values, removed)
    live = set(outputs)
    order: list[Instr] = []
    for ins in reversed(kept):
        if ins.writes in live or any(k in live for k in ins.more):
            order.append(ins)
            live.update(r for r in ins.reads if r is not None)
        else:
            removed += [Removed(e, "dead", ins.step) for e in ins.events]
    order.reverse()
    written = {k for ins in order for k in (ins.writes,) + ins.more} | set(inputs)
    consts = []
    for k in list(outputs) + [r for ins in order for r in ins.reads if r is not None]:
        if k not in written and k not in consts:
            consts.append(k)
    for k in consts:
        if k not in folded and k[0] not in values:
            raise ShardingError(f"internal: jit found no value for {k}")
    return Rewritten(tuple(order), tuple(removed), tuple(consts), {k: v for k, v in folded.items() if k in consts})


def _op_key(ins: Instr) -> tuple | None:
    """What makes a kernel's result: the op, its params, its operands (as keys, or scalars) and the layout it is
    made in (None when it cannot be compared: unhashable params, or not a planned op)."""
    if ins.kind != "kernel":
        return None
    s = ins.step
    key = (id(s.op), s.params, tuple(r if r is not None else ("c", type(u.const), u.const)
                                     for r, u in zip(ins.reads, s.uses)), ins.writes[1])
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _fold(instrs: list[Instr], inputs: set, values: dict, removed: list) -> tuple[list[Instr], dict]:
    """Values with no elements, values made only from them, and a compiled call's results read no input data:
    XLA would fold them (collectives included), so they are computed here, on zeros, by the recorded steps run
    again as they ran (``interpret``, on the grid: nothing is propagated or planned), and enter the program as
    constants."""
    free: dict[Key, Value] = {}

    def empty(k) -> bool:
        v = values.get(k[0])
        return v is not None and 0 in v._shape

    def stand_in(k):
        if k in free:
            return free[k]
        v = values[k[0]]
        return _zeros_as(v, k[1]) if 0 in v._shape else v

    out = []
    for ins in instrs:
        reads = [r for r in ins.reads if r is not None]
        v = values.get(ins.writes[0])
        if ins.kind == "call":
            free[ins.writes] = v
        elif ins.kind == "bucket":
            out.append(ins)
            continue
        elif v is not None and 0 in v._shape:
            free[ins.writes] = _zeros_as(v, ins.writes[1])
        elif reads and all(r in free or empty(r) for r in reads) and ins.kind in interpret.JOBS:
            free[ins.writes] = _evaluate(ins, [None if r is None else stand_in(r) for r in ins.reads])
        else:
            out.append(ins)
            continue
        removed += [Removed(e, "folded", ins.step) for e in ins.events]
    return out, free


def _evaluate(ins: Instr, args: list) -> Value:
    """An instruction run on (zero-filled) values by the interpreter of recorded steps, on the backend holding
    them (an abstract value's data is None: so is the result's)."""
    s = ins.step
    shape, dtype = (s.uses[ins.use].shape, s.uses[ins.use].dtype) if ins.kind == "move" else \
        (s.out_shape, s.out_dtype)
    data = [a._data for a in args if a is not None]
    if any(d is None for d in data):
        return Value(None, ins.writes[1], shape, dtype)
    be = backends.of(*data)
    got = interpret.run(ins, [None if a is None else a._data for a in args], be)
    return Value(be.commit(got, ins.writes[1]), ins.writes[1], shape, dtype)


def _zeros_as(v: Value, lay: Any) -> Value:
    """A value of ``v``'s shape and dtype, laid out ``lay``, holding zeros (what a tensor without elements holds)."""
    import numpy as np

    data = np.zeros(v._shape, v._dtype)
    if lay is None:
        return Value(data, None, v._shape, v._dtype)
    return Value(blocks_of(data, lay), lay, v._shape, v._dtype)


def comm_log(rw: Rewritten) -> C.CommLog:
    """The compiled program's comm log: the moves of the instructions left, in order; ``removed`` lists the
    moves the rewrites took out, each with its reason."""
    log = C.CommLog()
    for ins in rw.instrs:
        log.events.extend(ins.events)
    log.removed = list(rw.removed)
    return log
