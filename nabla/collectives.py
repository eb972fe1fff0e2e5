"""The collective registry: kind -> its array move on vectorised storage, ring bytes and steps, transpose and
``jax.lax`` twin (a new collective is one ``register`` call; ``reshard`` plans moves and carries them out through
this table), and the events moves log, made here only. Every kind of communication is an entry: the five
collectives, the local slice and its transpose and the gradient bucket here; the halo exchange and the mirror
permute (``factors``), the general exchange (``reshard.exchange``) and ``nb.lax``'s collectives (``lax``) where they
are planned. The comm log is ``commlog``'s, re-exported here."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .backends import xp
from .backends.grid import fit
from .commlog import (NAMES_WIDTH, CommLog, _op, _phase, _scope, abbreviate, comm_log,  # noqa: F401
                      current_op, current_phase, current_scope, in_scope, logging, named_scope, phase, publish,
                      recording, replaces, step_user, tag, unlogged, user_op)
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
    dim), ``reduce_op``, ``shape`` (the global shape) and what the device context gives (``linear(refs)``,
    ``position()``, ``pairs(fn, refs)``, ``ppermute(x, pairs)``), which is all a kind run inside an op (a halo,
    a mirror, ``nb.lax``) gets as ``ctx``. A kind without ``lower`` runs eagerly but cannot be compiled.
    ``logs_as``: the kind its events carry in the comm log when that is another's (a halo exchange is, on the
    wire, a collective_permute): its pricing is that kind's, and the log reads as before the kind had its own
    entry. ``legs(sent, k, k_in, k_out)``: how a group spanning ``k_in`` devices of a node and ``k_out`` nodes
    runs it, as ``(kind, tier, group, bytes)`` legs from the ``sent`` bytes of a flat ring (None: one leg, the
    whole group on the network); ``legs_at_once``: the legs run at the same time rather than one after
    another. ``pairwise``: each device sends its block to one peer (a permute), so the whole group runs on the
    tier its pairs cross, and even a group of one takes a latency step (a device sends to itself over a link)."""

    name: str
    ring_bytes: Callable[[int, int], int]
    ring_steps: Callable[[int], int]
    transpose: str
    move: Callable[..., Any]
    local: bool = False  # no data leaves a device (not logged)
    lower: Callable[..., Any] | None = None  # its jax.lax twin inside nb.jit's shard_map
    logs_as: str = ""  # the kind its events are logged and priced as ("": its own name)
    legs: Callable[[float, int, int, int], tuple] | None = None  # its phases on a node-then-network group
    legs_at_once: bool = False
    pairwise: bool = False


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
    """The collective kinds a comm log can hold (a kind logged as another is not one)."""
    return tuple(k for k, c in REGISTRY.items() if not c.local and not c.logs_as)


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
    return fit(x, axis, n, xp(x))


# ---- the five collectives, the local slice and its transpose ---------------------------------------------------------


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
    """Devices relabelled between meshes: each receives the block its new position holds; on vectorised storage
    the grid is unchanged. (A general exchange within a mesh is its own kind, ``"exchange"``.)"""
    return x


def _local_pad(x, G, s, reduce_op):
    """A slice's transpose: each device's block put back in its place along ``dst`` among zeros, the atoms
    left on the grid (the value is partial over them: their sum is the whole dim again). No data moves."""
    k, c, h = prod(s.sizes), s.dst_chunk, prod(s.held)
    pos = np.zeros((1,) * G, dtype=np.int64)
    for a, n in zip(s.atoms, s.sizes):  # mixed radix over the atoms, major first
        pos = pos * n + np.arange(n).reshape((1,) * a + (n,) + (1,) * (G - a - 1))
    rest = x.ndim - G - s.dst - 1
    hot = pos.reshape(pos.shape + (1,) * s.dst + (1, 1, 1) + (1,) * rest) == \
        np.arange(k).reshape((1,) * (G + s.dst) + (1, k, 1) + (1,) * rest)
    x = _fit(x, G + s.dst, h * c)
    y = x.reshape(x.shape[:G + s.dst] + (h, 1, c) + x.shape[G + s.dst + 1:])
    y = xp(x).where(hot, y, xp(x).zeros((), dtype=x.dtype))
    return y.reshape(y.shape[:G + s.dst] + (h * k * c,) + y.shape[G + s.dst + 3:])


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


def _lower_local_pad(x, s, ctx):
    h, c, rest = prod(s.held), s.dst_chunk, x.ndim - s.dst - 1
    x = ctx.fit(x, s.dst, h * c)
    y = x.reshape(x.shape[:s.dst] + (h, 1, c) + x.shape[s.dst + 1:])
    hot = (ctx.xp.arange(ctx.k) == ctx.index()).reshape((1,) * s.dst + (1, ctx.k, 1) + (1,) * rest)
    y = ctx.xp.where(hot, y, ctx.xp.zeros((), dtype=x.dtype))
    return y.reshape(y.shape[:s.dst] + (h * ctx.k * c,) + y.shape[s.dst + 3:])


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
    raise ShardingError("jit: a collective_permute to another device order (a move between two meshes) cannot "
                        "be compiled: nb.jit runs on one jax mesh; keep one mesh inside the function")


def _bucket(blocks, plans, shapes, be):
    """Several values' partial blocks (DDP's gradient bucket), every device's at once: each summed by its plan's
    all_reduce (and local cuts), side by side, which is what the one collective computes (``GridBackend.bucket``)."""
    return [be.move(x, p, shape) for x, p, shape in zip(blocks, plans, shapes)]


def _lower_bucket(blocks, names, ctx):
    """The blocks flattened into one buffer, one psum of it over the jax mesh axes ``names``, each block cut
    back out: what the log's one all_reduce is."""
    xp = ctx.xp
    flat = xp.concatenate([b.reshape(-1).astype(blocks[0].dtype) for b in blocks]) if len(blocks) > 1 else \
        blocks[0].reshape(-1)
    summed = ctx.lax.psum(flat, names) if names else flat
    out, at = [], 0
    for b in blocks:
        n = int(np.prod(b.shape))
        out.append(summed[at:at + n].reshape(b.shape).astype(b.dtype))
        at += n
    return tuple(out)


def _all_reduce_legs(sent: float, k: int, k_in: int, k_out: int) -> tuple:
    """reduce_scatter inside the node, all_reduce of the node's share across nodes, all_gather inside."""
    b = sent * k / (2 * (k - 1))  # the local block
    return (("reduce_scatter", "nvlink", k_in, (k_in - 1) / k_in * b),
            ("all_reduce", "network", k_out, 2 * (k_out - 1) / k_out * b / k_in),
            ("all_gather", "nvlink", k_in, (k_in - 1) / k_in * b))


def _reduce_scatter_legs(sent: float, k: int, k_in: int, k_out: int) -> tuple:
    """reduce_scatter inside on the block, then across on the node's share."""
    b = sent * k / (k - 1)
    return (("reduce_scatter", "nvlink", k_in, (k_in - 1) / k_in * b),
            ("reduce_scatter", "network", k_out, (k_out - 1) / k_out * b / k_in))


def _all_gather_legs(sent: float, k: int, k_in: int, k_out: int) -> tuple:
    """all_gather across nodes of the shard, then inside the node of the ``k_out`` shards gathered."""
    b = sent / (k - 1)  # the local shard
    return (("all_gather", "network", k_out, (k_out - 1) * b), ("all_gather", "nvlink", k_in, (k_in - 1) * k_out * b))


def _all_to_all_legs(sent: float, k: int, k_in: int, k_out: int) -> tuple:
    """What is bound for the node stays on NVLink, the rest goes on the network (at once)."""
    return (("all_to_all", "nvlink", k_in, sent * (k_in - 1) / (k - 1)),
            ("all_to_all", "network", k_out, sent * (k - k_in) / (k - 1)))


register(Collective("slice", lambda B, k: 0, lambda k: 0, "local_pad", _slice, local=True, lower=_lower_slice))
register(Collective("local_pad", lambda B, k: 0, lambda k: 0, "slice", _local_pad, local=True,
                    lower=_lower_local_pad))
register(Collective("all_gather", lambda B, k: (k - 1) * B, lambda k: k - 1, "reduce_scatter", _all_gather,
                    lower=_lower_all_gather, legs=_all_gather_legs))
register(Collective("all_reduce", lambda B, k: 2 * (k - 1) * B // k, lambda k: 2 * (k - 1), "all_reduce", _all_reduce,
                    lower=_lower_all_reduce, legs=_all_reduce_legs))
register(Collective("reduce_scatter", lambda B, k: (k - 1) * B // k, lambda k: k - 1, "all_gather", _reduce_scatter,
                    lower=_lower_reduce_scatter, legs=_reduce_scatter_legs))
register(Collective("all_to_all", lambda B, k: (k - 1) * B // k, lambda k: k - 1, "all_to_all", _all_to_all,
                    lower=_lower_all_to_all, legs=_all_to_all_legs, legs_at_once=True))
register(Collective("bucket", REGISTRY["all_reduce"].ring_bytes, REGISTRY["all_reduce"].ring_steps, "bucket",
                    _bucket, lower=_lower_bucket, logs_as="all_reduce"))  # B: the blocks' total bytes
register(Collective("collective_permute", lambda B, k: B, lambda k: 1, "collective_permute", _collective_permute,
                    lower=_lower_collective_permute, pairwise=True))


# ---- the events moves log: made here only ----------------------------------------------------------------


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
    c = REGISTRY[kind]
    return CommEvent(c.logs_as or kind, axes, c.ring_bytes(block_bytes, group), group)


def sent_event(kind: str, axes: tuple[str, ...], nbytes: int, group: int) -> CommEvent:
    """The event of collective ``kind`` over ``group`` devices that sends ``nbytes`` per device (bytes already
    counted, as a planned move's are)."""
    return CommEvent(REGISTRY[kind].logs_as or kind, axes, nbytes, group)


def stamped(e: CommEvent, op: str) -> CommEvent:
    """``e`` named after the public op and phase it runs in, with its estimated seconds."""
    seconds = current_cost_model().time(REGISTRY[e.kind].ring_steps(e.group), e.bytes, e.axes)
    return e._replace(op=op, phase=current_phase(), seconds=seconds)
