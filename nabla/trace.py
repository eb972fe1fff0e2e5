"""The record of what a computation ran: every op applied to a tracked value leaves a ``Node`` on its result
(the op, its params, its operands and the program the executor chose, plans included). Autodiff walks it
backward and ``nb.jit`` traces with it; ONNX export, like ``nb.explain``, reads the recorded steps (``step.py``)."""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Iterator, NamedTuple

from .collectives import _op as _user_op, _phase, _scope
from .dtypes import is_inexact
from .scoped import setting
from .value import serial

LEAF, RELAYOUT, PLACE = "leaf", "relayout", "place"


class _Record(NamedTuple):
    op: Any
    params: tuple
    args: tuple
    prog: Any
    settled: tuple
    user: str
    diff: bool
    scope: str
    out: Any
    regather: tuple


_swap: contextvars.ContextVar[dict | None] = contextvars.ContextVar("nabla_swap", default=None)

#: ``Node.out`` of an op whose VJP does not read its output: the backward pass hands it a data-free stand-in
HUSK = "husk"


class Node(_Record):
    """How a value was made: ``op`` is an OpDef, or LEAF (a traced input), RELAYOUT (``with_sharding``) or
    PLACE (a host value put on a mesh); ``args`` its operands (values or Python scalars); ``prog`` what the
    executor decided for it (its reshard plans and local steps), or the relayout's plan; ``settled``, per
    operand, the summed layout used instead of a partial operand whose sum an earlier use already paid;
    ``user``, the public op it ran for (``softmax`` for the max and sum inside it), read from the comm log's
    op name when the node is made, so a backward pass names its collectives after it; ``diff``, whether the
    value depends on one being differentiated (a traced twin that ``nb.jit`` or ``nb.explain`` follows is not:
    the backward pass computes no cotangent for it); ``out``, what the VJP reads as the op's output (None: the
    value itself; ``HUSK``: nothing, the op does not read it; else a twin sharing its blocks).

    Given the op's ``result``, a node keeps only the residuals its op declares (``OpDef.saves``): every other
    operand is held as a husk (its shape, layout and record, no data), so the backward pass keeps alive what JAX
    and PyTorch keep, no more, and a VJP reading anything else gets no data. Whole-program traces (``nb.jit``)
    keep everything: they read the values themselves; so do nodes whose VJP will be differentiated
    again (a gradient of a gradient). Under ``nb.checkpoint(fn, policy="regather")`` an operand kept that an
    all_gather made from a smaller value (sequence parallelism's gathered norm output) is kept as that smaller
    value and gathered again by the backward pass (``regather``: (operand index, source, layout)), as
    Megatron-LM does: one more all_gather for the gathered bytes."""

    __slots__ = ()

    def __new__(cls, op: Any, params: tuple = (), args: tuple = (), prog: Any = None, settled: tuple = (),
                user: str | None = None, diff: bool | None = None, result: Any = None, moved: list | None = None
                ) -> "Node":
        if user is None:
            user = _user_op.get()
            if user and _phase.get() == "backward" and not user.startswith("grad of"):
                user = f"gradient of {user}"  # a step of the backward pass of the public op ``user``
        swap = _swap.get()
        if swap is not None:  # nb.checkpoint's recompute: a value its function closes over reads as its twin
            args = tuple(swap.get(id(a), a) for a in args)
        if diff is None:
            diff = any(getattr(node_of(a), "diff", False) for a in args)
        out, regather = None, ()
        if result is not None and getattr(op, "saves", None) is not None:
            # (a node made inside a function differentiated twice is kept whole: the VJP an inner pass runs on
            # it is itself differentiated, through its operands and output)
            prune = not _whole.get() and _depth.get() <= 1
            if prune or _regather.get():
                args, out, regather = _residuals(op, params, args, result, prune, moved)
        return super().__new__(cls, op, params, args, prog, settled, user, diff, _scope.get(), out, regather)

    @property
    def name(self) -> str:
        """The op's name for people: the public op it ran for, else its own."""
        return self.user or getattr(self.op, "name", None) or str(self.op)


def _differentiated(a: Any) -> bool:
    node = node_of(a)
    return node is not None and node.diff and is_inexact(a._dtype)


def husk(v: Any) -> Any:
    """``v`` without its data: its shape, layout, dtype and record (a backward pass finds its node through it);
    reads of it name no recorded value."""
    return link(type(v)(None, v._spec, v._shape, v._dtype, serial=None), node_of(v))


def _residuals(op: Any, params: tuple, args: tuple, result: Any, prune: bool = True, moved: list | None = None
               ) -> tuple[tuple, Any, tuple]:
    """The operands as the node keeps them (husks where the VJP reads nothing, when ``prune``; an operand the op
    gathered, as gathered, when ``moved`` lists it), the output as the VJP reads it, and the kept operands to
    gather again in the backward pass."""
    diff = tuple(_differentiated(a) for a in args)
    if not any(diff):
        return args, None, ()
    keep, keep_out = op.residuals(diff, params)
    kept, regather = [], []
    for i, a in enumerate(args):
        if getattr(a, "_shape", None) is None:  # a Python scalar
            kept.append(a)
            continue
        got = next((m for m in moved or () if m[0] == i), None) if prune and i in keep else None
        if got is not None:  # kept as the op gathered it (a new value: a serial of its own)
            t = link(type(a)(got[1], got[2], a._shape, a._dtype), node_of(a))
            serial(t)
            kept.append(t)
        elif node_of(a) is not None and node_of(a).op == LEAF:
            kept.append(a)  # a leaf (its holder keeps it anyway, and ``.grad`` goes on it)
        elif i not in keep:
            # (a value whose own node kept everything is read by that node's VJP as its output: kept whole)
            n = node_of(a)
            whole = not prune or n is not None and n.out is None and getattr(n.op, "saves", None) is not None
            kept.append(a if whole else husk(a))
        else:
            src = _gathered_from(a) if _regather.get() else None
            if src is None:
                kept.append(_summed(a) if prune else a)
            else:
                kept.append(husk(a) if prune else a)
                regather.append((i, src, a._spec))
    if not prune:
        return args, None, tuple(regather)
    out = HUSK
    if keep_out:  # a twin sharing the result's blocks and serial (holding it holds no record: no cycle)
        out = type(result)(result._data, result._spec, result._shape, result._dtype, result._sid,
                           serial=serial(result), moved=result._moved)
    return tuple(kept), out, tuple(regather)


def _summed(a: Any) -> Any:
    """A pending sum the op had made of ``a`` (kept on it for later uses) is what the node keeps: the same value,
    summed, so the summands need not outlive the forward pass."""
    moved = a._moved
    if not moved or not a._spec.partial_axes:  # (a kept gathered copy stays on the value: read by later uses)
        return a
    for spec, data in moved.items():
        if not spec.partial_axes:
            return link(type(a)(data, spec, a._shape, a._dtype, serial=serial(a)), node_of(a))
    return a


def _gathered_from(a: Any) -> Any:
    """The value ``a`` was all_gathered from by ``with_sharding`` (nothing else moved), else None: keeping that
    smaller value and gathering again costs the backward pass one all_gather and saves the gathered bytes (what
    Megatron-LM's sequence parallelism does with a norm's output; FSDP keeps no gathered weight either)."""
    node = node_of(a)
    if node is None or node.op != RELAYOUT or not node.args:
        return None
    moves = getattr(node.prog, "collectives", None)
    if not moves or any(m.kind != "all_gather" for m in moves):
        return None
    return node.args[0]


LEAF_NODE = Node(LEAF)


class _Ref(weakref.ref):
    __slots__ = ("key",)


#: the tape: ``id`` of a value -> (a weak reference to it, its node). The node lives as long as its value does
#: (it holds the operands the VJP reads, and they their own nodes): what the backward pass keeps alive is what the
#: values the program holds reach, as when the node was an attribute of its value
_LINKS: dict[int, tuple[_Ref, Node]] = {}


def _gone(r: _Ref, links: dict = _LINKS) -> None:
    got = links.get(r.key)
    if got is not None and got[0] is r:
        del links[r.key]


def link(v: Any, node: Node | None) -> Any:
    """Record that ``v`` was made as ``node`` says (nothing when ``node`` is None); returns ``v``."""
    if node is not None:
        r = _Ref(v, _gone)
        r.key = k = id(v)
        _LINKS[k] = (r, node)
    return v


def node_of(v: Any) -> Node | None:
    """How ``v`` was made, when it depends on a traced value (else None)."""
    got = _LINKS.get(id(v))
    return None if got is None else got[1]
_regather: contextvars.ContextVar[bool] = contextvars.ContextVar("nabla_regather", default=False)
_recording: contextvars.ContextVar[Any] = contextvars.ContextVar("nabla_recording", default=True)
_whole: contextvars.ContextVar[bool] = contextvars.ContextVar("nabla_trace_whole", default=False)
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("nabla_differentiating", default=0)


def recording() -> bool:
    return _recording.get()


def differentiated(v: Any) -> bool:
    """Whether ``v`` depends on a value being differentiated (an ``nb.grad``/``vjp`` argument, a ``.trace()``)."""
    node = node_of(v)
    return node is not None and node.diff and recording()


class Remat:
    """What ``nb.checkpoint`` keeps of a function's forward run: the outputs of its ``saved`` ops (matmuls under
    ``policy="save_matmuls"``), in the order they ran; ``replay`` hands them back, in order, to the recompute.
    ``gather``: set in the recompute, whose ops keep the operands they gathered (the backward pass that follows
    at once reads them: FSDP's weights are gathered once for both, as its pre-backward hook does)."""

    __slots__ = ("ops", "saved", "replay", "gather")

    def __init__(self, ops: frozenset) -> None:
        self.ops, self.saved, self.replay, self.gather = ops, [], None, False


_remat: contextvars.ContextVar[Remat | None] = contextvars.ContextVar("nabla_remat", default=None)


def remat(r: Remat | None) -> Any:
    return setting(_remat, r)


def gathered_copy(v: Any) -> str | None:
    """Where an op's gathered copy of ``v`` is kept on it for later uses in the same layout: None (not kept),
    "" (for every later use: the forward pass's and the backward pass's, as XLA keeps a forward all_gather's
    result for the transposed matmul) or the phase (``policy="regather"``: forward uses share one gather, the
    backward pass gathers once more, as Megatron-LM's sequence parallelism does). Only a traced value an op made
    keeps one: a parameter's gathered copy never is, nor that of a value made from parameters alone (a bf16 cast
    of a float32 weight: FSDP gathers each weight again), nor an untraced value's (nothing says when its later
    uses end)."""
    node = node_of(v)
    if node is None:  # untraced: kept only inside one imported program (nb.import_jax), not for its parameters
        state = _program.get()
        if state is None or id(v) in state[0]:
            return None
        state[1][id(v)] = v
    elif node.op == LEAF or _from_leaves(node, 4):
        return None
    return _phase.get() if _regather.get() else ""


_program: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("nabla_one_program", default=None)


@contextlib.contextmanager
def one_program(params: Any = ()) -> Iterator[None]:
    """Inside, an untraced value's gathered copy is kept for its later uses too, as one compiled program keeps
    it (XLA merges an all_gather the backward pass repeats), except those of ``params`` (gathered again, as FSDP
    does); the copies are dropped from the values when the program ends. Nested programs are the outer one."""
    if _program.get() is not None:
        yield
        return
    state: tuple = ({id(p) for p in params}, {})
    try:
        with setting(_program, state):
            yield
    finally:
        for v in state[1].values():
            v.drop_copies()


def _from_leaves(node: Node, depth: int) -> bool:
    """Whether ``node``'s value is made from traced inputs alone (within ``depth`` ops: casts, transposes)."""
    if depth == 0:
        return False
    seen = False
    for a in node.args:
        n = node_of(a)
        if n is None:
            if getattr(a, "_shape", None) is not None:  # an untraced tensor: data, not a parameter
                return False
            continue
        if n.op != LEAF and not _from_leaves(n, depth - 1):
            return False
        seen = True
    return seen


def regathering() -> Any:
    """Nodes made inside keep a gathered operand as the value it was gathered from (``policy="regather"``)."""
    return setting(_regather, True)


def recorded() -> Any:
    """Ops inside leave nodes, even inside a backward pass (a recompute differentiates what it runs)."""
    return setting(_recording, True)


def paused() -> Any:
    """Ops inside leave no nodes (a backward pass that does not need its own gradients), unless a whole
    program is being traced (``nb.jit`` compiles the backward pass too)."""
    return contextlib.nullcontext() if _whole.get() else setting(_recording, False)


def differentiating() -> Any:
    """Marks the forward run of a function being differentiated (``nb.vjp``'s ``f``): a backward pass run
    inside it (a gradient of a gradient) must record its own ops, for the outer pass to differentiate."""
    return setting(_depth, _depth.get() + 1)


def outer_live() -> bool:
    """Whether an enclosing differentiation is running, so a backward pass must be recorded, not paused."""
    return _depth.get() > 0 and _recording.get()


def tracing_whole() -> bool:
    return _whole.get()


_replay: contextvars.ContextVar[bool] = contextvars.ContextVar("nabla_replay", default=False)


def tracing_for_replay() -> bool:
    """Inside a trace that is run again on other values (``nb.jit``'s, ``nb.vmap``'s): a constant made here is
    part of that program and must hold data, even where the traced values are abstract stand-ins."""
    return _whole.get() or _replay.get()


def replay_trace() -> Any:
    """Mark a trace whose constants are replayed with data (``nb.vmap``'s)."""
    return setting(_replay, True)


def whole() -> Any:
    """Record everything inside, backward passes included."""
    return setting(_whole, True)


def tracked(args) -> bool:
    """Whether any operand carries a node, so the result must record one."""
    if not _LINKS:  # (nothing traced anywhere: the common case costs one test)
        return False
    for a in args:
        if id(a) in _LINKS:
            r = _recording.get()
            return r.saw(args) if type(r) is Watch else r
    return False


class Watch:
    """``nb.checkpoint``'s forward run: it records no nodes, but notes the differentiated values it reads that are
    not its arguments (tensors its function closes over), so that their gradients are not lost. Inside the run
    no value it makes carries a node, so any operand that does is an argument or comes from outside."""

    __slots__ = ("args", "seen")

    def __init__(self, args: Any) -> None:
        self.args = {id(a) for a in args}
        self.seen: dict = {}

    def __bool__(self) -> bool:  # as ``paused()`` for everything that asks whether ops are recorded
        return False

    def saw(self, args: Any) -> bool:
        for a in args:
            n = node_of(a)
            if n is not None and n.diff and id(a) not in self.args:
                self.seen.setdefault(id(a), a)
        return False


def watching(watch: Watch) -> Any:
    """Ops inside leave no nodes; ``watch`` notes the differentiated values they read from outside."""
    return contextlib.nullcontext(watch) if _whole.get() else setting(_recording, watch, watch)


def swapped(swap: dict) -> Any:
    """Nodes made inside read the value ``swap[id(v)]`` wherever an operand is ``v``."""
    return setting(_swap, swap or None)


def topological(outputs, stop=None, key=id) -> list:
    """Every tracked value the outputs depend on, operands before the values made from them; the operands
    of values whose ``key`` is in ``stop`` are not visited (a backward pass stops at its own leaves). ``key``
    names a value (``id``; a backward pass names values by their node, so a husk is the value it stands for)."""
    order, seen = [], set()
    stack = [(v, False) for v in outputs if id(v) in _LINKS]
    while stack:
        v, done = stack.pop()
        if done:
            order.append(v)
            continue
        k = key(v)
        if k in seen:
            continue
        seen.add(k)
        stack.append((v, True))
        if stop is not None and k in stop:
            continue
        for a in node_of(v).args:
            if id(a) in _LINKS and key(a) not in seen:
                stack.append((a, False))
    return order


def by_node(v: Any) -> int:
    """A value's name in a backward pass: its node (a husk and the value it stands for share it)."""
    return id(node_of(v))
