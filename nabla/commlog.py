"""The comm log: the recorders every step is published to (``nb.comm_log``, a memory log), and the labels a step
is recorded under (its phase, public op and named scope), as contextvars. The events it holds are made by the
collective registry (``collectives``)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from .errors import ShardingError
from .scoped import setting

if TYPE_CHECKING:
    from .collectives import CommEvent


#: how wide a list of op names may print (the comm log's "during" column, ``nb.explain``'s users)
NAMES_WIDTH = 60


def abbreviate(names: Sequence[str], width: int = NAMES_WIDTH) -> str:
    """``names`` joined by commas in at most ``width`` characters: the first names that fit, then "and N more" (a
    2-layer model's step listed 21 gradients on one line of 670 characters). A single name too long to fit is
    cut, ending in "..."."""
    names = list(dict.fromkeys(names))
    if len(", ".join(names)) <= width:
        return ", ".join(names)
    for k in range(len(names) - 1, 0, -1):
        text = f"{', '.join(names[:k])} and {len(names) - k} more"
        if len(text) <= width:
            return text
    tail = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return names[0][:max(1, width - len(tail) - 3)] + "..." + tail


class CommLog:
    """Every simulated collective run while the log is active (``with nb.comm_log() as log:``): ``steps``, the
    recorded ops (``nabla.step.Step``: operands, layouts, moves, FLOPs), and ``events``, their moves in order.
    ``keep_values``: also keep the values the steps read and make, by serial (for tools that replay them)."""

    def __init__(self, keep_values: bool = False) -> None:
        self.events: list[CommEvent] = []
        self.steps: list = []
        self.values: dict[int, Any] | None = {} if keep_values else None

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.events:
            out[e.kind] = out.get(e.kind, 0) + 1
        return out

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.events)

    @property
    def total_cost(self) -> float:
        return sum(e.seconds for e in self.events)

    def bytes_by_axes(self) -> dict[tuple[str, ...], int]:
        """Bytes per device, summed per set of mesh axes."""
        out: dict[tuple[str, ...], int] = {}
        for e in self.events:
            out[e.axes] = out.get(e.axes, 0) + e.bytes
        return out

    def summary(self) -> str:
        """One row per (phase, kind, axes): count, bytes per device, estimated time, and the ops involved (the
        first that fit in ``NAMES_WIDTH`` characters, then how many more)."""
        groups: dict[tuple, list[CommEvent]] = {}
        for e in self.events:
            groups.setdefault((e.phase, e.kind, e.axes), []).append(e)
        phases = {e.phase for e in self.events}
        head = (("phase",) if len(phases) > 1 else ()) + ("kind", "axes", "count", "bytes/device", "est. us", "during")
        rows = [head]
        for (phase, kind, axes), evs in groups.items():
            ops = abbreviate([e.op for e in evs if e.op])
            rows.append(((phase,) if len(phases) > 1 else ()) + (
                kind, ",".join(axes), str(len(evs)), f"{sum(e.bytes for e in evs):,}",
                f"{sum(e.seconds for e in evs) * 1e6:,.1f}", ops))
        pad = ("",) if len(phases) > 1 else ()
        rows.append(pad + ("total", "", str(len(self.events)), f"{self.total_bytes:,}",
                           f"{self.total_cost * 1e6:,.1f}", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"CommLog({len(self.events)} events, {self.total_bytes:,} B/device)"

    def clear(self) -> None:
        self.events.clear()
        self.steps.clear()

    def take(self, step: Any, values: Sequence[tuple[int, Any]] = ()) -> None:
        """Record one step (every open recorder is handed each step; see ``publish``)."""
        self.steps.append(step)
        events = step.events
        if events:
            self.events.extend(events)
        if self.values is not None:
            for s, v in values:
                if s:
                    self.values.setdefault(s, v)


_logs: contextvars.ContextVar[tuple[CommLog, ...]] = contextvars.ContextVar("nabla_comm_logs", default=())
_phase: contextvars.ContextVar[str] = contextvars.ContextVar("nabla_phase", default="forward")
_op: contextvars.ContextVar[str] = contextvars.ContextVar("nabla_user_op", default="")


@contextlib.contextmanager
def comm_log(keep_values: bool = False) -> Iterator[CommLog]:
    """Record the ops and collectives run inside the block; logs nest (an outer log sees inner steps too)."""
    with recording(CommLog(keep_values)) as log:
        yield log


@contextlib.contextmanager
def recording(recorder: Any) -> Iterator[Any]:
    """Hand every step published inside the block to ``recorder.take(step, values)`` (a comm log, a memory log)."""
    with setting(_logs, _logs.get() + (recorder,), recorder):
        yield recorder


def unlogged() -> Any:
    """Steps published inside reach no open log: a trace whose steps the logs see when its program runs, or a
    value computed to stand in for one (computed, not communicated)."""
    return setting(_logs, ())


def phase(name: str) -> Any:
    """Label the collectives run inside (``"backward"`` during a backward pass)."""
    return setting(_phase, name)


_OUTERMOST = contextlib.nullcontext()


def user_op(name: str) -> Any:
    """Name the public op the collectives inside belong to (softmax, not the max and sum it is made of): the
    outermost name holds."""
    return _OUTERMOST if _op.get() else setting(_op, name)


def logging() -> bool:
    """Whether any comm log is open (callers skip building events when none is)."""
    return bool(_logs.get())


def current_op() -> str:
    """The public op the running code belongs to ("" outside any)."""
    return _op.get()


def current_phase() -> str:
    return _phase.get()


_scope: contextvars.ContextVar[str] = contextvars.ContextVar("nabla_scope", default="")


@contextlib.contextmanager
def named_scope(name: str) -> Iterator[None]:
    """Label the steps run inside (as ``jax.named_scope``): ``nb.estimate``'s report groups them per label (a
    layer, a block); nested labels are joined with ``/``."""
    if not isinstance(name, str) or not name:
        raise ShardingError(f"named_scope: the name must be a non-empty str, got {name!r}")
    outer = _scope.get()
    with setting(_scope, f"{outer}/{name}" if outer else name):
        yield


def current_scope() -> str:
    return _scope.get()


def in_scope(scope: str) -> Any:
    """Run inside the scope label ``scope`` as it is (a backward pass runs each VJP in its forward op's scope)."""
    return setting(_scope, scope)


def step_user(user: str) -> str:
    """The name a recorded step gives the public op it ran for: in a backward pass, ``gradient of <op>``
    (the sums of a gradient keep their own name, ``grad of p['w']``)."""
    if user and _phase.get() == "backward" and not user.startswith("grad of") and (_op.get() or user != "shard"):
        return f"gradient of {user}"  # (a value placed outside any op, the backward pass's seed, is itself)
    return user



def tag(values: Sequence[Any], kind: str) -> None:
    """Tell the open recorders that keep accounts (a memory log) what ``values`` are to the program: "params",
    "grads", "optimizer"."""
    for log in _logs.get():
        t = getattr(log, "tag", None)
        if t is not None:
            for v in values:
                t(v, kind)


def replaces(new: Sequence[Any], old: Sequence[Any]) -> None:
    """Tell the open recorders that keep accounts that each of ``new`` is written over the matching ``old`` (an
    optimizer's update, in place)."""
    for log in _logs.get():
        r = getattr(log, "replace", None)
        if r is not None:
            for a, b in zip(new, old):
                r(a, b)


def composed(op: Any, params: tuple, args: Sequence[Any], out: Any) -> None:
    """Tell the open recorders that read ops as they were called (ONNX export writes one node per op) that the
    steps just published made ``out``, one ``op`` of ``args`` (``log_softmax`` over a sharded dim runs as max,
    sum and log steps). Other readers keep the steps that ran; a recorder that reads it has ``composed``."""
    for log in _logs.get():
        f = getattr(log, "composed", None)
        if f is not None:
            f(op, params, args, out)


def publish(step: Any, values: Sequence[tuple[int, Any]] = ()) -> None:
    """Hand a recorded step to every open log: the one place moves enter a comm log. ``values``: (serial,
    value) pairs a log that keeps values takes."""
    for log in _logs.get():
        log.take(step, values)
