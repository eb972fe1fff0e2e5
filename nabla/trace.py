"""Autodiff's tape: a value an op made from a tracked value is linked to what the backward pass reads of the op (its
op, params and program, the step's own fields) and what it keeps for it: the operands its VJP reads, whether it is
differentiated, its output as the VJP reads it, and the very ``Step`` a comm log took of it, when one was open. The
links are a side table owned here (a value carries no record). Autodiff walks them backward and ``nb.jit`` traces
with them; ONNX export, like ``nb.explain``, reads the steps as the logs took them."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import weakref
from functools import partial
from itertools import takewhile
from typing import Any, Iterator, NamedTuple

from .collectives import _op as _user_op, _phase, _scope
from .dtypes import is_inexact
from .scoped import setting
from .step import PLACE, RELAYOUT, Step
from .value import serial

#: ``Link.op`` of a traced input, an op that ran nothing (``RELAYOUT`` and ``PLACE``, the executor's own
#: steps, are read from here too)
LEAF = "leaf"

_swap: contextvars.ContextVar[dict | None] = contextvars.ContextVar("nabla_swap", default=None)

#: ``Link.out`` of an op whose VJP does not read its output: the backward pass hands it a data-free stand-in
HUSK = "husk"


class Link(NamedTuple):
    """How a value was made, as the backward pass reads it: ``op`` (an OpDef, LEAF (a traced input), RELAYOUT
    (``with_sharding``), PLACE (a host value put on a mesh), or a record of autodiff's own), its ``params``, its
    ``prog`` (what the executor decided: reshard plans and local steps, or the relayout's plan) and ``scope``, the
    ``nb.named_scope`` it ran in (its VJP runs there too): the step's own fields, read by every backward pass;
    ``args``, its operands (values or Python scalars) as the tape keeps them; ``diff``, whether the value depends
    on one being differentiated (a traced twin that ``nb.jit`` or ``nb.explain`` follows is not: the backward pass
    computes no cotangent for it); ``out``, what the VJP reads as the op's output (None: the value itself;
    ``HUSK``: nothing, the op does not read it; else a twin sharing its blocks); ``user``, the public op it ran
    for (``softmax`` for the max and sum inside it; "" outside any), as the comm log named it when the link was
    made, so a backward pass names its collectives after it; ``step``, the very ``Step`` the comm log took of the
    op (operands as read, moves, FLOPs, what it keeps), None when no log was open (no reader asks for a step no
    log took, and building one was a tenth of a differentiated call's cost); ``tape``, the outermost
    differentiation running when the link was made (``Tape``; None outside one: the eager ``.trace()`` tape's,
    or a whole-program trace's, links), which unlinks it when it ends unless a reader after it can reach it;
    ``shadow``, made where eager runs unrecorded (a backward pass) and linked only because ``nb.jit`` traces the
    whole program: the value is, for everything but compiling, an untraced one (``gathered_copy``).

    Given the op's result, a link keeps only the residuals its op declares (``OpDef.saves``): every other
    operand is held as a husk (its shape, layout and link, no data), so the backward pass keeps alive what JAX
    and PyTorch keep, no more, and a VJP reading anything else gets no data. Whole-program traces (``nb.jit``)
    keep everything: they read the values themselves; so do links whose VJP will be differentiated
    again (a gradient of a gradient). Under ``nb.checkpoint(fn, policy="regather")`` an operand kept that an
    all_gather made from a smaller value (sequence parallelism's gathered norm output) is kept as that smaller
    value and gathered again by the backward pass (``regather``: (operand index, source, layout)), as
    Megatron-LM does: one more all_gather for the gathered bytes."""

    op: Any
    params: tuple = ()
    prog: Any = None
    scope: str = ""
    args: tuple = ()
    diff: bool = False
    out: Any = None
    regather: tuple = ()
    user: str = ""
    step: Step | None = None
    tape: Any = None
    shadow: bool = False

    @property
    def name(self) -> str:
        """The op's name for people: the public op it ran for, else its own, as its step is named (the sums of a
        ``with_sharding``'s cotangents are "gradient of with_sharding" in the comm log, as its transpose is)."""
        return self.user or getattr(self.op, "name", None) or str(self.op)


def keeping(op: Any, params: tuple, args: tuple, result: Any = None, moved: list | None = None,
            diff: bool | None = None) -> tuple[tuple, bool, Any, tuple]:
    """What a link of ``op`` on ``args`` keeps besides what ran: (operands, diff, out, regather), pruned to the
    residuals the op declares when ``result`` is given (``Link``); ``moved``: the operands it gathered, which a
    recompute keeps as gathered."""
    swap = _swap.get()
    if swap is not None:  # nb.checkpoint's recompute: a value its function closes over reads as its twin
        args = tuple(swap.get(id(a), a) for a in args)
    if diff is None:
        diff = False
        for a in args:  # (a loop: this runs for every traced op)
            got = _LINKS.get(id(a))
            if got is not None and got[1].diff:
                diff = True
                break
    out, regather = None, ()
    if result is not None and getattr(op, "saves", None) is not None:
        # (a link made inside a function differentiated twice is kept whole: the VJP an inner pass runs on
        # it is itself differentiated, through its operands and output)
        prune = not _whole.get() and _depth.get() <= 1
        if prune or _regather.get():
            args, out, regather = _residuals(op, params, args, result, prune, moved)
    return args, diff, out, regather


def user() -> str:
    """The public op the running code belongs to, as its backward pass is named (``Link.user``)."""
    u = _user_op.get()
    if u and _phase.get() == "backward" and not u.startswith("grad of"):
        u = f"gradient of {u}"  # a step of the backward pass of the public op ``u``
    return u


def made(op: Any, params: tuple, prog: Any, keep: tuple, step: Step | None = None) -> Link:
    """The link of a value ``op`` made here, keeping ``keep`` (what ``keeping`` gave); ``step``: the step a comm
    log took of it."""
    r = _recording.get()
    n = Link(op, params, prog, _scope.get(), *keep, user(), step, _tape.get(), r is SHADOW)
    if type(r) is Watch:  # made inside nb.checkpoint's forward run (by a differentiation nested in it)
        r.inside.add(id(n))
    return n


def entry(op: Any, params: tuple = (), args: tuple = (), result: Any = None, prog: Any = None,
          diff: bool | None = None, step: Step | None = None) -> Link:
    """The link of a value ``op`` made from ``args`` (``keeping`` says what it keeps of them)."""
    return made(op, params, prog, keeping(op, params, args, result, None, diff), step)


def record(v: Any, op: Any, params: tuple = (), args: tuple = (), diff: bool | None = None, result: Any = None,
           prog: Any = None) -> Any:
    """Link ``v`` to ``op`` on ``args``, a value no kernel made as ``op`` (a leaf; a checkpointed or compiled
    call's result; blocks assembled by ``from_local``); returns ``v``."""
    return link(v, entry(op, params, tuple(args), result, prog, diff))


def husk(v: Any, how: Link | None) -> Any:
    """``v`` without its data: its shape, layout, dtype and link ``how`` (``v``'s: a backward pass finds its record
    through it); reads of it name no recorded value."""
    return link(type(v)(None, v._spec, v._shape, v._dtype, serial=None), how)


def _residuals(op: Any, params: tuple, args: tuple, result: Any, prune: bool = True, moved: list | None = None
               ) -> tuple[tuple, Any, tuple]:
    """The operands as the link keeps them (husks where the VJP reads nothing, when ``prune``; an operand the op
    gathered, as gathered, when ``moved`` lists it), the output as the VJP reads it, and the kept operands to
    gather again in the backward pass."""
    links, diff = [], []
    for a in args:  # (each operand's link looked up once: this runs for every traced op)
        got = _LINKS.get(id(a))
        n = None if got is None else got[1]
        links.append(n)
        diff.append(n is not None and n.diff and is_inexact(a._dtype))
    if not any(diff):
        return args, None, ()
    keep, keep_out = op.residuals(tuple(diff), params)
    kept, regather = [], []
    for i, a in enumerate(args):
        if getattr(a, "_shape", None) is None:  # a Python scalar
            kept.append(a)
            continue
        n = links[i]
        got = next((m for m in moved or () if m[0] == i), None) if prune and i in keep else None
        if got is not None:  # kept as the op gathered it (a new value: a serial of its own)
            t = link(type(a)(got[1], got[2], a._shape, a._dtype), n)
            serial(t)
            kept.append(t)
        elif n is not None and n.op == LEAF:
            kept.append(a)  # a leaf (its holder keeps it anyway, and ``.grad`` goes on it)
        elif i not in keep:
            # (a value whose own link kept everything is read by that link's VJP as its output: kept whole)
            whole = not prune or n is not None and n.out is None and getattr(n.op, "saves", None) is not None
            kept.append(a if whole else husk(a, n))
        else:
            src = _gathered_from(a) if _regather.get() else None
            if src is None:
                kept.append(_summed(a) if prune else a)
            else:
                kept.append(husk(a, n) if prune else a)
                regather.append((i, src, a._spec))
    if not prune:
        return args, None, tuple(regather)
    out = HUSK
    if keep_out:  # a twin sharing the result's blocks and serial (holding it holds no record: no cycle)
        out = result.twin(sums=True)
    return tuple(kept), out, tuple(regather)


def _summed(a: Any) -> Any:
    """A pending sum the op had made of ``a`` (kept on it for later uses) is what the link keeps: the same value,
    summed, so the summands need not outlive the forward pass."""
    moved = a._moved
    if not moved or not a._spec.partial_axes:  # (a kept gathered copy stays on the value: read by later uses)
        return a
    for spec, data in moved.items():
        if not spec.partial_axes:
            return link(type(a)(data, spec, a._shape, a._dtype, serial=serial(a)), link_of(a))
    return a


def _gathered_from(a: Any) -> Any:
    """The value ``a`` was all_gathered from by ``with_sharding`` (nothing else moved), else None: keeping that
    smaller value and gathering again costs the backward pass one all_gather and saves the gathered bytes (what
    Megatron-LM's sequence parallelism does with a norm's output; FSDP keeps no gathered weight either)."""
    node = link_of(a)
    if node is None or node.op != RELAYOUT or not node.args:
        return None
    moves = getattr(node.prog, "collectives", None)
    if not moves or any(m.kind != "all_gather" for m in moves):
        return None
    return node.args[0]


LEAF_LINK = Link(LEAF)  # a traced input of a whole-program trace (``nb.jit``)


#: the tape: ``id`` of a value -> (a weak reference to it, its link), in the order they were linked (a running
#: ``Tape``'s own entry, ``(None, None)``, marks where its links begin). A link lives as long as its value does (it
#: holds the operands the VJP reads, and they their own links): what the backward pass keeps alive is what the
#: values the program holds reach; and no longer than the outermost differentiation that made it, unless a
#: reader after that one can reach it (``Tape.end``). (A value whose ``.grad`` holds a recorded value made from it
#: would be kept by its own link through this table: ``releasing_grads`` unrecords such a ``.grad`` when its
#: differentiation ends.)
_LINKS: dict[int, tuple[weakref.ref, Link]] = {}


def link(v: Any, how: Link | None) -> Any:
    """Record that ``v`` was made as ``how`` says (nothing when it is None); returns ``v``. The entry goes when
    ``v`` dies: its weak reference's callback pops it (``pop(id, ref)``: a reference replaced by a later link of
    ``v`` dies first, and calls nothing; an id is reused only after its object's callback ran), or when the
    differentiation that made ``how`` ends, if nothing after it can read it (``Tape.end``)."""
    if how is not None:
        k = id(v)
        _LINKS[k] = (weakref.ref(v, partial(_LINKS.pop, k)), how)
    return v


class Tape:
    """The links an outermost differentiation made (``nb.grad``'s call, ``nb.vjp``'s forward run and ``vjp_fn``, a
    checkpoint's recompute in an eager ``.backward()``) and everything nested in it: ``Link.tape`` names it, and
    its own entry in the table marks where they begin (entries stay in the order they were made, so no traced op
    pays for the list). Once the outermost differentiation has ended only values the user kept from inside reach
    its links: ``end`` unlinks them, except those depending on a link made outside it (a ``.trace()``d tensor's, a
    later ``.backward()`` may reach), so a cycle closed through one (a checkpointed layer keeping its last output:
    output, link, recompute closure, layer) is the collector's again."""

    __slots__ = ()

    def __init__(self) -> None:
        _LINKS[id(self)] = (None, None)  # (no value has its id while it lives)

    def end(self) -> None:
        """Unlink what this differentiation made that no reader after it can reach (once)."""
        mark = id(self)
        if mark not in _LINKS:
            return
        # what was linked since it began (mostly nothing: a gradient's values have died), read in one C call (no
        # collection or other thread changes the table under it)
        since = list(takewhile(mark.__ne__, reversed(_LINKS)))
        mine = []
        for k in reversed(since):
            got = _LINKS.get(k)
            if got is not None and got[1] is not None and got[1].tape is self:
                mine.append((k, got))
        del _LINKS[mark]
        need: dict[int, bool] = {}  # id of a link this tape made -> whether it reaches one made outside it
        gone = [(k, got) for k, got in mine if not _reaches_outside(got[1], self, need)]
        for k, got in gone:
            if _LINKS.get(k) is got:
                del _LINKS[k]  # (what only this link held dies now, its own entries going with it)


def _reaches_outside(n: Link, tape: Tape, need: dict[int, bool]) -> bool:
    """Whether link ``n`` of ``tape`` depends, through operands' links, on a link ``tape`` did not make
    (memoised in ``need``; links are mostly visited in the order they were made, their operands' already known)."""
    got = need.get(id(n))
    if got is not None:
        return got
    stack, seen = [n], {id(n)}
    while stack:  # (an explicit stack: chains of links are long)
        m = stack[-1]
        found, todo = False, []
        for a in m.args:
            e = _LINKS.get(id(a))
            if e is None:
                continue
            s = e[1].tape is not tape or need.get(id(e[1]))
            if s:
                found = True
                break
            if s is None and id(e[1]) not in seen:  # an operand's link not known yet: it first
                todo.append(e[1])
        if found or not todo:
            need[id(m)] = found
            stack.pop()
        else:
            seen.update(map(id, todo))
            stack += todo
    return need[id(n)]


_tape: contextvars.ContextVar[Tape | None] = contextvars.ContextVar("nabla_tape", default=None)


class taping:  # noqa: N801 - used as a function: ``with taping() as tape:``
    """Inside, links are made for a ``Tape`` (yielded) when this is an outermost differentiation: none is running,
    nor a trace that reads the links after it (``nb.jit``'s whole program, ``nb.vmap``'s replayed one: there it
    yields None, and the links are the enclosing trace's or tape's). On exit the tape ends, unless ``end`` is
    False (``nb.vjp``: its ``vjp_fn`` reads them later; it ends the tape when it dies), or an error ends the block."""

    __slots__ = ("end", "tape", "token")

    def __init__(self, end: bool = True) -> None:
        self.end, self.tape = end, None

    def __enter__(self) -> Tape | None:
        if _tape.get() is None and not _depth.get() and not _whole.get():
            self.tape = Tape()
            self.token = _tape.set(self.tape)
        return self.tape

    def __exit__(self, kind: Any, *exc: Any) -> None:
        t = self.tape
        if t is not None:
            _tape.reset(self.token)
            if self.end or kind is not None:
                t.end()


def link_of(v: Any) -> Link | None:
    """How ``v`` was made, when it depends on a traced value (else None)."""
    got = _LINKS.get(id(v))
    return None if got is None else got[1]


_regather: contextvars.ContextVar[bool] = contextvars.ContextVar("nabla_regather", default=False)
_recording: contextvars.ContextVar[Any] = contextvars.ContextVar("nabla_recording", default=True)
_whole: contextvars.ContextVar[bool] = contextvars.ContextVar("nabla_trace_whole", default=False)
SHADOW = "shadow"  # ``_recording`` where eager records nothing but a whole-program trace records all (``Link.shadow``)
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("nabla_differentiating", default=0)


def recording() -> bool:
    return _recording.get()


def differentiated(v: Any) -> bool:
    """Whether ``v`` depends on a value being differentiated (an ``nb.grad``/``vjp`` argument, a ``.trace()``)."""
    node = link_of(v)
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
    node = link_of(v)
    if node is None or node.shadow:  # untraced (as eager has it): kept only inside one imported program
        # (nb.import_jax), not for its parameters
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


def _from_leaves(node: Link, depth: int) -> bool:
    """Whether ``node``'s value is made from traced inputs alone (within ``depth`` ops: casts, transposes)."""
    if depth == 0:
        return False
    seen = False
    for a in node.args:
        n = link_of(a)
        if n is None:
            if getattr(a, "_shape", None) is not None:  # an untraced tensor: data, not a parameter
                return False
            continue
        if n.op != LEAF and not _from_leaves(n, depth - 1):
            return False
        seen = True
    return seen


def regathering() -> Any:
    """Links made inside keep a gathered operand as the value it was gathered from (``policy="regather"``)."""
    return setting(_regather, True)


def recorded() -> Any:
    """Ops inside are recorded, even inside a backward pass (a recompute differentiates what it runs)."""
    return setting(_recording, True)


def paused() -> Any:
    """Ops inside are not recorded (a backward pass that does not need its own gradients), unless a whole
    program is being traced (``nb.jit`` compiles the backward pass too: recorded as ``SHADOW``)."""
    return setting(_recording, SHADOW if _whole.get() else False)


@contextlib.contextmanager
def differentiating() -> Iterator[None]:
    """Marks the forward run of a function being differentiated (``nb.vjp``'s ``f``): a backward pass run
    inside it (a gradient of a gradient) must record its own ops, for the outer pass to differentiate (and the
    ``.grad`` it leaves is unrecorded when the run ends: ``releasing_grads``); inside a checkpoint's, a relay."""
    r = _recording.get()
    with setting(_depth, _depth.get() + 1), releasing_grads(), \
            (setting(_recording, r.relay()) if type(r) is Watch else contextlib.nullcontext()):
        yield


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


@contextlib.contextmanager
def whole() -> Iterator[None]:
    """Record everything inside, backward passes included; the links made inside are the trace's (no ``Tape``'s:
    the trace reads them once its differentiations have ended)."""
    with setting(_whole, True), setting(_tape, None):
        yield


def linked_any(args) -> bool:
    """Whether some operand is linked (how it was made is on the tape); one test when nothing is traced anywhere."""
    if not _LINKS:
        return False
    for a in args:
        if id(a) in _LINKS:
            return True
    return False


def tracked(args) -> bool:
    """Whether any operand is linked and ops are recorded, so the result must be linked too."""
    if not linked_any(args):
        return False
    r = _recording.get()
    return r.saw(args) if type(r) is Watch else r


class Watch:
    """``nb.checkpoint``'s forward run: it records nothing, but notes the differentiated values it reads that are
    not its arguments (tensors its function closes over), so that their gradients are not lost. An ``nb.grad``
    nested in the run records its own ops through a ``relay``: the same notes, but not of values whose link was
    made inside (``inside``: the links' ids, noted by ``made``)."""

    __slots__ = ("args", "seen", "inside", "records")

    def __init__(self, args: Any) -> None:
        self.args = {id(a) for a in args}
        self.seen: dict = {}
        self.inside: set[int] = set()
        self.records = False

    def relay(self) -> "Watch":
        """This watch, for a nested differentiation's forward run: ops are recorded, reads still noted."""
        r = copy.copy(self)  # (the same args, seen and inside)
        r.records = True
        return r

    def __bool__(self) -> bool:  # as ``paused()`` (a relay: ``recorded()``) for everything that asks
        return self.records

    def saw(self, args: Any) -> bool:
        for a in args:
            n = link_of(a)
            if n is not None and n.diff and id(a) not in self.args and id(n) not in self.inside:
                self.seen.setdefault(id(a), a)
        return self.records


def watching(watch: Watch) -> Any:
    """Ops inside are not recorded; ``watch`` notes the differentiated values they read from outside."""
    return contextlib.nullcontext(watch) if _whole.get() else setting(_recording, watch, watch)


def swapped(swap: dict) -> Any:
    """Links made inside read the value ``swap[id(v)]`` wherever an operand is ``v``."""
    return setting(_swap, swap or None)


def by_link(v: Any) -> int | None:
    """A value's name in a backward pass: its link (a husk and the value it stands for share it); None when it has
    none (one lookup: a backward pass asks this of every operand)."""
    got = _LINKS.get(id(v))
    return None if got is None else id(got[1])


_held: contextvars.ContextVar[list | None] = contextvars.ContextVar("nabla_recorded_grads", default=None)


def held_grad(v: Any) -> None:
    """Note that ``v.grad`` holds a recorded value (``t.backward()`` inside a differentiation): ``releasing_grads``
    unrecords it when that differentiation's forward run ends."""
    got = _held.get()
    if got is not None:
        got.append(v)


@contextlib.contextmanager
def releasing_grads() -> Iterator[None]:
    """A ``.grad`` that holds a recorded value noted inside (``held_grad``) holds that value unrecorded on exit (the
    same blocks and serial): it was made from the value it is the gradient of, so through this table its link
    would keep that value, and itself, alive for good. The enclosing pass has read it by then: its record holds
    the recorded value itself."""
    got: list = []
    try:
        with setting(_held, got):
            yield
    finally:
        for v in got:
            g = v.grad
            if link_of(g) is not None:
                v.grad = g.twin(sums=True)
