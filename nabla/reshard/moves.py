"""What a reshard plan is made of (``State``, ``Move``, ``Segment``; the ``Plan`` itself is ``search``'s) and how
it is carried out (``Move.simulate`` on the grid layout, through the collective registry; backends run whole
plans: ``Backend.move``); the moves legal from a state (``LegalMoves``) and the generators that propose them
(``register_generator`` adds one)."""

from __future__ import annotations

from itertools import combinations
from math import prod
from typing import Any, Iterator, NamedTuple

import numpy as np

from .. import collectives as C
from ..layout import chunk, is_nested
from ..mesh import AxisRef, merge_adjacent
from ..spec import DimSpec, ShardingSpec
from .bounds import grid_coords
from .exchange import Exchange, planned_exchange


class State(NamedTuple):
    dims: tuple[tuple[int, ...], ...]  # per dim, atom indices major to minor
    partial: frozenset[int]


class Move(NamedTuple):
    """One move: ``kind`` is a registered collective (or the local ``"slice"``); ``after`` the new state."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    group: int
    after: State
    src: int | None = None  # dim the atoms leave (gather, all_to_all)
    dst: int | None = None  # dim the atoms join (slice, reduce_scatter, all_to_all)
    atoms: tuple[int, ...] = ()
    moves: tuple = ()  # exchange: per dim (dim, atoms leaving, atoms arriving, their sizes, new chunk, gathered chunk)
    sizes: tuple[int, ...] = ()  # the atoms' sizes
    src_chunk: int = 0  # block length of `src` after the move
    dst_chunk: int = 0  # block length of `dst` after the move
    rounds: tuple = ()  # exchange: per collective_permute round, (bytes per device, mesh axes crossed, senders)
    exchange: Exchange | None = None  # exchange: the whole move as planned (its specs, rounds and pieces)
    fused: bool = False  # a local cut an exchange already made on real devices (the simulation does it here)
    held: tuple[int, ...] = ()  # slice: sizes of the major pieces of the block each cut alike (a strided cut)
    pre: tuple = ()  # steps that run first, searched as one move with this one (a cut before a reduction)

    def simulate(self, data: Any, G: int, reduce_op: str = "sum") -> Any:
        """This move on every device's blocks at once (grid axes first; ``G`` of them), by its registry entry
        (how a grid backend carries out a plan: ``GridBackend.move``)."""
        return C.REGISTRY[self.kind].move(data, G, self, reduce_op)

    def events(self) -> tuple[C.CommEvent, ...]:
        if self.kind == "slice":
            return ()
        if self.rounds:
            return tuple(C.sent_event(self.kind, axes, b, k) for b, axes, k in self.rounds)
        return (C.sent_event(self.kind, self.axes, self.bytes, self.group),)


class Segment(NamedTuple):
    """Steps on one refinement of the mesh; the grid shapes to enter it and to leave it in."""

    cuts: tuple[frozenset[int], ...]
    atoms: tuple[AxisRef, ...]
    start: State
    steps: tuple[Move, ...]
    enter: tuple[int, int]  # (grid axes of the incoming storage, grid axes of the refined start)
    start_grid: tuple[int, ...]
    end_grid: tuple[int, ...]


def atom_names(atoms, run) -> tuple[str, ...]:
    """The mesh axes the atoms ``run`` are (adjacent sub-axes merged), ordered by name and position."""
    ordered = sorted(run, key=lambda a: (atoms[a].name, atoms[a].pre))
    return tuple(str(r) for r in merge_adjacent([atoms[a] for a in ordered]))


def spec_of(state: State, atoms, mesh) -> ShardingSpec:
    """The spec an atom state stands for: per dim its atoms major to minor, and its partial atoms."""
    dims = [DimSpec(tuple(str(r) for r in merge_adjacent([atoms[a] for a in run]))) for run in state.dims]
    return ShardingSpec(mesh, dims, partial_axes=[str(atoms[a]) for a in sorted(state.partial)])


def exchange_move(ex: Exchange, after: State, moves: tuple) -> Move:
    """The move of an exchange (the registry's ``"exchange"``, collective_permutes on the wire): its rounds
    lead to state ``after``; it carries the exchange as planned, so no reader works the rounds out again."""
    rounds = ex.rounds
    axes = tuple(dict.fromkeys(a for _, crossed, _ in rounds for a in crossed))
    return Move("exchange", axes, sum(b for b, _, _ in rounds), max((k for _, _, k in rounds), default=1),
                after, moves=moves, rounds=rounds, exchange=ex)


# ---- the moves legal from a state -----------------------------------------------------------------------


class LegalMoves:
    """The moves legal from a state: each keeps the ceil-rule layout exact (uneven dims move an atom only
    where blocks nest) and is scored by its ring bytes."""

    def __init__(self, target: State, atoms, shape, itemsize: int, mesh) -> None:
        self.t, self.atoms, self.shape, self.itemsize, self.mesh = target, atoms, shape, itemsize, mesh
        self.sizes = [a.size for a in atoms]
        self._exchange: dict[State, Move | None] = {}
        self._specs: dict[State, ShardingSpec] = {}
        self._lack: dict[State, int] = {}
        self._boxes: dict[tuple[int, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}
        # each device's coordinate on each atom, devices in mesh order
        axis = grid_coords(mesh.shape)[:, [mesh.axis_index(a.name) for a in atoms]]
        self.coords = (axis // np.array([a.minor for a in atoms], dtype=np.int64)) % np.array(
            [a.size for a in atoms], dtype=np.int64) if atoms else axis
        self._need: int | None = None
        self._k: dict = {}
        self._overlap: dict = {}
        self._need_each = None
        self._names: dict = {}

    def spec(self, s: State) -> ShardingSpec:
        spec = self._specs.get(s)
        if spec is None:
            spec = self._specs[s] = spec_of(s, self.atoms, self.mesh)
        return spec

    def box(self, d: int, run: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Per device (mesh order), [start, stop) along dim d of its block when d is cut by ``run``."""
        key = (d, run)
        got = self._boxes.get(key)
        if got is None:
            pos = np.zeros(len(self.coords), dtype=np.int64)
            for a in run:
                pos = pos * self.sizes[a] + self.coords[:, a]
            n = self.shape[d]
            c = chunk(n, self.k(run))
            lo = np.minimum(n, pos * c)
            got = self._boxes[key] = (lo, np.minimum(n, lo + c))
        return got

    def k(self, run) -> int:
        try:
            return self._k[run]
        except KeyError:
            got = self._k[run] = prod(self.sizes[a] for a in run)
            return got
        except TypeError:  # a list
            return prod(self.sizes[a] for a in run)

    def block(self, s: State) -> int:
        return prod(chunk(n, self.k(run)) for n, run in zip(self.shape, s.dims)) * self.itemsize

    def nests(self, d: int, k: int, extra: int) -> bool:
        """Cutting each of ``k`` shards of dim d into ``extra`` (or merging them back) keeps the ceil rule."""
        return k == 1 or extra == 1 or is_nested(self.shape[d], k, extra)

    def after(self, s: State, dims: dict[int, tuple[int, ...]], partial=None) -> State:
        new = list(s.dims)
        for d, run in dims.items():
            new[d] = tuple(run)
        return State(tuple(new), s.partial if partial is None else frozenset(partial))

    def step(self, kind: str, run, B: int, after: State, **kw) -> Move:
        k = self.k(run)
        dst = kw.get("dst")
        if dst is not None and kind != "slice" and B:
            # a collective that scatters a dim sends equal pieces: the dim is padded to k ceil-rule chunks
            n = self.shape[dst]
            B = B // chunk(n, self.k(after.dims[dst]) // k) * k * chunk(n, self.k(after.dims[dst]))
        run = tuple(run)
        names = self._names.get(run)
        if names is None:
            names = self._names[run] = (atom_names(self.atoms, run), tuple(self.sizes[a] for a in run))
        return Move(kind, names[0], C.REGISTRY[kind].ring_bytes(B, k), k, after, atoms=run, sizes=names[1],
                    src_chunk=self._chunk(kw.get("src"), after), dst_chunk=self._chunk(dst, after), **kw)

    def _chunk(self, d, after: State) -> int:
        return 0 if d is None else chunk(self.shape[d], self.k(after.dims[d]))

    def moves(self, s: State) -> Iterator[Move]:
        for generate in GENERATORS:
            yield from generate(self, s)

    def lack(self, s: State) -> int:
        """The most bytes any device lacks of its target block in state ``s`` (as ``lacking``)."""
        got = self._lack.get(s)
        if got is None:
            if self._need_each is None:
                self._need_each = np.ones(len(self.coords), dtype=np.int64)
                for d, tgt in enumerate(self.t.dims):
                    tlo, thi = self.box(d, tgt)
                    self._need_each = self._need_each * (thi - tlo)
            held = self._need_each
            for d, run in enumerate(s.dims):
                held = held * self._held(d, run) if d else self._held(d, run)
            got = self._lack[s] = int((self._need_each - held).max(initial=0)) * self.itemsize
        return got

    def _held(self, d: int, run: tuple[int, ...]) -> np.ndarray:
        """Per device, the length along dim d of what its block (d cut by ``run``) shares with its target."""
        key = (d, run)
        got = self._overlap.get(key)
        if got is None:
            lo, hi = self.box(d, run)
            tlo, thi = self.box(d, self.t.dims[d])
            got = self._overlap[key] = np.maximum(np.minimum(hi, thi) - np.maximum(lo, tlo), 0)
        return got

    def bound(self, s: State) -> int:
        """A cheap part of ``lower_bound`` from state ``s`` to the target (the search's guide): what a device
        lacks, and with sums pending, its whole target block (it holds at most one summand)."""
        if s.partial == self.t.partial or self.k(s.partial - self.t.partial) == 1:
            return self.lack(s)
        if self._need is None:
            need = np.ones(len(self.coords), dtype=np.int64)
            for d, run in enumerate(self.t.dims):
                lo, hi = self.box(d, run)
                need *= hi - lo
            self._need = int(need.max(initial=0)) * self.itemsize
        return max(self._need, self.lack(s))

    def rounds(self, s: State) -> int:
        """The most source blocks any device needs a piece of and does not hold: an exchange has at least
        that many rounds (each device receives one piece a round)."""
        count = np.ones(len(self.coords), dtype=np.int64)
        held = np.ones(len(self.coords), dtype=np.int64)
        for d, (run, tgt) in enumerate(zip(s.dims, self.t.dims)):
            lo, hi = self.box(d, run)
            a, b = self.box(d, tgt)
            c = chunk(self.shape[d], self.k(run)) or 1
            count *= np.where(b > a, -(-b // c) - a // c, 0)
            held *= np.maximum(np.minimum(hi, b) - np.maximum(lo, a), 0)
        return int((count - (held > 0)).max(initial=0))

    def exchange(self, s: State) -> Move | None:
        """Every device receives the pieces of its target block that it lacks, from a device holding them."""
        if s in self._exchange:
            return self._exchange[s]
        t, shape = self.t, self.shape
        moves = []
        for d, (run, tgt) in enumerate(zip(s.dims, t.dims)):
            lcp = 0
            while lcp < min(len(run), len(tgt)) and run[lcp] == tgt[lcp]:
                lcp += 1
            kp = self.k(run[:lcp])
            if not (self.nests(d, kp, self.k(run[lcp:])) and self.nests(d, kp, self.k(tgt[lcp:]))):
                lcp, kp = 0, 1
            old, new = run[lcp:], tgt[lcp:]
            if old or new:
                moves.append((d, old, new, tuple(self.sizes[a] for a in new), chunk(shape[d], self.k(tgt)),
                              chunk(shape[d], kp)))
        step = None
        if moves:
            src, dst = self.spec(s), self.spec(t)
            ex = planned_exchange(shape, self.itemsize, src, dst)
            leaving = {a for m in moves for a in m[1]}
            arriving = [a for m in moves for a in m[2]]
            # an exchange needs the arriving atoms free or leaving: nothing else may sit on them
            used = set(s.partial).union(*s.dims) if s.dims else set(s.partial)
            if all(a in leaving or a not in used for a in arriving):
                step = exchange_move(ex, t, tuple(moves))
        self._exchange[s] = step
        return step


# ---- move generators: each proposes the moves of its collectives that are legal from a state ------------


def _used(s: State) -> set[int]:
    return set(s.partial).union(*s.dims) if s.dims else set(s.partial)


def local_slices(m: LegalMoves, s: State) -> Iterator[Move]:
    """Free atoms that come next in a target dim: each device keeps a part of its block."""
    used, B = _used(s), m.block(s)
    for d, run in enumerate(s.dims):
        tgt = m.t.dims[d]
        if tgt[:len(run)] != run:
            continue
        nxt: list[int] = []
        for a in tgt[len(run):]:
            if a in used:
                break
            nxt.append(a)
            if m.nests(d, m.k(run), m.k(nxt)):
                yield m.step("slice", nxt, B, m.after(s, {d: run + tuple(nxt)}), dst=d)


def gathers(m: LegalMoves, s: State) -> Iterator[Move]:
    """A minor run of a dim's atoms leaves it: gathered (all_gather), or moved to another dim (all_to_all)."""
    B = m.block(s)
    for d, run in enumerate(s.dims):
        for i in range(len(run)):
            gone, keep = run[i:], m.k(run[:i])
            if not m.nests(d, keep, m.k(gone)):
                continue
            yield m.step("all_gather", gone, B, m.after(s, {d: run[:i]}), src=d)
            for e, other in enumerate(s.dims):
                if e != d and m.nests(e, m.k(other), m.k(gone)):
                    yield m.step("all_to_all", gone, B, m.after(s, {d: run[:i], e: other + gone}), src=d, dst=e)


def reductions(m: LegalMoves, s: State) -> Iterator[Move]:
    """Partial sums the target does not keep: reduce_scatter onto a dim (the next target atoms, or any one
    atom), or all_reduce (all of them at once, or one axis at a time)."""
    extra = [a for a in sorted(s.partial) if a not in m.t.partial]
    if not extra:
        return
    B = m.block(s)
    for d, run in enumerate(s.dims):
        tgt = m.t.dims[d]
        options: list[tuple[int, ...]] = []
        if tgt[:len(run)] == run:
            nxt: list[int] = []
            for a in tgt[len(run):]:
                if a not in extra:
                    break
                nxt.append(a)
                options.append(tuple(nxt))
        options += [(a,) for a in extra if (a,) not in options]
        if len(extra) > 1 and tuple(extra) not in options:
            options.append(tuple(extra))
        for add in options:
            if m.nests(d, m.k(run), m.k(add)):
                yield m.step("reduce_scatter", add, B, m.after(s, {d: run + add}, s.partial - set(add)), dst=d)
    yield m.step("all_reduce", tuple(extra), B, State(s.dims, s.partial - set(extra)))
    if len(extra) > 1:
        for a in extra:
            yield m.step("all_reduce", (a,), B, State(s.dims, s.partial - {a}))


def cuts_before_reductions(m: LegalMoves, s: State) -> Iterator[Move]:
    """While sums are pending, shrink the data first: a reduction costs in proportion to the block.

    - Any free atom may cut a dim locally (minor end), to be gathered back after the sum: replicas of a
      summand then share the reduction (partial {x, y} to replicated on 2x2x2: cut z, all_reduce a quarter
      of the bytes over (x, y), all_gather z).
    - Where a target dim runs partial atoms P then free atoms F, each device keeps its F part of each of
      the P pieces (a strided cut) and one reduce_scatter over P sends (k-1)/k of that smaller block
      (partial {x} to [(x, z)]: 8 B, not the 16 B of reduce_scatter x before cutting z)."""
    extra = [a for a in sorted(s.partial) if a not in m.t.partial]
    if not extra:
        return
    used, B = _used(s), m.block(s)
    wanted = set().union(*m.t.dims) if m.t.dims else set()
    for d, run in enumerate(s.dims):
        kr = m.k(run)
        # (1) a free atom the target does not place on this dim's next position: cut now, gather later
        tgt = m.t.dims[d]
        nxt = tgt[len(run)] if tgt[:len(run)] == run and len(tgt) > len(run) else None
        for a in range(len(m.atoms)):
            if a in used or a == nxt or m.sizes[a] == 1:
                continue
            if a in wanted and a not in tgt:
                continue  # the target wants it on another dim: cutting here would have to move it again
            if m.nests(d, kr, m.sizes[a]):
                yield m.step("slice", (a,), B, m.after(s, {d: run + (a,)}), dst=d)
        # (2) target P then F after the current run: a strided cut of F, then reduce_scatter P
        if tgt[:len(run)] != run:
            continue
        rest = tgt[len(run):]
        i = 0
        while i < len(rest) and rest[i] in extra:
            i += 1
        held = rest[:i]
        if not held:
            continue
        c = chunk(m.shape[d], kr)
        nexts: list[tuple[int, ...]] = [()]
        for a in rest[i:]:
            if a in used:
                break
            nexts.append(nexts[-1] + (a,))
        spare = [a for a in range(len(m.atoms)) if a not in used and a not in wanted and m.sizes[a] > 1]
        extras = [()] + [(a,) for a in spare] + list(combinations(spare, 2))
        for nxt_free in nexts:
            for more in extras:
                free = nxt_free + more
                if not free or c % (m.k(held) * m.k(free)):
                    continue  # only where every piece is whole
                after = m.after(s, {d: run + held + free}, s.partial - set(held))
                cut = m.step("slice", free, B, after, dst=d, held=tuple(m.sizes[a] for a in held))
                yield m.step("reduce_scatter", held, B // m.k(free), after, dst=d, pre=(cut,))


GENERATORS: list = [local_slices, gathers, reductions, cuts_before_reductions]


def register_generator(generate) -> None:
    """Let the planner consider ``generate(moves, state) -> steps`` (the steps of a newly registered
    collective); every later plan sees it (plan caches are keyed on the registry's epoch)."""
    GENERATORS.append(generate)
    C.bump()


def unregister_generator(generate) -> None:
    GENERATORS.remove(generate)
    C.bump()
