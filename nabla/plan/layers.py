"""A recorded program seen as layers: forward steps cut into segments (per ``nb.named_scope`` label or repeated
step signatures), identical segments one class, dims joined into classes through each op's factors, and a
segment replayed (forward, and backward through ``nb.vjp``) under other layouts of its inputs."""

from __future__ import annotations

from collections import Counter
from itertools import combinations
from math import prod
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .. import collectives as C
from ..autodiff import vjp
from ..dtypes import is_inexact
from ..ops.core import apply
from ..spec import ShardingSpec
from ..step import MOVE, PLACE, RELAYOUT
from ..value import serial
from ..tensor import Tensor
from .estimate import priced_step
from .memory import memory_log
from .steps import PricedStep


class Stop(Exception):
    """Raised by a recorder told to stop at the backward pass (the forward program is recorded by then)."""


class Recorder:
    """Keeps every published step and what the program said its values are (params, grads, optimizer);
    ``stop_at_backward``: ends the run (``Stop``) at the first backward step, noting that there was one."""

    def __init__(self, stop_at_backward: bool = False) -> None:
        self.steps: list = []
        self.tags: dict[int, str] = {}
        self.stop = stop_at_backward

    def take(self, step: Any, values: Sequence = ()) -> None:
        self.steps.append(step)
        if self.stop and step.phase == "backward":
            raise Stop

    def tag(self, value: Any, kind: str) -> None:
        self.tags[serial(value)] = kind


class Segment(NamedTuple):
    label: str
    steps: tuple  # the forward steps (moves the executor made on its own left out)
    inputs: tuple[int, ...]  # serials read from outside, in order of first use
    outputs: tuple[int, ...]  # indices of steps whose result is read after the segment (or is the program's)
    signature: tuple


class LayerClass(NamedTuple):
    """Identical segments (``instances``, in program order). Input ``e`` of the class is a parameter
    (``params[e]`` is True: an argument leaf in every instance) or a value flowing in (an activation)."""

    instances: tuple[Segment, ...]
    params: tuple[bool, ...]
    dims: tuple[tuple[int, ...], ...]  # per input, the dim class of each of its dims
    out_dims: tuple[tuple[int, ...], ...]  # per output, likewise
    compatible: frozenset  # pairs of dim classes no value of the segment has both of

    @property
    def rep(self) -> Segment:
        return self.instances[0]

    @property
    def label(self) -> str:
        return self.rep.label


def forward_program(steps: Sequence, leaves: set[int] | frozenset = frozenset()) -> tuple[list, bool]:
    """The forward steps before the first backward step (moves and recomputation left out), and whether a
    backward pass follows. Given the arguments' serials, steps after the last one that depends on an argument
    (the backward pass's seed, a constant) are left out."""
    out, train = [], False
    for s in steps:
        if s.phase == "backward":
            train = True
            break
        if s.phase == "forward" and s.op != MOVE:
            out.append(s)
    if leaves:
        live = set(leaves)
        last = -1
        for i, s in enumerate(out):
            if any(u.value in live for u in s.uses):
                live.add(s.out)
                last = i
        out = out[:last + 1]
    return out, train


def _signature(steps: Sequence, outputs: Sequence[int], inputs: list[int]) -> tuple:
    made = {s.out: k for k, s in enumerate(steps)}
    ext: dict[int, int] = {}
    sig = []
    for k, s in enumerate(steps):
        uses = []
        for u in s.uses:
            if u.value == 0:
                uses.append(("c", repr(u.const)))
            elif u.value in made and made[u.value] < k:
                uses.append(("i", made[u.value]))
            else:
                if u.value not in ext:
                    ext[u.value] = len(ext)
                    inputs.append(u.value)
                uses.append(("x", ext[u.value], u.shape, str(u.dtype)))
        sig.append((s.name, repr(s.params), s.out_shape, str(s.out_dtype), tuple(uses)))
    return tuple(sig) + (tuple(outputs),)


def segments(steps: Sequence, final: int | None = None) -> list[Segment]:
    """Cut the forward ``steps`` into segments: runs of one ``layer`` label; without labels, repeated runs of
    identical step signatures (one segment per repeat)."""
    if not steps:
        return []
    runs: list[tuple[str, list]] = []
    for s in steps:
        if runs and runs[-1][0] == (s.layer or ""):
            runs[-1][1].append(s)
        else:
            runs.append((s.layer or "", [s]))
    if len(runs) == 1 and not runs[0][0]:
        runs = _repeats(list(steps))
    readers: dict[int, int] = {}  # serial -> the last segment reading it
    for i, (_, st) in enumerate(runs):
        for s in st:
            for u in s.uses:
                if u.value:
                    readers[u.value] = i
    out = []
    last = steps[-1].out if final is None else final
    for i, (label, st) in enumerate(runs):
        outputs = [k for k, s in enumerate(st) if readers.get(s.out, -1) > i or s.out == last]
        inputs: list[int] = []
        sig = _signature(st, outputs, inputs)
        out.append(Segment(label, tuple(st), tuple(inputs), tuple(outputs), sig))
    return out


def _repeats(steps: list) -> list[tuple[str, list]]:
    """Unlabelled steps: the longest stretch made of one block of steps repeated (period ``p``, at least twice),
    each repeat its own segment ``"block i"``; what comes before and after are segments of their own. Periods
    tried: the commonest distances between repeats of one step signature."""
    keys = [(s.name, repr(s.params), s.out_shape) for s in steps]
    n = len(keys)
    last: dict = {}
    gaps: Counter = Counter()
    for i, k in enumerate(keys):
        if k in last:
            gaps[i - last[k]] += 1
        last[k] = i
    best = None  # (covered, start, period, repeats)
    for p, _ in gaps.most_common(8):
        run = 0
        for i in range(n - p + 1):
            if i < n - p and keys[i] == keys[i + p]:
                run += 1
                continue
            reps = (run + p) // p
            if reps >= 2 and (best is None or reps * p > best[0]):
                best = (reps * p, i - run, p, reps)
            run = 0
    if best is None:
        return [("", steps)]
    _, start, p, reps = best
    out = [("", steps[:start])] if start else []
    out += [(f"block {i}", steps[start + i * p:start + (i + 1) * p]) for i in range(reps)]
    if start + reps * p < n:
        out.append(("", steps[start + reps * p:]))
    return out


def classes(segs: Sequence[Segment], leaves: dict[int, int]) -> list[LayerClass]:
    """Group identical segments; ``leaves`` maps the serials of the program's argument leaves to their index."""
    groups: dict[tuple, list[Segment]] = {}
    for s in segs:
        groups.setdefault(s.signature, []).append(s)
    out = []
    for insts in groups.values():
        rep = insts[0]
        params = tuple(all(inst.inputs[e] in leaves for inst in insts[1:]) and rep.inputs[e] in leaves
                       if len(insts) > 1 else rep.inputs[e] in leaves for e in range(len(rep.inputs)))
        dims, out_dims, compat = _dim_classes(rep)
        out.append(LayerClass(tuple(insts), params, dims, out_dims, compat))
    out.sort(key=lambda c: segs.index(c.rep))
    return out


def _dim_classes(seg: Segment):
    """Per input and per output of a segment, the dim class of each dim, and the pairs of classes no value of the
    segment has both of."""
    root, shapes = _joined(seg.steps)
    ids: dict = {}

    def cid(v, d):
        return ids.setdefault(root(v, d), len(ids))

    dims = tuple(tuple(cid(v, d) for d in range(len(shapes.get(v, ())))) for v in seg.inputs)
    out_dims = tuple(tuple(cid(seg.steps[k].out, d) for d in range(len(seg.steps[k].out_shape))) for k in seg.outputs)
    together = set()
    for v, shape in shapes.items():
        cs = {cid(v, d) for d in range(len(shape))}
        together.update(frozenset(p) for p in combinations(sorted(cs), 2))
    n = len(ids)
    compat = frozenset(frozenset(p) for p in combinations(range(n), 2) if frozenset(p) not in together)
    return dims, out_dims, compat


def value_dims(steps: Sequence) -> dict[int, tuple[int, ...]]:
    """Per value the ``steps`` read or make (by serial), the program-wide dim class of each of its dims: what joins
    a batch of token ids to the targets and the logits through the ops between them."""
    root, shapes = _joined(steps)
    ids: dict = {}
    return {v: tuple(ids.setdefault(root(v, d), len(ids)) for d in range(len(shape))) for v, shape in shapes.items()}


def _joined(steps: Sequence):
    """Union the dims of the values ``steps`` read and make that one factor of some op runs through (a relayout
    joins a value's dims to its copy's; a reshape's merged dim joins its major part). Returns ``root(value, dim)``
    (one key per class) and each value's shape, values named by serial."""
    parent: dict = {}

    def find(a):
        while parent.setdefault(a, a) != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb

    shapes: dict = {}
    for k, s in enumerate(steps):
        shapes[s.out] = s.out_shape
        for d in range(len(s.out_shape)):
            find((s.out, d))
        for u in s.uses:
            if u.value:
                shapes.setdefault(u.value, u.shape)
                for d in range(len(u.shape)):
                    find((u.value, d))
        if isinstance(s.op, str):  # a relayout or placement: the same value, dim for dim
            for u in s.uses:
                if u.value:
                    for d in range(len(s.out_shape)):
                        union((u.value, d), (s.out, d))
            continue
        try:
            rule = s.op.rule(tuple(u.shape if u.value else () for u in s.uses), *s.params)
        except Exception:  # noqa: BLE001 - an op whose rule cannot be rebuilt joins nothing
            continue
        for u, dims in zip(s.uses, rule.operands):
            if not u.value:
                continue
            for d, fs in enumerate(dims):
                if fs and d < len(u.shape):
                    union((u.value, d), ("f", k, fs[0]))
        for d, fs in enumerate(rule.result):
            if fs:
                union((s.out, d), ("f", k, fs[0]))
    return (lambda v, d: find((v, d))), shapes


def without_partial(spec: Any) -> Any:
    """``spec`` with its pending sums made (the layout a sum of the partial values is in)."""
    if spec is None or not getattr(spec, "partial_axes", ()):
        return spec
    return ShardingSpec(spec.mesh, spec.dim_specs, spec.replicated_axes)


class Replayed(NamedTuple):
    steps: tuple  # what the replay recorded (forward and backward)
    outputs: tuple  # each output's layout (partial axes included)
    memory: Any  # the memory log of the replay
    gradients: tuple  # per input, the layout of its gradient (None: not differentiated)
    raw: tuple  # per input, (layout, itemsize) of its gradient as the backward pass leaves it (None: as finished)
    steps_all: tuple  # every recorded step, in the order the memory log's timeline follows
    names: tuple = ()  # the values the steps call (ins, outs, cotangents, input gradients): per input, output,
    # output and input, its serial (0: none), so that layers laid end to end hand them over (``renamed``)


def replay(cls: LayerClass, layouts: Sequence[Any], shapes: Sequence[tuple], dtypes: Sequence[Any],
           diff: Sequence[bool], train: bool, cotangents: Sequence[Any] | None = None,
           params_: Sequence[bool] | None = None) -> Replayed:
    """Run one instance of ``cls`` on data-free inputs laid out as ``layouts`` (one per input; ``None`` for a host
    value), forward, and (``train``) backward from cotangents laid out as ``cotangents`` (default: as the outputs
    are, without partial sums), differentiating the inputs marked ``diff``. Every op is the recorded one with its
    recorded params: the executor plans it anew."""
    rep = cls.rep
    made = {s.out: k for k, s in enumerate(rep.steps)}
    ext = {v: e for e, v in enumerate(rep.inputs)}
    inputs = [Tensor(None, lay, tuple(sh), np.dtype(dt)) for lay, sh, dt in zip(layouts, shapes, dtypes)]
    params_ = params_ if params_ is not None else cls.params
    reach = _reaching(rep)
    which = [e for e in range(len(inputs)) if train and diff[e] and is_inexact(inputs[e].dtype) and reach[e]]

    seen: dict[str, list] = {}

    def run(*xs):
        given = list(inputs)
        for e, x in zip(which, xs):
            given[e] = x
        seen["ins"] = [serial(x) if isinstance(x, Tensor) else 0 for x in given]
        env: dict[int, Any] = {}
        for k, s in enumerate(rep.steps):
            args = []
            for u in s.uses:
                if u.value == 0:
                    args.append(u.const)
                elif u.value in made and made[u.value] < k:
                    args.append(env[made[u.value]])
                else:
                    args.append(given[ext[u.value]])
            if s.op == RELAYOUT:
                out = args[0].with_sharding(s.params[0])
            elif s.op == PLACE:
                out = args[0].shard(s.params[0]) if args[0].sharding is None else args[0]
            else:
                with C.user_op(s.user or s.name):
                    out = apply(s.op, args, s.params)
            env[k] = out
        seen["outs"] = [serial(env[k]) for k in rep.outputs]
        return tuple(env[k] for k in rep.outputs)

    grads: list[Any] = [None] * len(inputs)
    cts: list = []
    gouts = [0] * len(inputs)
    with C.comm_log() as log, memory_log() as mem:
        if which:
            outs, back = vjp(run, *[inputs[e] for e in which])
            cts = [Tensor(None, (cotangents[j] if cotangents is not None and cotangents[j] is not None else
                                 without_partial(o.sharding)), o.shape, o.dtype) for j, o in enumerate(outs)]
            for e, g in zip(which, back(tuple(cts))):
                grads[e] = getattr(g, "sharding", None)
                gouts[e] = serial(g) if isinstance(g, Tensor) else 0
        else:
            outs = run()
    # An activation's gradient goes on to the layer before as it comes: the moves that lay it out as its input
    # (what vjp does for a primal) are no steps of the program, and its layout before them is the gradient's; the
    # sums of its cotangents from several readers (also logged as "grad of" it) are steps of the program.
    label = {f"grad of xs[{i}]": e for i, e in enumerate(which)}
    kept, raw = [], {}
    for st in log.steps:
        e = label.get(str(st.user))
        moved = e is not None and not params_[e] and isinstance(st.op, str)
        if e is not None and e not in raw and st.uses and st.uses[0].src is not None and (params_[e] or moved):
            raw[e] = (st.uses[0].src, st.uses[0].dtype.itemsize)
            if moved:
                gouts[e] = st.uses[0].value  # the gradient as it goes on, before the relayout left out
        if not moved:  # a sum of an activation's cotangents is the backward pass's, not a gradient reduction
            kept.append(st._replace(user="gradient of an input") if e is not None and not params_[e] else st)
    for e in which:
        if not params_[e] and e in raw:
            grads[e] = raw[e][0]
    names = (tuple(seen.get("ins", ())), tuple(seen.get("outs", ())), tuple(serial(c) for c in cts), tuple(gouts))
    return Replayed(tuple(kept), tuple(o.sharding for o in outs), mem, tuple(grads),
                    tuple(raw.get(e) for e in range(len(inputs))), tuple(log.steps), names)


class Settled(NamedTuple):
    """A replay as the search keeps it once priced: what it hands on (``Replayed``'s), its steps as the estimator
    reads them and their time, and bytes per device: the most saved for the backward pass, the peak, and the
    most of parameters, gradients and saved values together."""

    outputs: tuple
    gradients: tuple
    names: tuple
    steps: tuple
    time: float
    saved: int
    peak: int
    base: int


class Replays:
    """``replay``, remembered once priced (``settled``): a repeated layer's candidates often settle into one
    steady state, the same layouts in and the same cotangents back (52 of the 557 priced replays of Llama 2-70B's
    search on 64 devices were repeats). Only what pricing reads is kept, not the replay's records."""

    def __init__(self, time: Callable[[tuple], float]) -> None:
        self.time, self.done, self.latest = time, {}, None  # time: priced steps -> seconds

    def __call__(self, cls: LayerClass, layouts: Sequence[Any], shapes: Sequence[tuple], dtypes: Sequence[Any],
                 diff: Sequence[bool], train: bool, cotangents: Sequence[Any] | None = None,
                 params_: Sequence[bool] | None = None) -> Replayed | Settled:
        key = (id(cls), tuple(layouts), tuple(shapes), tuple(dtypes), tuple(diff), train,
               None if cotangents is None else tuple(cotangents), None if params_ is None else tuple(params_))
        got = self.done.get(key)  # (``cls`` is held by whoever holds this: its id is not reused)
        if got is None:
            got = replay(cls, layouts, shapes, dtypes, diff, train, cotangents, params_)
            self.latest = (key, got)
        return got

    def settled(self, r: Replayed | Settled) -> Settled:
        """``r``, the latest replay this gave, priced (and remembered for its inputs)."""
        if isinstance(r, Settled):
            return r
        key, latest = self.latest
        if latest is not r:
            raise ValueError("Replays.settled: not the latest replay")
        steps = tuple(priced_step(s) for s in r.steps)
        by, peak = r.memory.by_kind, max(r.memory.peak.values(), default=0)
        base = sum(max(by.get(k, {}).values(), default=0) for k in ("params", "grads", "activations"))
        got = self.done[key] = Settled(r.outputs, r.gradients, r.names, steps, self.time(steps),
                                       max(by.get("activations", {}).values(), default=0), peak, base)
        self.latest = None
        return got


def _reaching(seg: Segment) -> list[bool]:
    """Per input, whether some output depends on it (only those get a gradient: a zero one would be real)."""
    need = {seg.steps[k].out for k in seg.outputs}
    for s in reversed(seg.steps):
        if s.out in need:
            need.update(u.value for u in s.uses if u.value)
    return [v in need for v in seg.inputs]


def block_bytes(spec: Any, shape: Sequence[int], itemsize: int) -> int:
    """Bytes of the largest block of a value laid out as ``spec`` (the ceil rule)."""
    if spec is None:
        return prod(shape) * itemsize
    return prod(-(-n // spec.num_shards(d)) for d, n in enumerate(shape)) * itemsize


def renamed(steps: Sequence, fresh: Any, label: str | None, names: dict[int, int] | None = None) -> list:
    """One instance's copy of a replay's priced steps: its values under names of their own (fusion reads a value's
    last reader by name: two instances sharing names would look like one value read far ahead; the schedule starts
    a collective when the value it moves is made), those in ``names`` under the names given (what the layer before
    hands over, what the layer after hands back), and its label."""
    names = {} if names is None else names

    def name(v: int) -> int:
        if not v:
            return v
        if v not in names:
            names[v] = next(fresh)
        return names[v]

    # (each made as a tuple, its fields by position: ``_replace`` costs three times as much, 10,000 steps a time)
    return [PricedStep._make(x[:_LAYER] + (label, tuple([(name(v), b) for v, b in x.reads]), name(x.out)) +
                             x[_LAYER + 3:-1] + (tuple([name(v) for v in x.moves]),)) for x in steps]


#: where ``renamed`` puts a step's label, reads and value (three fields in a row) and its moves (the last field)
_LAYER = PricedStep._fields.index("layer")
assert PricedStep._fields[_LAYER:_LAYER + 3] == ("layer", "reads", "out") and PricedStep._fields[-1] == "moves"
