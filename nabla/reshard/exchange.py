"""General exchanges: who sends which piece to whom when every device receives exactly the pieces of its target
block that it lacks, as collective_permute rounds (a proper edge colouring of senders and receivers)."""

from __future__ import annotations

import bisect
import itertools
from functools import lru_cache
from math import prod
from typing import NamedTuple

import numpy as np

from ..errors import ShardingError
from ..layout import grid
from ..spec import ShardingSpec
from .bounds import boxes, grid_coords


@lru_cache(maxsize=16384)
def exchange_rounds(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> tuple:
    """The collective_permute rounds of a general exchange from ``src`` to ``dst`` (equal partial axes): per
    round, (bytes per device, mesh axes data crosses, devices that send). Every device sends the same slab
    shape in a round (the largest piece's extent per dim), so that is what a round costs."""
    return tuple((prod(r.slab) * itemsize, r.crossed, len(r.pieces)) for r in exchange_detail(shape, src, dst)
                 if prod(r.slab))


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
    mesh = src.mesh
    sb, tb = boxes(src, shape), boxes(dst, shape)
    gs = grid(src)
    devs = mesh.devices
    pos = {}  # (source block start per dim, partial coordinates) -> holders in mesh order
    pcoords = []
    for i, d in enumerate(devs):
        coords = mesh.coords(d)
        pc = tuple(gs.atoms[a].coord(coords[mesh.axis_index(gs.atoms[a].name)]) for a in gs.partial)
        pcoords.append(pc)
        pos.setdefault((tuple(sb[i, :, 0]), tuple(sb[i, :, 1]), pc), []).append(i)
    replica = {}
    for holders in pos.values():
        for r, i in enumerate(holders):
            replica[i] = r
    starts = [sorted({(int(sb[i, j, 0]), int(sb[i, j, 1])) for i in range(len(devs))}) for j in range(len(shape))]
    ends = [[s1 for _, s1 in st] for st in starts]  # source blocks along a dim do not overlap: sorted by end too
    edges, regions = [], []
    load: dict[int, int] = {}  # elements each holder sends so far: pick the least loaded replica
    for i in range(len(devs)):
        per_dim = []
        for j in range(len(shape)):
            a, b = int(tb[i, j, 0]), int(tb[i, j, 1])
            got, st = [], starts[j]
            for k in range(bisect.bisect_right(ends[j], a), len(st)):  # the first block ending past a, onwards
                s0, s1 = st[k]
                if s0 >= b:
                    break
                if min(b, s1) > max(a, s0):
                    got.append((s0, s1, max(a, s0), min(b, s1)))
            per_dim.append(got)
        if any(not p for p in per_dim):
            continue
        pc = pcoords[i]
        for pieces in itertools.product(*per_dim):
            key = (tuple([p[0] for p in pieces]), tuple([p[1] for p in pieces]), pc)
            holders = pos.get(key)
            if holders is None:
                raise ShardingError(f"internal: no device holds block {key} of {src!r}")
            if i in holders:
                continue
            size = prod(p[3] - p[2] for p in pieces)
            if len(holders) == 1:
                sender = holders[0]
            else:
                preferred = holders[replica.get(i, 0) % len(holders)]
                sender = min(holders, key=lambda h: (load.get(h, 0), h != preferred))
            load[sender] = load.get(sender, 0) + size
            edges.append((sender, i, int(size)))
            regions.append(tuple((p[2], p[3]) for p in pieces))
    colours = _edge_colouring(edges)
    by_colour: dict[int, list] = {}
    for edge, box, c in zip(edges, regions, colours):
        by_colour.setdefault(c, []).append((edge[0], edge[1], box))
    rounds = []
    coords = grid_coords(mesh.shape)  # edges name devices by mesh position
    for c in sorted(by_colour):
        es = tuple(by_colour[c])
        ends = np.array([[b - a for a, b in box] for _, _, box in es], dtype=np.int64).reshape(len(es), len(shape))
        slab = tuple(int(x) for x in ends.max(axis=0)) if len(es) else (0,) * len(shape)
        u = np.fromiter((e[0] for e in es), dtype=np.int64, count=len(es))
        v = np.fromiter((e[1] for e in es), dtype=np.int64, count=len(es))
        moved = (coords[u] != coords[v]).any(axis=0)
        crossed = tuple(n for n, m in zip(mesh.axis_names, moved) if m)
        rounds.append(Round(es, slab, crossed))
    return tuple(rounds)


def _edge_colouring(edges: list[tuple[int, int, int]]) -> list[int]:
    """A proper colouring of a bipartite multigraph (senders, receivers) with max-degree colours (Koenig). The
    regular exchanges of a mesh (a gather, a transpose) colour by shift: edges that move data the same number of
    mesh positions form one round when each sends and receives once (O(edges)); otherwise Koenig's method."""
    by_shift = _shift_colouring(edges)
    return by_shift if by_shift is not None else _koenig(edges)


def _shift_colouring(edges: list[tuple[int, int, int]]) -> list[int] | None:
    """Colour each edge (u, v) by ``v - u``, when that is proper and uses as many colours as the largest degree
    (the fewest any colouring can); None otherwise."""
    if not edges:
        return []
    n = max(max(u, v) for u, v, _ in edges) + 1
    classes: dict[int, int] = {}
    sends: set = set()
    gets: set = set()
    deg_u: dict[int, int] = {}
    deg_v: dict[int, int] = {}
    colour = []
    for u, v, _ in edges:
        shift = (v - u) % n
        c = classes.setdefault(shift, len(classes))
        if (u, c) in sends or (v, c) in gets:
            return None
        sends.add((u, c))
        gets.add((v, c))
        deg_u[u] = deg_u.get(u, 0) + 1
        deg_v[v] = deg_v.get(v, 0) + 1
        colour.append(c)
    if len(classes) != max(max(deg_u.values()), max(deg_v.values())):
        return None
    return colour


def _koenig(edges: list[tuple[int, int, int]]) -> list[int]:
    """Koenig's edge colouring: where the first colour free at the sender is taken at the receiver, swap an
    alternating path."""
    at_u: dict[int, dict[int, int]] = {}
    at_v: dict[int, dict[int, int]] = {}
    colour = [-1] * len(edges)

    def free(table: dict[int, int]) -> int:
        c = 0
        while c in table:
            c += 1
        return c

    order = sorted(range(len(edges)), key=lambda e: -edges[e][2])  # big pieces first: they share rounds
    for e in order:
        u, v, _ = edges[e]
        cu, cv = at_u.setdefault(u, {}), at_v.setdefault(v, {})
        a, b = free(cu), free(cv)
        if a in cv:
            # walk v -a- u1 -b- v2 -a- ... and swap a and b along the path; then a is free at v
            path, node, side, want = [], v, "v", a
            while True:
                table = at_v[node] if side == "v" else at_u[node]
                if want not in table:
                    break
                f = table[want]
                path.append(f)
                fu, fv, _ = edges[f]
                node, side = (fu, "u") if side == "v" else (fv, "v")
                want = b if want == a else a
            for f in path:
                fu, fv, _ = edges[f]
                del at_u[fu][colour[f]]
                del at_v[fv][colour[f]]
            for f in path:
                fu, fv, _ = edges[f]
                colour[f] = b if colour[f] == a else a
                at_u[fu][colour[f]] = f
                at_v[fv][colour[f]] = f
        colour[e] = a
        cu[a] = e
        cv[a] = e
    return colour
