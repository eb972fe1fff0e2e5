"""The record of what a computation ran: every op applied to a tracked value leaves a ``Node`` on its result
(the op, its params, its operands and the program the executor chose, plans included). Autodiff walks it
backward, ``nb.jit`` replays it inside shard_map, ONNX export turns it into a graph: one record for all three."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, NamedTuple

from .collectives import _op as _user_op, _phase, _scope

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


_swap: contextvars.ContextVar[dict | None] = contextvars.ContextVar("nabla_swap", default=None)


class Node(_Record):
    """How a value was made: ``op`` is an OpDef, or LEAF (a traced input), RELAYOUT (``with_sharding``) or
    PLACE (a host value put on a mesh); ``args`` its operands (values or Python scalars); ``prog`` what the
    executor decided for it (its reshard plans and local steps), or the relayout's plan; ``settled``, per
    operand, the summed layout used instead of a partial operand whose sum an earlier use already paid;
    ``user``, the public op it ran for (``softmax`` for the max and sum inside it), read from the comm log's
    op name when the node is made, so a backward pass names its collectives after it; ``diff``, whether the
    value depends on one being differentiated (a traced twin that ``nb.jit`` or ``nb.explain`` follows is not:
    the backward pass computes no cotangent for it)."""

    __slots__ = ()

    def __new__(cls, op: Any, params: tuple = (), args: tuple = (), prog: Any = None, settled: tuple = (),
                user: str | None = None, diff: bool | None = None) -> "Node":
        if user is None:
            user = _user_op.get()
            if user and _phase.get() == "backward" and not user.startswith("grad of"):
                user = f"gradient of {user}"  # a step of the backward pass of the public op ``user``
        swap = _swap.get()
        if swap is not None:  # nb.checkpoint's recompute: a value its function closes over reads as its twin
            args = tuple(swap.get(id(a), a) for a in args)
        if diff is None:
            diff = any(getattr(getattr(a, "_node", None), "diff", False) for a in args)
        return super().__new__(cls, op, params, args, prog, settled, user, diff, _scope.get())

    @property
    def name(self) -> str:
        """The op's name for people: the public op it ran for, else its own."""
        return self.user or getattr(self.op, "name", None) or str(self.op)


LEAF_NODE = Node(LEAF)
_recording: contextvars.ContextVar[Any] = contextvars.ContextVar("nabla_recording", default=True)
_whole: contextvars.ContextVar[bool] = contextvars.ContextVar("nabla_trace_whole", default=False)
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("nabla_differentiating", default=0)


def recording() -> bool:
    return _recording.get()


class Remat:
    """What ``nb.checkpoint`` keeps of a function's forward run: the outputs of its ``saved`` ops (matmuls under
    ``policy="save_matmuls"``), in the order they ran; ``replay`` hands them back, in order, to the recompute."""

    __slots__ = ("ops", "saved", "replay")

    def __init__(self, ops: frozenset) -> None:
        self.ops, self.saved, self.replay = ops, [], None


_remat: contextvars.ContextVar[Remat | None] = contextvars.ContextVar("nabla_remat", default=None)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value: Any, result: Any = None) -> Iterator[Any]:
    """``var`` set to ``value`` inside the block (yielding ``result``), restored after it."""
    token = var.set(value)
    try:
        yield result
    finally:
        var.reset(token)


def remat(r: Remat | None) -> Any:
    return _setting(_remat, r)


def recorded() -> Any:
    """Ops inside leave nodes, even inside a backward pass (a recompute differentiates what it runs)."""
    return _setting(_recording, True)


def paused() -> Any:
    """Ops inside leave no nodes (a backward pass that does not need its own gradients), unless a whole
    program is being traced (``nb.jit`` compiles the backward pass too)."""
    return contextlib.nullcontext() if _whole.get() else _setting(_recording, False)


def differentiating() -> Any:
    """Marks the forward run of a function being differentiated (``nb.vjp``'s ``f``): a backward pass run
    inside it (a gradient of a gradient) must record its own ops, for the outer pass to differentiate."""
    return _setting(_depth, _depth.get() + 1)


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
    return _setting(_replay, True)


def whole() -> Any:
    """Record everything inside, backward passes included."""
    return _setting(_whole, True)


def tracked(args) -> bool:
    """Whether any operand carries a node, so the result must record one."""
    for a in args:
        if getattr(a, "_node", None) is not None:
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
            n = getattr(a, "_node", None)
            if n is not None and n.diff and id(a) not in self.args:
                self.seen.setdefault(id(a), a)
        return False


def watching(watch: Watch) -> Any:
    """Ops inside leave no nodes; ``watch`` notes the differentiated values they read from outside."""
    return contextlib.nullcontext(watch) if _whole.get() else _setting(_recording, watch, watch)


def swapped(swap: dict) -> Any:
    """Nodes made inside read the value ``swap[id(v)]`` wherever an operand is ``v``."""
    return _setting(_swap, swap or None)


def topological(outputs, stop=None) -> list:
    """Every tracked value the outputs depend on, operands before the values made from them; the operands
    of values whose ``id`` is in ``stop`` are not visited (a backward pass stops at its own leaves)."""
    order, seen = [], set()
    stack = [(v, False) for v in outputs if getattr(v, "_node", None) is not None]
    while stack:
        v, done = stack.pop()
        if done:
            order.append(v)
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        stack.append((v, True))
        if stop is not None and id(v) in stop:
            continue
        for a in v._node.args:
            if getattr(a, "_node", None) is not None and id(a) not in seen:
                stack.append((a, False))
    return order
