"""General exchanges: who sends which piece to whom when every device receives exactly the pieces of its target
block that it lacks, as collective_permute rounds (a proper edge colouring of senders and receivers). Worked out
on arrays (a 512-device exchange has a quarter of a million pieces): the rounds' sizes for pricing, the pieces
themselves only for ``exchange_detail``'s callers (lowering)."""

from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import NamedTuple

import numpy as np

from .. import collectives as C
from ..errors import ShardingError
from ..layout import chunk, chunks, dim_position, grid
from ..spec import ShardingSpec
from .bounds import boxes, grid_coords


@lru_cache(maxsize=16384)
def exchange_rounds(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> tuple:
    """The collective_permute rounds of a general exchange from ``src`` to ``dst`` (equal partial axes): per
    round, (bytes per device, mesh axes data crosses, devices that send). Every device sends the same slab
    shape in a round (the largest piece's extent per dim), so that is what a round costs."""
    p = _pieces(shape, src, dst)
    return tuple((prod(slab) * itemsize, crossed, n) for slab, crossed, n in _summary(src.mesh, p) if prod(slab))


class Exchange(NamedTuple):
    """A planned exchange, carried by its move (``Move.exchange``): the rounds it was priced by and, for the
    readers that carry it out (lowering), its pieces. The pieces are worked out by the planner's cached
    ``exchange_detail`` on first read, not when planned: a search prices many exchanges it never takes."""

    shape: tuple[int, ...]
    itemsize: int
    src: ShardingSpec
    dst: ShardingSpec
    rounds: tuple  # per round (bytes per device, mesh axes crossed, senders): what the move costs and logs

    @property
    def pieces(self) -> tuple[Round, ...]:
        """Who sends which piece to whom, per round (the rounds priced: one ``Round`` each, empty ones too)."""
        return exchange_detail(self.shape, self.src, self.dst)


def planned_exchange(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> Exchange:
    """The exchange from ``src`` to ``dst`` as its move carries it (its rounds priced, ``exchange_rounds``)."""
    return Exchange(tuple(shape), itemsize, src, dst, exchange_rounds(tuple(shape), itemsize, src, dst))


class Round(NamedTuple):
    """One collective_permute of an exchange: (sender, receiver, piece) with devices as mesh positions and
    the piece as a global box ((start, stop) per dim); ``slab`` the extent every sender sends per dim."""

    pieces: tuple
    slab: tuple[int, ...]
    crossed: tuple[str, ...]


@lru_cache(maxsize=16384)
def exchange_detail(shape: tuple[int, ...], src: ShardingSpec, dst: ShardingSpec) -> tuple[Round, ...]:
    """Who sends which piece to whom in an exchange from ``src`` to ``dst``. Pieces are cut at source block
    boundaries; each comes from a holder with the receiver's partial coordinates (the least loaded replica);
    rounds are a proper edge colouring, so each device sends and receives at most one piece a round."""
    p = _pieces(shape, src, dst)
    u, v, lo, hi = (p.sender[p.order].tolist(), p.receiver[p.order].tolist(), p.lo[p.order].tolist(),
                    p.hi[p.order].tolist())
    rounds, k = [], 0
    for (slab, crossed, n) in _summary(src.mesh, p):
        es = tuple((u[e], v[e], tuple(zip(lo[e], hi[e]))) for e in range(k, k + n))
        rounds.append(Round(es, slab, crossed))
        k += n
    return tuple(rounds)


class _Pieces(NamedTuple):
    """An exchange's pieces in the order they are cut (receivers in mesh order, each one's pieces in row-major
    order of source blocks): sender, receiver, box (``lo``, ``hi``: start and stop per dim), round; ``order``
    sorts them by round, each round's pieces in cut order."""

    sender: np.ndarray
    receiver: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    colour: np.ndarray
    order: np.ndarray


def _pieces(shape: tuple[int, ...], src: ShardingSpec, dst: ShardingSpec) -> _Pieces:
    """Every receiver's lacking pieces, cut at source block boundaries, each with its sender, and their rounds."""
    mesh = src.mesh
    sb, tb = boxes(src, shape), boxes(dst, shape)
    gs = grid(src)
    n, rank = mesh.size, len(shape)
    coords = grid_coords(mesh.shape)
    # the partial coordinates of each device (summands are sent only to receivers with the same ones)
    pc = np.zeros(n, dtype=np.int64)
    for a in gs.partial:
        atom = gs.atoms[a]
        pc = pc * atom.size + (coords[:, mesh.axis_index(atom.name)] // atom.minor) % atom.size
    # source blocks along each dim (they do not overlap: sorted by start, also sorted by end); each device's
    blocks, own = [], np.zeros((n, rank), dtype=np.int64)
    for j in range(rank):
        st, idx = np.unique(sb[:, j, :], axis=0, return_inverse=True)
        blocks.append(st)
        own[:, j] = idx.reshape(-1)
    # per receiver and dim, the source blocks its target block overlaps: [first, stop)
    first, count = np.zeros((n, rank), dtype=np.int64), np.zeros((n, rank), dtype=np.int64)
    for j in range(rank):
        a, b = tb[:, j, 0], tb[:, j, 1]
        k0 = np.searchsorted(blocks[j][:, 1], a, side="right")
        k1 = np.searchsorted(blocks[j][:, 0], b, side="left")
        first[:, j], count[:, j] = k0, np.where(a < b, np.maximum(k1 - k0, 0), 0)
    total = np.prod(count, axis=1)
    recv = np.repeat(np.arange(n, dtype=np.int64), total)
    t = np.arange(len(recv), dtype=np.int64) - np.repeat(np.cumsum(total) - total, total)
    k = np.zeros((len(recv), rank), dtype=np.int64)
    lo, hi = np.zeros_like(k), np.zeros_like(k)
    stride = np.ones(len(recv), dtype=np.int64)
    for j in reversed(range(rank)):  # row-major over the dims: the last dim's blocks vary fastest
        c = count[recv, j]
        k[:, j] = first[recv, j] + (t // stride) % c
        stride = stride * c
        lo[:, j] = np.maximum(tb[recv, j, 0], blocks[j][k[:, j], 0])
        hi[:, j] = np.minimum(tb[recv, j, 1], blocks[j][k[:, j], 1])
    # the holders of each (source block, partial coordinates): devices in mesh order
    sizes = [len(b) for b in blocks] + [int(pc.max(initial=0)) + 1]
    key_of = np.ravel_multi_index(tuple(own.T) + (pc,), sizes)
    key = np.ravel_multi_index(tuple(k.T) + (pc[recv],), sizes)
    by_key = np.argsort(key_of, kind="stable")
    start = np.searchsorted(key_of[by_key], key, side="left")
    holders = np.searchsorted(key_of[by_key], key, side="right") - start
    if np.any(holders == 0):
        e = int(np.argmax(holders == 0))
        block = tuple(tuple(blocks[j][k[e, j]].tolist()) for j in range(rank))
        raise ShardingError(f"internal: no device holds block {block} of {src!r}")
    keep = key != key_of[recv]  # the receiver holds it already
    recv, lo, hi, start, holders = recv[keep], lo[keep], hi[keep], start[keep], holders[keep]
    size = np.prod(hi - lo, axis=1)
    if np.all(holders == 1):
        sender = by_key[start]
    else:
        sender = _least_loaded(by_key, key_of, recv, start, holders, size)
    colour = np.asarray(_colouring(sender, recv, size), dtype=np.int64).reshape(-1)
    return _Pieces(sender, recv, lo, hi, colour, np.argsort(colour, kind="stable"))


def _least_loaded(by_key: np.ndarray, key_of: np.ndarray, recv: np.ndarray, start: np.ndarray,
                  holders: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Each piece's sender where blocks have replicas: in cut order, the holder that has sent the fewest elements
    so far, the receiver's own replica index among them preferred on a tie (a replica sends to its own kind)."""
    rank_in = np.empty(len(by_key), dtype=np.int64)  # a device's index among the holders of its own block
    first = np.searchsorted(key_of[by_key], key_of[by_key], side="left")
    rank_in[by_key] = np.arange(len(by_key)) - first
    order, rk = by_key.tolist(), rank_in.tolist()
    load = [0] * len(by_key)
    out = []
    for i, s, h, z in zip(recv.tolist(), start.tolist(), holders.tolist(), size.tolist()):
        hs = order[s:s + h]
        if h == 1:
            sender = hs[0]
        else:
            preferred = hs[rk[i] % h]
            sender = min(hs, key=lambda d: (load[d], d != preferred))
        load[sender] += z
        out.append(sender)
    return np.array(out, dtype=np.int64)


def _summary(mesh, p: _Pieces) -> list[tuple[tuple[int, ...], tuple[str, ...], int]]:
    """Per round (in colour order): the slab (the largest piece's extent per dim), the mesh axes some piece
    crosses, and how many pieces it moves."""
    if not len(p.order):
        return []
    c = p.colour[p.order]
    cuts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    ext = (p.hi - p.lo)[p.order]
    slabs = np.maximum.reduceat(ext, cuts, axis=0) if ext.shape[1] else np.zeros((len(cuts), 0), dtype=np.int64)
    coords = grid_coords(mesh.shape)  # devices as mesh positions
    moved = (coords[p.sender[p.order]] != coords[p.receiver[p.order]]).astype(np.int64)
    crossed = np.maximum.reduceat(moved, cuts, axis=0) if moved.shape[1] else np.zeros((len(cuts), 0), np.int64)
    counts = np.diff(np.r_[cuts, len(c)])
    return [(tuple(int(x) for x in s), tuple(nm for nm, m in zip(mesh.axis_names, cr) if m), int(n))
            for s, cr, n in zip(slabs.tolist(), crossed.tolist(), counts.tolist())]


def _edge_colouring(edges: list[tuple[int, int, int]]) -> list[int]:
    """A proper colouring of a bipartite multigraph (senders, receivers) with max-degree colours (Koenig). The
    regular exchanges of a mesh (a gather, a transpose) colour by shift: edges that move data the same number of
    mesh positions form one round when each sends and receives once (O(edges)); otherwise Koenig's method."""
    e = np.asarray(edges, dtype=np.int64).reshape(len(edges), 3)
    return list(_colouring(e[:, 0], e[:, 1], e[:, 2]))


def _colouring(u: np.ndarray, v: np.ndarray, size: np.ndarray) -> list[int] | np.ndarray:
    """``_edge_colouring`` of the edges (``u[k]``, ``v[k]``, ``size[k]``)."""
    by_shift = _shift_colouring(u, v)
    return by_shift if by_shift is not None else _koenig(u.tolist(), v.tolist(), size.tolist())


def _shift_colouring(u: np.ndarray, v: np.ndarray) -> np.ndarray | None:
    """Colour each edge (u, v) by ``v - u``, when that is proper and uses as many colours as the largest degree
    (the fewest any colouring can); None otherwise. Colours are numbered in order of first use."""
    if not len(u):
        return np.zeros(0, dtype=np.int64)
    n = int(max(u.max(), v.max())) + 1
    shifts, first, inv = np.unique((v - u) % n, return_index=True, return_inverse=True)
    k = len(shifts)
    rank = np.empty(k, dtype=np.int64)
    rank[np.argsort(first)] = np.arange(k)
    colour = rank[inv.reshape(-1)]
    if _repeats(u * k + colour) or _repeats(v * k + colour):
        return None  # a device would send, or receive, twice in a round
    if k != max(int(np.bincount(u).max()), int(np.bincount(v).max())):
        return None
    return colour


def _repeats(x: np.ndarray) -> bool:
    """Whether some value occurs twice in ``x``."""
    x = np.sort(x)
    return bool(np.any(x[1:] == x[:-1]))


def _koenig(us: list[int], vs: list[int], sizes: list[int]) -> list[int]:
    """Koenig's edge colouring of the edges (``us[k]``, ``vs[k]``), big pieces first (they share rounds): where
    the first colour free at the sender is taken at the receiver, swap the colours of an alternating path. Per
    node, a table colour -> edge (-1: free)."""
    if not us:
        return []
    n = max(max(us), max(vs)) + 1
    width = max(max(np.bincount(us)), max(np.bincount(vs))) + 1
    at_u = [[-1] * width for _ in range(n)]
    at_v = [[-1] * width for _ in range(n)]
    colour = [-1] * len(us)
    for e in sorted(range(len(us)), key=lambda e: -sizes[e]):
        u, v = us[e], vs[e]
        cu, cv = at_u[u], at_v[v]
        a, b = cu.index(-1), cv.index(-1)
        if cv[a] != -1:  # walk v -a- u1 -b- v2 -a- ... and swap a and b along the path; then a is free at v: its
            # edges trade colours, and on every node it passes the a and b entries trade places (its ends hold one)
            tables, f = [cv], cv[a]
            while f >= 0:
                colour[f] = b
                t = at_u[us[f]]
                tables.append(t)
                f = t[b]
                if f < 0:
                    break
                colour[f] = a
                t = at_v[vs[f]]
                tables.append(t)
                f = t[a]
            for t in tables:
                t[a], t[b] = t[b], t[a]
        colour[e] = a
        cu[a] = e
        cv[a] = e
    return colour


# ---- the registry's "exchange": its move on vectorised storage and its jax.lax twin -------------------------


def _exchange(x, G, s, reduce_op):
    """Each device receives the pieces its new layout needs. On vectorised storage: move the leaving atoms into
    their dims, then cut the dims onto the arriving ones (atoms only reordered within a dim: a block permute)."""
    if all(set(old) == set(new) for _, old, new, _, _, _ in s.moves):
        for _, old, new, _, _, _ in s.moves:
            x = C.permute_blocks(x, old, new)
        return x
    for d, old, _, _, _, whole in s.moves:
        x = C.gather_into(x, G, d, old, whole)
    for d, _, new, sizes, c, _ in s.moves:
        x = C.split_onto(x, G, d, new, sizes, c)
    return x


def _lower_exchange(x, s, ctx):
    """Every device keeps what it holds of its target block and receives the rest, one ppermute a round (the
    pieces of the exchange its move carries: the rounds the planner priced)."""
    xp, lax = ctx.xp, ctx.lax
    ex = s.exchange
    src, dst, shape, rounds = ex.src, ex.dst, ex.shape, ex.pieces
    sb, tb = boxes(src, tuple(shape)), boxes(dst, tuple(shape))
    mesh = src.mesh
    n = len(mesh.devices)
    cs, ct = chunks(src, shape), chunks(dst, shape)
    # block origins (unclipped ceil-rule starts) per mesh position
    s_origin = np.array([[_origin(src, shape, p, j) for j in range(len(shape))] for p in range(n)],
                        dtype=np.int64).reshape(n, len(shape))
    t_origin = np.array([[_origin(dst, shape, p, j) for j in range(len(shape))] for p in range(n)],
                        dtype=np.int64).reshape(n, len(shape))
    me = ctx.position()
    out = xp.zeros(ct, dtype=x.dtype)

    def write(out, piece, recv_off, size):
        slab = piece.shape
        big = xp.pad(out, [(0, s) for s in slab])
        region = lax.dynamic_slice(big, tuple(recv_off), slab)
        mask = xp.asarray(True)
        for j, s in enumerate(slab):
            iota = xp.arange(s).reshape((-1,) + (1,) * (len(slab) - j - 1))
            mask = mask & (iota < size[j])
        big = lax.dynamic_update_slice(big, xp.where(mask, piece, region), tuple(recv_off))
        return big[tuple(slice(0, c) for c in ct)]

    # what this device already holds of its target block
    lo = np.maximum(sb[..., 0], tb[..., 0])
    hi = np.minimum(sb[..., 1], tb[..., 1])
    size = np.maximum(hi - lo, 0)
    has = (size > 0).all(axis=1)
    size = np.where(has[:, None], size, 0)
    send_off = np.where(has[:, None], lo - s_origin, 0)
    recv_off = np.where(has[:, None], lo - t_origin, 0)
    slab = tuple(int(v) for v in size.max(axis=0)) if n else ()
    if all(slab):
        src_block = xp.pad(x, [(0, s) for s in slab])
        piece = lax.dynamic_slice(src_block, tuple(xp.asarray(send_off)[me]), slab)
        out = write(out, piece, xp.asarray(recv_off)[me], xp.asarray(size)[me])
    for r in rounds:
        if not all(r.slab):
            continue
        send = np.zeros((n, len(shape)), dtype=np.int64)
        recv = np.zeros((n, len(shape)), dtype=np.int64)
        sizes = np.zeros((n, len(shape)), dtype=np.int64)
        pairs = []
        for u, v, box in r.pieces:
            start = np.array([b[0] for b in box])
            send[u] = start - s_origin[u]
            recv[v] = start - t_origin[v]
            sizes[v] = [b[1] - b[0] for b in box]
            pairs.append((u, v))
        src_block = xp.pad(x, [(0, s) for s in r.slab])
        piece = lax.dynamic_slice(src_block, tuple(xp.asarray(send)[me]), r.slab)
        got = ctx.ppermute(piece, pairs)
        out = write(out, got, xp.asarray(recv)[me], xp.asarray(sizes)[me])
    return out


def _origin(spec: ShardingSpec, shape, p: int, j: int) -> int:
    """Global index of local row 0 of dim ``j`` on the device at mesh position ``p`` (the ceil rule, unclipped)."""
    mesh = spec.mesh
    coords = mesh.coords(mesh.devices[p])
    return dim_position(spec.dim_refs[j], mesh, coords) * chunk(shape[j], spec.num_shards(j))


# one collective_permute a round on the wire (a move's ``rounds``, its bytes counted when planned); the transpose
# of an exchange is the exchange back
C.register(C.Collective("exchange", lambda B, k: B, lambda k: 1, "exchange", _exchange, lower=_lower_exchange,
                        logs_as="collective_permute"))
