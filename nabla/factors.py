"""Factor kinds: how a factor of an op's rule behaves when mesh axes shard it. A kind says how it
propagates (may it carry axes, is it contracted, which axis lists it accepts) and what the executor does
to an operand dim holding it before the local kernel, with that step's communication. A new kind is one class."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd, prod
from typing import Any, Callable, ClassVar, NamedTuple

import numpy as np

from .dtypes import is_inexact
from .mesh import AxisRef
from . import collectives as C
from . import windows as W
from .storage import fill, pad_regions
from .layout import chunks, grid
from .backends import xp


class OperandContext(NamedTuple):
    """What a kind needs to prepare one operand: its layout on the op's common grid, and the op's reduction."""

    spec: Any  # ShardingSpec the operand is in when the kernel runs
    cuts: tuple  # the op's common refinement of mesh axes into atoms
    shape: tuple[int, ...]
    dtype: np.dtype
    reduction: str  # "sum", "max" or "min": what a sharded reduce factor leaves
    operand: int = 0  # which operand of the op


class LocalStep(NamedTuple):
    """A transformation of an operand's stored blocks before the kernel, and the collectives it amounts to;
    ``lower(block, dev)`` does the same to one device's block inside ``nb.jit`` (``dev`` gives the device's
    coordinates and a ``ppermute`` over mesh positions)."""

    apply: Callable[[Any], Any]
    events: tuple = ()
    lower: Callable[[Any, Any], Any] | None = None
    windows: tuple | None = None  # (G, fill, HaloMoves): a window step :func:`merge_windows` may join


class Bound(NamedTuple):
    """``fn`` with its trailing arguments bound: a local step's work as data (a step compares equal to, and
    pickles as, the step planned again; a closure did neither)."""

    fn: Callable
    args: tuple

    def __call__(self, *leading: Any) -> Any:
        return self.fn(*leading, *self.args)


def _view_key(plans: list, G: int) -> tuple | None:
    """The block index that is every window of ``plans`` when each windowed dim is whole on every device and its
    window lies inside it (a slice of an unsharded dim): the step is then a view, known when it is planned."""
    key = [slice(None)] * (G + max((d for d, _, _ in plans), default=-1) + 1)
    for d, _, h in plans:
        if isinstance(h, int) or h.k != 1 or h.lo[0] < 0 or h.lo[0] + h.width > h.n_in:
            return None
        key[G + d] = slice(h.lo[0], h.lo[0] + h.width)
    return tuple(key) if plans else None


def merge_windows(steps: tuple[LocalStep, ...] | list[LocalStep]) -> tuple[LocalStep, ...]:
    """Window steps of one operand (one per windowed dim, same fill) as one: a numpy block is copied once into
    a buffer of all its windows (the registry's ``"halo"`` over every dim) rather than once per dim. Same blocks, same
    collectives (the steps' events in order); other backends still run the steps one after another."""
    out: list[LocalStep] = []
    for step in steps:
        prev = out[-1] if out else None
        if prev is None or prev.windows is None or step.windows is None or prev.windows[:2] != step.windows[:2] \
                or {d[0] for d in prev.windows[2]} & {d[0] for d in step.windows[2]}:
            out.append(step)
            continue
        first, second = prev, step
        G, fill_, dims = first.windows[0], first.windows[1], first.windows[2] + second.windows[2]
        lower = Bound(_merged_lower, (first, second)) if first.lower and second.lower else None
        out[-1] = LocalStep(Bound(_merged_apply, (first, second, G, dims)), first.events + second.events, lower,
                            (G, fill_, dims))
    return tuple(out)


def _merged_apply(x: Any, first: LocalStep, second: LocalStep, G: int, dims: tuple) -> Any:
    if type(x) is np.ndarray:
        return C.REGISTRY["halo"].move(x, G, dims, "")
    return second.apply(first.apply(x))


def _merged_lower(x: Any, dev: Any, first: LocalStep, second: LocalStep) -> Any:
    return second.lower(first.lower(x, dev), dev)


@dataclass(frozen=True)
class FactorKind:
    """Base kind: a factor that may be sharded and needs nothing from the executor (pass-through)."""

    name: ClassVar[str] = "pass"
    shardable: ClassVar[bool] = True  # False: the factor must stay whole on every tensor
    contracting: ClassVar[bool] = False  # True: sharded on the operands, it leaves partial sums on the result
    windowed: ClassVar[bool] = False  # True: operand and result rows differ; shardable even at size 0 or 1

    def limit(self, size: int, axes: tuple[AxisRef, ...]) -> tuple[AxisRef, ...]:
        """The longest prefix of ``axes`` this factor can be sharded on."""
        return axes

    def prepare(self, ctx: OperandContext, dims: tuple[int, ...]) -> LocalStep | None:
        """What the executor does to operand dims ``dims`` (all holding factors of this kind)."""
        return None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Pass(FactorKind):
    """Dims that map element to element (batch, M, N): each device computes the rows it holds."""


@dataclass(frozen=True)
class Reduce(FactorKind):
    """A contracted or reduced factor: sharded, each device reduces its rows and the result is partial."""

    name: ClassVar[str] = "reduce"
    contracting: ClassVar[bool] = True

    def prepare(self, ctx: OperandContext, dims: tuple[int, ...]) -> LocalStep | None:

        regions = tuple(r for d in dims for r in pad_regions(ctx.spec, ctx.shape, d, ctx.cuts))
        if not regions:
            return None
        value = neutral(ctx.reduction, ctx.dtype)  # padding past a dim's end must not count
        return LocalStep(Bound(fill, (regions, value)), (), Bound(_neutral_padding, (ctx.spec, ctx.shape, dims, value)))


def _neutral_padding(x: Any, dev: Any, spec: Any, shape: tuple, dims: tuple, value: Any) -> Any:
    """One device's block with the rows past each dim's end set to the reduction's neutral value."""
    c = chunks(spec, shape)
    for d in dims:
        k, n = spec.num_shards(d), shape[d]
        if k * c[d] == n:
            continue
        valid = dev.xp.clip(n - dev.linear(spec.dim_refs[d]) * c[d], 0, c[d])
        rows = dev.xp.arange(c[d]).reshape((-1,) + (1,) * (len(shape) - d - 1))
        x = dev.xp.where(rows >= valid, value, x)
    return x


@dataclass(frozen=True)
class Replicate(FactorKind):
    """A factor every device needs whole (a concatenated dim, a cut slice, argmax's searched dim)."""

    name: ClassVar[str] = "replicate"
    shardable: ClassVar[bool] = False


@dataclass(frozen=True)
class Permute(FactorKind):
    """A reversed dim: block ``p`` of the result is block ``k-1-p`` of the operand reversed, so the factor
    keeps its sharding and each device sends its block to its mirror (one collective_permute)."""

    name: ClassVar[str] = "permute"

    def limit(self, size: int, axes: tuple[AxisRef, ...]) -> tuple[AxisRef, ...]:
        return divisible_prefix(axes, size)  # only even shards map onto each other

    def prepare(self, ctx: OperandContext, dims: tuple[int, ...]) -> LocalStep | None:

        g = grid(ctx.spec, ctx.cuts)
        dims = tuple(d for d in dims if ctx.spec.dim_specs[d].axes)
        if not dims:
            return None
        flips = tuple(a for d in dims for a in g.dims[d])
        names = tuple(a for d in dims for a in ctx.spec.dim_specs[d].axes)
        block = prod(chunks(ctx.spec, ctx.shape)) * ctx.dtype.itemsize
        k = prod(g.shape[a] for a in flips)
        # over axes of size 1 every device is its own mirror: nothing moves, nothing is logged
        events = (C.event("mirror", names, block, k),) if k > 1 else ()
        move = Mirror(flips, tuple(r for d in dims for r in ctx.spec.dim_refs[d]), k)
        return LocalStep(Bound(_mirror_apply, (move,)), events, Bound(_mirror_lower, (move,)))


def _mirror_apply(x: Any, move: Mirror) -> Any:
    return C.REGISTRY["mirror"].move(x, 0, move, "")


def _mirror_lower(x: Any, dev: Any, move: Mirror) -> Any:
    return C.REGISTRY["mirror"].lower(x, move, dev)


class Mirror(NamedTuple):
    """The registry's ``"mirror"`` move: each device sends its block to the device at the mirrored position along
    ``refs`` (``k`` of them; on vectorised storage, grid axes ``flips`` reversed)."""

    flips: tuple[int, ...]
    refs: tuple
    k: int


def _mirror(x, G, m: Mirror, reduce_op):
    # mixed radix over the dim's atoms: mirroring the position flips every digit
    return xp(x).flip(x, axis=m.flips)


def _lower_mirror(x, m: Mirror, dev):
    """Each device receives its mirror's block (the kernel reverses it locally)."""
    if m.k == 1:
        return x
    return dev.ppermute(x, dev.pairs(lambda q: m.k - 1 - q, m.refs))


# on the wire a collective_permute; reversing twice is the identity, so it is its own transpose
C.register(C.Collective("mirror", lambda B, k: B, lambda k: 1, "mirror", _mirror, lower=_lower_mirror,
                        logs_as="collective_permute"))


class WindowSpec(NamedTuple):
    """Result row ``o`` of a windowed dim reads operand rows ``o*stride - pad_lo + j*dilation``, ``j < kernel``
    (rows outside ``[0, n_in)`` are padding)."""

    n_in: int
    kernel: int = 1
    stride: int = 1
    dilation: int = 1
    pad_lo: int = 0


@dataclass(frozen=True)
class Window(FactorKind):
    """A dim read through windows (a conv or pool's spatial dim, a slice, a concatenated dim): operand and
    result keep one sharding, each device computes the result rows it owns, and receives from its neighbours
    only the rows its windows read (collective_permutes of the halo, GSPMD's windowed partitioning). The
    operand's block along the dim becomes its window, padding filled with ``fill``; the kernel then runs a
    valid (unpadded) window op. ``windows`` has one entry per operand (None where the factor is absent)."""

    name: ClassVar[str] = "window"
    windowed: ClassVar[bool] = True
    n_out: int = 0
    windows: tuple = ()
    fill: float = 0.0
    before: tuple = ()  # per operand: (dim, n_out, WindowSpec) of its windowed dims extended before this one

    def prepare(self, ctx: OperandContext, dims: tuple[int, ...]) -> LocalStep | None:

        win = self.windows[ctx.operand]
        if win is None:
            return None
        g = grid(ctx.spec, ctx.cuts)
        block = list(chunks(ctx.spec, ctx.shape))
        G = len(g.shape)
        for d, n_out, w in (self.before[ctx.operand] or ()) if ctx.operand < len(self.before) else ():
            if n_out and w.n_in:  # an earlier dim is its window by now: this dim's halo rows span it
                k = prod(g.shape[a] for a in g.dims[d] if g.shape[a] > 1)
                block[d] = W.halo(w.n_in, n_out, k, w.kernel, w.stride, w.dilation, w.pad_lo).width
        events = []
        plans = []
        for d in dims:
            atoms = tuple(a for a in g.dims[d] if g.shape[a] > 1)
            k = prod(g.shape[a] for a in atoms)
            names = ctx.spec.dim_specs[d].axes
            if self.n_out == 0 or win.n_in == 0:  # nothing to read: an empty result, or only padding
                width = 0 if self.n_out == 0 else W.halo(1, self.n_out, k, win.kernel, win.stride, win.dilation,
                                                          win.pad_lo).width
                plans.append((d, atoms, width))
                block[d] = width
                continue
            h = W.halo(win.n_in, self.n_out, k, win.kernel, win.stride, win.dilation, win.pad_lo)
            row = prod(b for i, b in enumerate(block) if i != d) * ctx.dtype.itemsize
            for rows, _ in halo_rounds(h):  # one collective_permute per round, sized by the most rows sent
                events.append(C.event("halo", names, rows * row, k))
            plans.append((d, atoms, HaloMove(d, atoms, ctx.spec.dim_refs[d], h, win, self.n_out, self.fill)))
            block[d] = h.width

        view = _view_key([(d, a, m if isinstance(m, int) else m.halo) for d, a, m in plans], G)
        plans = tuple(plans)
        many = None if any(isinstance(m, int) for _, _, m in plans) else (G, self.fill, tuple(m for _, _, m in plans))
        return LocalStep(Bound(_windows_apply, (view, many, plans, G, self.fill)), tuple(events),
                         Bound(_windows_lower, (plans, self.fill)), many)


def _windows_apply(x: Any, view: tuple | None, many: tuple | None, plans: tuple, G: int, fill_: float) -> Any:
    """Stored blocks -> the rows each device's windows read (halo rows from its neighbours)."""
    if view is not None and type(x) is np.ndarray:  # every window inside its whole dim: a view
        return x[view]
    halo = C.REGISTRY["halo"]
    if many is not None:  # every dim a halo: one move (numpy blocks: one buffer, slices)
        return halo.move(x, G, many[2], "")
    for d, _, m in plans:
        if isinstance(m, int):
            shape = list(x.shape)
            shape[G + d] = m
            x = np.full(shape, W.fill_value(fill_, x.dtype), dtype=x.dtype)
            continue
        x = halo.move(x, G, (m,), "")
    return x


def _windows_lower(x: Any, dev: Any, plans: tuple, fill_: float) -> Any:
    """``_windows_apply`` on one device's block inside ``nb.jit``."""
    for d, _, m in plans:
        if isinstance(m, int):
            shape = list(x.shape)
            shape[d] = m
            x = dev.xp.full(shape, W.fill_value(fill_, x.dtype), dtype=x.dtype)
        else:
            x = C.REGISTRY["halo"].lower(x, (m,), dev)
    return x


class HaloMove(NamedTuple):
    """The registry's ``"halo"`` move: dim ``dim`` of a block (on grid ``atoms`` of vectorised storage, on mesh
    axes ``refs`` of a device) becomes the rows its windows read (``halo``: ``windows.halo``'s plan), padding
    filled with ``fill``."""

    dim: int
    atoms: tuple[int, ...]
    refs: tuple
    halo: Any
    win: WindowSpec
    n_out: int
    fill: float

    @property
    def dims(self) -> tuple:
        """This dim as ``windows.extend_many`` takes it."""
        w = self.win
        return (self.dim, self.atoms, w.n_in, self.n_out, w.kernel, w.stride, w.dilation, w.pad_lo)


def _halo(x, G, ms: tuple[HaloMove, ...], reduce_op):
    """Every dim of ``ms`` (one fill) made its windows' rows; numpy blocks in one buffer, by slices."""
    if type(x) is np.ndarray:
        return W.extend_many(x, G, [m.dims for m in ms], ms[0].fill)
    for m in ms:
        x = W.extend(x, *m.dims[:1], G, *m.dims[1:], m.fill)
    return x


def _lower_halo_move(x, ms: tuple[HaloMove, ...], dev):
    for m in ms:
        if m.halo.k == 1:  # one device: its window is its own rows and padding
            x = W.extend(x, m.dim, 0, (), *m.dims[2:], m.fill)
        else:
            x = _halo_lower(x, m.dim, m.refs, m.halo, m.fill, dev)
    return x


def _halo_pieces(h, src):
    """Rows device p takes from device src[p]'s block: (offset in that block, offset in p's window, count). It
    takes the slab from the first to the last row its windows read there (a dilated window skips whole
    neighbours: their slab is empty)."""
    k, ci, width = h.k, h.ci, h.width
    lo = np.asarray(h.lo)
    pos = np.arange(k)
    slab = np.asarray(h.slabs, dtype=np.int64).reshape(k, k, 2)  # [p, s]: the rows p reads from s
    ok = (src >= 0) & (src < k)
    s = np.clip(src, 0, k - 1)
    start = np.where(ok, np.maximum(slab[pos, s, 0], lo), 0)
    end = np.where(ok, np.minimum(slab[pos, s, 1], lo + width), 0)
    count = np.maximum(end - start, 0)
    return np.where(count > 0, start - src * ci, 0), np.where(count > 0, start - lo, 0), count


@lru_cache(maxsize=4096)
def halo_rounds(h) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """The halo exchange as rounds of one collective_permute each: ``(rows, ((distance, direction), ...))``.
    Each (distance, direction) moves rows from the device that far to the left (-1) or right (+1) to the
    devices that need them; those whose senders and receivers do not collide share a round (a slice
    ``x[4:12]`` of 16 rows on 4 devices: device 1 -> 0 and 2 -> 3 in one round). A round sends as many rows
    as its largest part; parts are placed largest first, each in the first round it fits."""
    pos = np.arange(h.k)
    parts = []
    for dist in range(1, h.max_hops + 1):
        for direction in (-1, 1):
            count = _halo_pieces(h, pos + direction * dist)[2]
            if count.max(initial=0) > 0:
                recv = frozenset(int(p) for p in pos[count > 0])
                parts.append((int(count.max()), frozenset(p + direction * dist for p in recv), recv,
                              (dist, direction)))
    rounds: list[list] = []  # [rows, senders, receivers, parts]
    for rows, snd, rcv, key in sorted(parts, key=lambda t: -t[0]):
        for r in rounds:
            if not (r[1] & snd) and not (r[2] & rcv):
                r[1], r[2] = r[1] | snd, r[2] | rcv
                r[3].append(key)
                break
        else:
            rounds.append([rows, snd, rcv, [key]])
    return tuple((r[0], tuple(r[3])) for r in rounds)


def _halo_lower(x, d: int, refs, h, fill, dev):
    """One device's window along dim ``d`` (sharded on ``refs``): start from padding, write in what it holds
    of its window, and for each round of ``halo_rounds`` receive (one ppermute) the rows its windows read from
    the device its part of the round names; every sender sends the same number of rows, the most any receiver
    of the round needs."""

    xp, lax = dev.xp, dev.lax
    k, ci, width = h.k, h.ci, h.width
    rank = x.ndim
    value = W.fill_value(fill, x.dtype)
    lo = np.asarray(h.lo)
    pos = np.arange(k)
    slab = np.asarray(h.slabs).reshape(k, k, 2)  # [p, s]: the rows p receives from s

    def along(arr, length):
        return arr.reshape((1,) * d + (length,) + (1,) * (rank - d - 1))

    def write(win, piece, at, count):
        r = piece.shape[d]
        region = lax.dynamic_slice_in_dim(win, at, r, axis=d)
        keep = along(xp.arange(r), r) < count
        return lax.dynamic_update_slice_in_dim(win, xp.where(keep, piece, region), at, axis=d)

    me = dev.linear(refs)
    shape = list(x.shape)
    shape[d] = width + ci
    win = xp.full(shape, value, dtype=x.dtype)  # room past the window for a full slab at its end
    pad = [(0, 0)] * rank
    pad[d] = (0, ci)
    xpad = xp.pad(x, pad)
    # what it holds: its own rows inside the window (and inside the dim)
    own_start = np.maximum(pos * ci, lo)
    own_count = np.maximum(np.minimum(np.minimum((pos + 1) * ci, lo + width), h.n_in) - own_start, 0)
    if own_count.max() > 0:
        r = int(own_count.max())
        src_off = np.where(own_count > 0, own_start - pos * ci, 0)
        dst_off = np.where(own_count > 0, own_start - lo, 0)
        piece = lax.dynamic_slice_in_dim(xpad, xp.asarray(src_off)[me], r, axis=d)
        win = write(win, piece, xp.asarray(dst_off)[me], xp.asarray(own_count)[me])
    for r, parts in halo_rounds(h):  # one ppermute per round; its parts' senders and receivers are distinct
        send_off = np.zeros(k, dtype=np.int64)
        dst_off = np.zeros(k, dtype=np.int64)
        count = np.zeros(k, dtype=np.int64)
        target: dict[int, int] = {}
        for dist, direction in parts:
            src_off, d_off, c = _halo_pieces(h, pos + direction * dist)
            for p in pos[c > 0]:  # receiver p takes c[p] rows from sender p + direction*dist
                u = int(p + direction * dist)
                target[u] = int(p)
                send_off[u] = src_off[p]
                dst_off[p], count[p] = d_off[p], c[p]
        piece = lax.dynamic_slice_in_dim(xpad, xp.asarray(send_off)[me], r, axis=d)
        got = dev.ppermute(piece, dev.pairs(lambda q, t=target: t.get(q), refs))
        win = write(win, got, xp.asarray(dst_off)[me], xp.asarray(count)[me])
    return win[(slice(None),) * d + (slice(0, width),)]


# on the wire one collective_permute a round (``halo_rounds``); its transpose sends the cotangent rows back along
# the same routes, reversed, and adds them where they land: the same exchange
C.register(C.Collective("halo", lambda B, k: B, lambda k: 1, "halo", _halo, lower=_lower_halo_move,
                        logs_as="collective_permute"))

PASS, REDUCE, REPLICATE, PERMUTE = Pass(), Reduce(), Replicate(), Permute()


def divisible_prefix(axes: tuple[AxisRef, ...], size: int) -> tuple[AxisRef, ...]:
    """The longest prefix of ``axes`` whose shard count divides ``size``; where only part of an axis fits,
    its major sub-axis of that size (on ``x`` of 4, a factor of 6 takes ``x:(1)2``)."""
    out: list[AxisRef] = []
    k = 1
    for r in axes:
        rest = size // k
        if rest % r.size == 0:
            out.append(r)
            k *= r.size
            continue
        g = gcd(rest, r.size)
        if g > 1:
            out.append(AxisRef(r.name, r.pre, g, r.full))
        break
    return tuple(out)


def neutral(reduction: str, dtype: np.dtype) -> Any:
    """The value that padding must hold so that a reduction ignores it."""
    if reduction == "sum":
        return dtype.type(0)
    if is_inexact(dtype):
        big = np.inf
    elif dtype.kind in "iu":
        big = np.iinfo(dtype).max
    else:
        big = True
    lo = -np.inf if is_inexact(dtype) else (np.iinfo(dtype).min if dtype.kind in "iu" else False)
    if dtype.kind == "c":  # complex numbers order by real part, then imaginary part: -inf-infj is below all
        return dtype.type(complex(lo, lo)) if reduction == "max" else dtype.type(complex(big, big))
    return lo if reduction == "max" else big
