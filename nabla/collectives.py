"""The collectives: a registry from kind to its array move on vectorised storage, its ring bytes and
steps, and its transpose; and the comm log that records every one that runs. A new collective is one
``register`` call; the planner proposes moves, ``reshard`` carries them out through this table."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from .backends import xp
from .cost import current as current_cost_model
from .errors import ShardingError
from .storage import sum_summands


@dataclass(frozen=True)
class Collective:
    """One kind of move. ``ring_bytes(B, k)``: bytes each device sends for a local block of ``B`` bytes
    over a group of ``k``; ``ring_steps(k)``: its latency steps; ``transpose``: the kind whose move is
    this one's linear transpose (what the backward pass of this move does); ``move(x, G, step, reduce_op)``
    carries out a planned step on stored blocks with ``G`` grid axes in front; ``lower(x, step, ctx)`` is its
    ``jax.lax`` twin for ``nb.jit``: the same step on one device's block inside ``jax.shard_map``, where ``ctx``
    gives ``lax`` and ``xp`` (jax.numpy), ``names`` (the jax mesh axes of the step's atoms), ``k`` (their
    group size), ``index()`` (this device's position along them), ``fit(x, axis, n)`` (trim or zero-pad a
    dim), ``reduce_op`` and ``exchange(x, src, dst)`` (a general exchange as ppermute rounds). A kind
    without ``lower`` runs eagerly but cannot be compiled."""

    name: str
    ring_bytes: Callable[[int, int], int]
    ring_steps: Callable[[int], int]
    transpose: str
    move: Callable[..., Any]
    local: bool = False  # no data leaves a device (not logged)
    lower: Callable[..., Any] | None = None  # its jax.lax twin inside nb.jit's shard_map


REGISTRY: dict[str, Collective] = {}
_EPOCH = [0]  # bumped by every change to what the planner may use; every plan cache is keyed on it


def epoch() -> int:
    """The registry's version: plans cached under another epoch are not reused."""
    return _EPOCH[0]


def bump() -> None:
    """Mark the collectives or their move generators changed (later plans are made afresh)."""
    _EPOCH[0] += 1


def register(c: Collective) -> Collective:
    """Add (or replace) a kind of collective; plans made from now on may use it."""
    REGISTRY[c.name] = c
    bump()
    return c


def unregister(name: str) -> None:
    """Remove a kind added with ``register``; plans made from now on do not use it."""
    del REGISTRY[name]
    bump()


def kinds() -> tuple[str, ...]:
    """The collective kinds a comm log can hold."""
    return tuple(k for k, c in REGISTRY.items() if not c.local)


# ---- array moves along grid atoms --------------------------------------------------------------------


def gather_into(x: Any, G: int, dim: int, atoms: Sequence[int], new_chunk: int) -> Any:
    """Move grid ``atoms`` (major to minor) to the minor end of ``dim``; they become replicas (size 1)."""
    if not atoms:
        return _fit(x, G + dim, new_chunk)
    perm, merged = _gather_layout(x.shape, G, dim, tuple(atoms))
    return _fit(x.transpose(perm).reshape(merged), G + dim, new_chunk)


def split_onto(x: Any, G: int, dim: int, atoms: Sequence[int], sizes: Sequence[int], new_chunk: int,
               held: Sequence[int] = ()) -> Any:
    """Cut the minor end of ``dim`` into ``sizes`` pieces placed on grid ``atoms`` (currently size 1). With
    ``held`` sizes, the block is first seen as that many major pieces, each cut alike (a strided slice)."""
    if held:
        h = prod(held)
        x = _fit(x, G + dim, h * prod(sizes) * new_chunk)
        y = x.reshape(x.shape[:G + dim] + (h, prod(sizes) * new_chunk) + x.shape[G + dim + 1:])
        y = split_onto(y, G, dim + 1, atoms, sizes, new_chunk)
        return y.reshape(y.shape[:G + dim] + (h * new_chunk,) + y.shape[G + dim + 2:])
    if not atoms:
        return _fit(x, G + dim, new_chunk)
    x = _fit(x, G + dim, prod(sizes) * new_chunk)
    cut, perm = _split_layout(x.shape, G, dim, tuple(atoms), tuple(sizes), new_chunk)
    return x.reshape(cut).transpose(perm)


@lru_cache(maxsize=8192)
def _gather_layout(shape: tuple[int, ...], G: int, dim: int, atoms: tuple[int, ...]):
    """The transpose and reshape that carry out ``gather_into`` on blocks of ``shape`` (pure arithmetic)."""
    m = len(atoms)
    dest = [G - m + dim + i for i in range(m)]
    perm = _moveaxis_perm(len(shape), atoms, dest)
    moved = tuple(shape[a] for a in perm)
    merged = moved[:G - m + dim] + (prod(moved[G - m + dim:G + dim + 1]),) + moved[G + dim + 1:]
    kept = set(atoms)
    grid = [1] * G
    for j, s in zip((j for j in range(G) if j not in kept), merged[:G - m]):
        grid[j] = s
    return perm, tuple(grid) + merged[G - m:]


@lru_cache(maxsize=8192)
def _split_layout(shape: tuple[int, ...], G: int, dim: int, atoms: tuple[int, ...], sizes: tuple[int, ...],
                  new_chunk: int):
    """The reshape and transpose that carry out ``split_onto`` on blocks of ``shape`` (pure arithmetic)."""
    m = len(atoms)
    keep = tuple(s for j, s in enumerate(shape[:G]) if j not in set(atoms))
    cut = keep + shape[G:G + dim] + sizes + (new_chunk,) + shape[G + dim + 1:]
    src = [G - m + dim + i for i in range(m)]
    order = sorted(range(m), key=lambda i: atoms[i])
    return cut, _moveaxis_perm(len(cut), [src[i] for i in order], [atoms[i] for i in order])


def _moveaxis_perm(ndim: int, source: Sequence[int], destination: Sequence[int]) -> tuple[int, ...]:
    """The axis order ``np.moveaxis(x, source, destination)`` produces, as one transpose."""
    order = [n for n in range(ndim) if n not in set(source)]
    for d, s in sorted(zip(destination, source)):
        order.insert(d, s)
    return tuple(order)


def reduce_over(x: Any, atoms: Sequence[int], op: str = "sum") -> Any:
    """Sum (or max/min) the partial summands held along grid ``atoms``, keeping the dtype."""
    if op == "sum":
        return sum_summands(x, tuple(atoms))  # from the additive identity: -0.0 + -0.0 is -0.0
    if type(x) is np.ndarray:  # what np.max/np.min call, without their Python wrapper
        if len(atoms) == 1 and x.shape[atoms[0]] == 2:  # two devices: one elementwise call, half the time
            lead = (slice(None),) * atoms[0]
            return _UFUNCS[op](x[lead + (slice(0, 1),)], x[lead + (slice(1, 2),)])
        return _UFUNCS[op].reduce(x, axis=tuple(atoms), keepdims=True)
    return getattr(xp(x), op)(x, axis=tuple(atoms), keepdims=True)


_UFUNCS = {"max": np.maximum, "min": np.minimum}


def permute_blocks(x: Any, dim_before: Sequence[int], dim_after: Sequence[int]) -> Any:
    """Devices that held block ``radix(coords, before)`` of a dim now hold ``radix(coords, after)``."""
    sizes = {a: x.shape[a] for a in dim_before}
    by_pos = xp(x).moveaxis(x, list(dim_before), list(range(len(dim_before))))
    rest = by_pos.shape[len(dim_before):]
    by_pos = by_pos.reshape((prod(sizes.values()),) + rest)
    y = by_pos.reshape(tuple(sizes[a] for a in dim_after) + rest)
    return xp(y).moveaxis(y, list(range(len(dim_after))), list(dim_after))


def _fit(x: Any, axis: int, n: int) -> Any:
    """Trim or zero-pad ``axis`` to ``n``: padding past a dim's end carries no value."""
    c = x.shape[axis]
    if c == n:
        return x
    if c > n:
        return x[(slice(None),) * axis + (slice(0, n),)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - c)
    return xp(x).pad(x, pad)


# ---- the five collectives and the local slice ---------------------------------------------------------


def _slice(x, G, s, reduce_op):
    return split_onto(x, G, s.dst, s.atoms, s.sizes, s.dst_chunk, s.held)


def _all_gather(x, G, s, reduce_op):
    return gather_into(x, G, s.src, s.atoms, s.src_chunk)


def _all_reduce(x, G, s, reduce_op):
    return reduce_over(x, s.atoms, reduce_op)


def _reduce_scatter(x, G, s, reduce_op):
    return split_onto(reduce_over(x, s.atoms, reduce_op), G, s.dst, s.atoms, s.sizes, s.dst_chunk)


def _all_to_all(x, G, s, reduce_op):
    x = gather_into(x, G, s.src, s.atoms, s.src_chunk)
    return split_onto(x, G, s.dst, s.atoms, s.sizes, s.dst_chunk)


def _collective_permute(x, G, s, reduce_op):
    """Each device receives the block (or, for a general exchange, the pieces) its new layout needs. On
    vectorised storage: move the leaving atoms into their dims, then cut the dims onto the arriving ones."""
    if not s.moves:  # devices relabelled between meshes: the grid is unchanged
        return x
    if all(set(old) == set(new) for _, old, new, _, _, _ in s.moves):
        for _, old, new, _, _, _ in s.moves:
            x = permute_blocks(x, old, new)
        return x
    for d, old, _, _, _, whole in s.moves:
        x = gather_into(x, G, d, old, whole)
    for d, _, new, sizes, c, _ in s.moves:
        x = split_onto(x, G, d, new, sizes, c)
    return x


# ---- their jax.lax twins (nb.jit lowers each planned step to one, on each device's block) -------------


def _lower_slice(x, s, ctx):
    c = s.dst_chunk
    held = s.held
    if held:  # each of prod(held) major pieces of the block cut alike (a strided slice)
        h = prod(held)
        x = ctx.fit(x, s.dst, h * ctx.k * c)
        x = x.reshape(x.shape[:s.dst] + (h, ctx.k * c) + x.shape[s.dst + 1:])
        x = ctx.lax.dynamic_slice_in_dim(x, ctx.index() * c, c, axis=s.dst + 1)
        return x.reshape(x.shape[:s.dst] + (h * c,) + x.shape[s.dst + 2:])
    x = ctx.fit(x, s.dst, ctx.k * c)
    return ctx.lax.dynamic_slice_in_dim(x, ctx.index() * c, c, axis=s.dst)


def _lower_all_gather(x, s, ctx):
    return ctx.fit(ctx.lax.all_gather(x, ctx.names, axis=s.src, tiled=True), s.src, s.src_chunk)


def _lower_all_reduce(x, s, ctx):
    return {"sum": ctx.lax.psum, "max": ctx.lax.pmax, "min": ctx.lax.pmin}[ctx.reduce_op](x, ctx.names)


def _lower_reduce_scatter(x, s, ctx):
    x = ctx.fit(x, s.dst, ctx.k * s.dst_chunk)
    if ctx.reduce_op == "sum":
        return ctx.lax.psum_scatter(x, ctx.names, scatter_dimension=s.dst, tiled=True)
    x = {"max": ctx.lax.pmax, "min": ctx.lax.pmin}[ctx.reduce_op](x, ctx.names)
    return ctx.lax.dynamic_slice_in_dim(x, ctx.index() * s.dst_chunk, s.dst_chunk, axis=s.dst)


def _lower_all_to_all(x, s, ctx):
    x = ctx.fit(x, s.dst, ctx.k * s.dst_chunk)
    x = ctx.lax.all_to_all(x, ctx.names, split_axis=s.dst, concat_axis=s.src, tiled=True)
    return ctx.fit(x, s.src, s.src_chunk)


def _lower_collective_permute(x, s, ctx):
    if s.exchange:
        return ctx.exchange(x, *s.exchange)
    raise ShardingError("jit: a collective_permute to another device order (a move between two meshes) cannot "
                        "be compiled: nb.jit runs on one jax mesh; keep one mesh inside the function")


register(Collective("slice", lambda B, k: 0, lambda k: 0, "local_pad", _slice, local=True, lower=_lower_slice))
register(Collective("all_gather", lambda B, k: (k - 1) * B, lambda k: k - 1, "reduce_scatter", _all_gather,
                    lower=_lower_all_gather))
register(Collective("all_reduce", lambda B, k: 2 * (k - 1) * B // k, lambda k: 2 * (k - 1), "all_reduce", _all_reduce,
                    lower=_lower_all_reduce))
register(Collective("reduce_scatter", lambda B, k: (k - 1) * B // k, lambda k: k - 1, "all_gather", _reduce_scatter,
                    lower=_lower_reduce_scatter))
register(Collective("all_to_all", lambda B, k: (k - 1) * B // k, lambda k: k - 1, "all_to_all", _all_to_all,
                    lower=_lower_all_to_all))
register(Collective("collective_permute", lambda B, k: B, lambda k: 1, "collective_permute", _collective_permute,
                    lower=_lower_collective_permute))


# ---- the comm log --------------------------------------------------------------------------------------


class CommEvent(NamedTuple):
    """One collective: its kind, mesh axes, bytes sent per device, group size, the op it ran for,
    ``"forward"``/``"backward"``, and its estimated seconds under the cost model in force when it ran."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    group: int = 1
    op: str = ""
    phase: str = "forward"
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return REGISTRY[self.kind].ring_steps(self.group)

    @property
    def cost(self) -> float:
        """Estimated seconds: ring steps times latency plus bytes over bandwidth (``nb.CostModel``)."""
        return self.seconds

    def __repr__(self) -> str:
        return f"{self.kind}({', '.join(self.axes)}; {self.bytes} B/device{'; ' + self.op if self.op else ''})"


def event(kind: str, axes: tuple[str, ...], block_bytes: int, group: int) -> CommEvent:
    """The event of collective ``kind`` on a local block of ``block_bytes`` over ``group`` devices."""
    return CommEvent(kind, axes, REGISTRY[kind].ring_bytes(block_bytes, group), group)


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
    token = _logs.set(_logs.get() + (recorder,))
    try:
        yield recorder
    finally:
        _logs.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the collectives run inside (``"backward"`` during a backward pass)."""
    token = _phase.set(name)
    try:
        yield
    finally:
        _phase.reset(token)


@contextlib.contextmanager
def user_op(name: str) -> Iterator[None]:
    """Name the public op the collectives inside belong to (softmax, not the max and sum it is made of)."""
    if _op.get():
        yield
        return
    token = _op.set(name)
    try:
        yield
    finally:
        _op.reset(token)


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
    token = _scope.set(f"{outer}/{name}" if outer else name)
    try:
        yield
    finally:
        _scope.reset(token)


def current_scope() -> str:
    return _scope.get()


@contextlib.contextmanager
def in_scope(scope: str) -> Iterator[None]:
    """Run inside the scope label ``scope`` as it is (a backward pass runs each VJP in its forward op's scope)."""
    token = _scope.set(scope)
    try:
        yield
    finally:
        _scope.reset(token)


def step_user(user: str) -> str:
    """The name a recorded step gives the public op it ran for: in a backward pass, ``gradient of <op>``
    (the sums of a gradient keep their own name, ``grad of p['w']``)."""
    if user and _phase.get() == "backward" and not user.startswith("grad of") and (_op.get() or user != "shard"):
        return f"gradient of {user}"  # (a value placed outside any op, the backward pass's seed, is itself)
    return user


def stamped(e: CommEvent, op: str) -> CommEvent:
    """``e`` named after the public op and phase it runs in, with its estimated seconds."""
    seconds = current_cost_model().time(REGISTRY[e.kind].ring_steps(e.group), e.bytes, e.axes)
    return e._replace(op=op, phase=_phase.get(), seconds=seconds)


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


def publish(step: Any, values: Sequence[tuple[int, Any]] = ()) -> None:
    """Hand a recorded step to every open log: the one place moves enter a comm log. ``values``: (serial,
    value) pairs a log that keeps values takes."""
    for log in _logs.get():
        log.take(step, values)
