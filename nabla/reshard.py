"""Plan, then move: a pure, cached planner from (shape, dtype, source spec, target spec) to the cheapest
sequence of collectives under the cost model, and ``execute``, which carries a plan out through the
collective registry. The planner searches over move generators (local slices, all_gather, all_to_all,
reduce_scatter, all_reduce) on the mesh atoms, plus a general exchange in which every device receives
exactly the pieces it lacks (collective_permute rounds); ``lower_bound`` is what no plan can beat."""

from __future__ import annotations

import bisect
import heapq
import itertools
from functools import lru_cache
from itertools import combinations, count
from math import prod
from typing import Iterator, NamedTuple

import numpy as np

from . import collectives as C
from .cost import CostModel, current as current_cost_model
from .errors import ShardingError
from .layout import chunk, grid, is_nested, merge_cuts, spec_cuts
from .mesh import AxisRef, merge_adjacent
from .spec import DimSpec, ShardingSpec


class State(NamedTuple):
    dims: tuple[tuple[int, ...], ...]  # per dim, atom indices major to minor
    partial: frozenset[int]


class Step(NamedTuple):
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
    exchange: tuple = ()  # exchange: (source spec, target spec) of the whole move
    fused: bool = False  # a local cut an exchange already made on real devices (the simulation does it here)
    held: tuple[int, ...] = ()  # slice: sizes of the major pieces of the block each cut alike (a strided cut)
    pre: tuple = ()  # steps that run first, searched as one move with this one (a cut before a reduction)

    def events(self) -> tuple[C.CommEvent, ...]:
        if self.kind == "slice":
            return ()
        if self.rounds:
            return tuple(C.CommEvent("collective_permute", axes, b, k) for b, axes, k in self.rounds)
        return (C.CommEvent(self.kind, self.axes, self.bytes, self.group),)


class Segment(NamedTuple):
    """Steps on one refinement of the mesh; the grid shapes to enter it and to leave it in."""

    cuts: tuple[frozenset[int], ...]
    atoms: tuple[AxisRef, ...]
    start: State
    steps: tuple[Step, ...]
    enter: tuple[int, int]  # (grid axes of the incoming storage, grid axes of the refined start)
    start_grid: tuple[int, ...]
    end_grid: tuple[int, ...]


class Plan(NamedTuple):
    segments: tuple[Segment, ...]

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(s for seg in self.segments for s in seg.steps)

    @property
    def collectives(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.kind != "slice")

    @property
    def events(self) -> tuple[C.CommEvent, ...]:
        return tuple(e for s in self.steps for e in s.events())

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.events)


def plan(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> Plan:
    """The collectives that turn blocks laid out as ``src`` into ``dst``, cheapest first under ``nb.CostModel``."""
    return _plan(tuple(shape), itemsize, src.layout(), dst.layout(), current_cost_model(), C.epoch())


@lru_cache(maxsize=8192)
def _plan(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec, model: CostModel,
          epoch: int = 0) -> Plan:
    if src.mesh != dst.mesh:
        return _across_meshes(shape, itemsize, src, dst, model)
    src.check_rank(shape, "with_sharding", "source")
    dst.check_rank(shape, "with_sharding", "target")
    extra = [str(r) for r in dst.partial_refs if not any(  # partial over y -> over y:(1)2: sum over y:(2)2
        q.name == r.name and q.pre <= r.pre and r.pre % q.pre == 0 and r.pre * r.size <= q.pre * q.size
        for q in src.partial_refs)]
    if extra:
        raise ShardingError(
            f"with_sharding: target {dst!r} is partial over {sorted(extra)} but the value {src!r} is not; "
            f"a sum cannot be made partial without an op that produces it")
    cuts = merge_cuts(spec_cuts(src), spec_cuts(dst))
    if cuts is None:
        return _across_grids(shape, itemsize, src, dst, model)
    s0, atoms = _state(src, cuts)
    t, _ = _state(dst, cuts)
    steps = _search(s0, t, atoms, shape, itemsize, src.mesh, model)
    if not steps and grid(src).shape == grid(dst).shape:
        return Plan(())
    # (no steps but other grids: one placement spelled two ways, e.g. a size-1 axis between sub-axes)
    direct = Plan((Segment(cuts, atoms, s0, tuple(steps), (len(grid(src).shape), len(atoms)),
                           _grid_shape(atoms, s0), grid(dst).shape),))
    # The search proposes cuts the target has; a route through other cuts can be cheaper (reduce over y on
    # a third of the value cut over x, then gather over x: 13 B where one all_reduce costs 16 on a 3x3 mesh).
    # Making the whole value (summed as the target is) and cutting it locally is that route's end: take it
    # when it is cheaper, so no plan costs more than it.
    whole = ShardingSpec(src.mesh, [()] * len(shape), partial_axes=dst.partial_axes).layout()
    if whole in (src, dst) or not direct.collectives:
        return direct
    via = Plan(_plan(shape, itemsize, src, whole, model).segments + _plan(shape, itemsize, whole, dst, model).segments)
    return via if _price(via, model) < _price(direct, model) else direct


def _step_price(step: Step, model: CostModel) -> tuple[int, int, int]:
    """What the search ranks moves by: transfer time, latency, collectives (an exchange: one per round)."""
    if step.rounds:
        parts = [model.split(1, b, axes) for b, axes, _ in step.rounds]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), len(step.rounds)
    return model.split(C.REGISTRY[step.kind].ring_steps(step.group), step.bytes, step.axes) + (1,)


def _price(p: Plan, model: CostModel) -> tuple:
    """A whole plan, priced as the search prices its moves."""
    prices = [_step_price(step, model) for step in p.collectives]
    return tuple(sum(x[i] for x in prices) for i in range(3))


def _state(spec: ShardingSpec, cuts) -> tuple[State, tuple[AxisRef, ...]]:
    g = grid(spec, cuts)
    return State(g.dims, frozenset(g.partial)), g.atoms


def _grid_shape(atoms, state: State) -> tuple[int, ...]:
    used = set(state.partial).union(*state.dims) if state.dims else set(state.partial)
    return tuple(a.size if j in used else 1 for j, a in enumerate(atoms))


def _names(atoms, run) -> tuple[str, ...]:
    ordered = sorted(run, key=lambda a: (atoms[a].name, atoms[a].pre))
    return tuple(str(r) for r in merge_adjacent([atoms[a] for a in ordered]))


def _spec_of(state: State, atoms, mesh) -> ShardingSpec:
    dims = [DimSpec(tuple(str(r) for r in merge_adjacent([atoms[a] for a in run]))) for run in state.dims]
    return ShardingSpec(mesh, dims, partial_axes=[str(atoms[a]) for a in sorted(state.partial)])


# ---- the search ---------------------------------------------------------------------------------------


def _search(s0: State, t: State, atoms, shape, itemsize: int, mesh, model: CostModel) -> list[Step]:
    """Cheapest path from ``s0`` to ``t``: A* on (transfer time, latency, collectives), the transfer part guided by
    the bytes each device still lacks (no move delivers more than it sends). An exchange is priced at that
    bound first and worked out only when the bound could still win."""
    if s0 == t:
        return []
    ctx = _Moves(t, atoms, shape, itemsize, mesh)
    fastest = max(model.link([str(a)]).bandwidth for a in atoms) if atoms else 1.0
    quickest = min(model.split(1, 0, [str(a)])[1] for a in atoms) if atoms else 0
    dst = _spec_of(t, atoms, mesh)

    def h(s: State) -> int:
        return round(ctx.bound(s) / fastest * 1e15)  # rounded as CostModel.split rounds: equal bytes tie

    costs: dict = {}

    def cost_of(step: Step) -> tuple[int, int, int]:
        if step.rounds:
            return _step_price(step, model)
        key = (step.kind, step.group, step.bytes, step.axes)
        got = costs.get(key)
        if got is None:
            got = costs[key] = _step_price(step, model)
        return got

    tie = count()
    best = {s0: (0, 0, 0)}
    back: dict[State, tuple[State, Step]] = {}
    heap = [((h(s0), 0, 0), next(tie), False, s0, (0, 0, 0))]
    priced: set[State] = set()
    while heap:
        est, _, pending, s, g = heapq.heappop(heap)
        if pending:  # an exchange from s: now work it out, and queue the target at its real price
            if t in best and best[t] <= est:
                continue  # it cannot beat the plan already found
            step = ctx.exchange(s)
            if step is not None:
                tr, lat, n = cost_of(step)
                nc = (g[0] + tr, g[1] + lat, g[2] + n)
                if t not in best or nc < best[t]:
                    best[t] = nc
                    back[t] = (s, step)
                    heapq.heappush(heap, (nc, next(tie), False, t, nc))
            continue
        if s == t:
            break
        if g > best[s]:
            continue
        for step in ctx.moves(s):
            tr, lat, n = cost_of(step)
            nc = (g[0] + tr, g[1] + lat, g[2] + n)
            if step.after not in best or nc < best[step.after]:
                best[step.after] = nc
                back[step.after] = (s, step)
                heapq.heappush(heap, ((nc[0] + h(step.after), nc[1], nc[2]), next(tie), False, step.after, nc))
        if s.partial == t.partial and s not in priced:
            priced.add(s)
            rounds = ctx.rounds(s)  # at least one round per piece the neediest device lacks
            if rounds:
                heapq.heappush(heap, ((g[0] + h(s), g[1] + rounds * quickest, g[2] + rounds), next(tie), True, s, g))
    if t not in back:
        raise ShardingError(f"internal: no reshard plan from {_spec_of(s0, atoms, mesh)!r} to {dst!r}")
    out: list[Step] = []
    s = t
    while s != s0:
        s, step = back[s]
        out.append(step._replace(pre=()))
        out.extend(step.pre[::-1])
    return out[::-1]


@lru_cache(maxsize=8)  # a million-device mesh's is 24 MB
def _grid_coords(shape: tuple[int, ...]) -> np.ndarray:
    """Each device's coordinates, devices in mesh order (row-major over ``shape``), one row each."""
    n = prod(shape)
    if not shape:
        return np.zeros((n, 0), dtype=np.int64)
    out = np.stack(np.unravel_index(np.arange(n, dtype=np.int64), shape), axis=-1).astype(np.int64)
    out.setflags(write=False)
    return out


class _Moves:
    """The moves legal from a state: each keeps the ceil-rule layout exact (uneven dims move an atom only
    where blocks nest) and is scored by its ring bytes."""

    def __init__(self, target: State, atoms, shape, itemsize: int, mesh) -> None:
        self.t, self.atoms, self.shape, self.itemsize, self.mesh = target, atoms, shape, itemsize, mesh
        self.sizes = [a.size for a in atoms]
        self._exchange: dict[State, Step | None] = {}
        self._specs: dict[State, ShardingSpec] = {}
        self._lack: dict[State, int] = {}
        self._boxes: dict[tuple[int, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}
        # each device's coordinate on each atom, devices in mesh order
        axis = _grid_coords(mesh.shape)[:, [mesh.axis_index(a.name) for a in atoms]]
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
            spec = self._specs[s] = _spec_of(s, self.atoms, self.mesh)
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

    def step(self, kind: str, run, B: int, after: State, **kw) -> Step:
        k = self.k(run)
        dst = kw.get("dst")
        if dst is not None and kind != "slice" and B:
            # a collective that scatters a dim sends equal pieces: the dim is padded to k ceil-rule chunks
            n = self.shape[dst]
            B = B // chunk(n, self.k(after.dims[dst]) // k) * k * chunk(n, self.k(after.dims[dst]))
        run = tuple(run)
        names = self._names.get(run)
        if names is None:
            names = self._names[run] = (_names(self.atoms, run), tuple(self.sizes[a] for a in run))
        return Step(kind, names[0], C.REGISTRY[kind].ring_bytes(B, k), k, after, atoms=run, sizes=names[1],
                    src_chunk=self._chunk(kw.get("src"), after), dst_chunk=self._chunk(dst, after), **kw)

    def _chunk(self, d, after: State) -> int:
        return 0 if d is None else chunk(self.shape[d], self.k(after.dims[d]))

    def moves(self, s: State) -> Iterator[Step]:
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

    def exchange(self, s: State) -> Step | None:
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
            rounds = exchange_rounds(shape, self.itemsize, src, dst)
            leaving = {a for m in moves for a in m[1]}
            arriving = [a for m in moves for a in m[2]]
            # an exchange needs the arriving atoms free or leaving: nothing else may sit on them
            used = set(s.partial).union(*s.dims) if s.dims else set(s.partial)
            if all(a in leaving or a not in used for a in arriving):
                step = _exchange_step(rounds, t, tuple(moves), (src, dst))
        self._exchange[s] = step
        return step


# ---- move generators: each proposes the steps of its collectives that are legal from a state ----------


def _used(s: State) -> set[int]:
    return set(s.partial).union(*s.dims) if s.dims else set(s.partial)


def local_slices(m: _Moves, s: State) -> Iterator[Step]:
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


def gathers(m: _Moves, s: State) -> Iterator[Step]:
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


def reductions(m: _Moves, s: State) -> Iterator[Step]:
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


def cuts_before_reductions(m: _Moves, s: State) -> Iterator[Step]:
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


# ---- exchanges: per device, the pieces it lacks ----------------------------------------------------------


@lru_cache(maxsize=4096)
def _boxes(spec: ShardingSpec, shape: tuple[int, ...]) -> np.ndarray:
    """(devices in mesh order, rank, 2): each device's block as [start, stop) per dim (the ceil rule)."""
    mesh = spec.mesh
    coords = np.array([mesh.coords(d) for d in mesh.devices], dtype=np.int64).reshape(mesh.size, mesh.ndim)
    out = np.zeros((mesh.size, len(shape), 2), dtype=np.int64)
    for j, (refs, n) in enumerate(zip(spec.dim_refs, shape)):
        pos = np.zeros(mesh.size, dtype=np.int64)
        for r in refs:
            pos = pos * r.size + (coords[:, mesh.axis_index(r.name)] // r.minor) % r.size
        c = chunk(n, spec.num_shards(j))
        out[:, j, 0] = np.minimum(n, pos * c)
        out[:, j, 1] = np.minimum(n, out[:, j, 0] + c)
    return out


def lacking(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> np.ndarray:
    """Per device (mesh order), the bytes of its ``dst`` block that its ``src`` block does not hold."""
    s, t = _boxes(src.layout(), tuple(shape)), _boxes(dst.layout(), tuple(shape))
    need = np.prod(t[..., 1] - t[..., 0], axis=1)
    lo, hi = np.maximum(s[..., 0], t[..., 0]), np.minimum(s[..., 1], t[..., 1])
    held = np.prod(np.maximum(hi - lo, 0), axis=1)
    return (need - held) * itemsize


def lower_bound(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> int:
    """Bytes per device that no plan can beat (a plan's bytes are, step by step, what each device sends, and
    in every collective a device receives what it sends).

    Without pending sums: the most any device lacks of its target block. Summing the partial values over the
    ``k`` coordinates of the partial axes the target drops: the larger of (a) the most any device must
    receive, one value per element of its target block (it holds at most one of the ``k`` summands), and
    (b) the messages every element needs, shared evenly over the devices. For (b), per element and kept
    partial coordinate, with ``D`` devices needing the sum: take the first device ``f`` to hold the whole
    sum. Before it does, every summand ``f`` lacks has been sent by a device holding it (a device holds one
    summand, so these are distinct sends): ``k - 1`` if ``f`` holds a summand, else ``k``. After it, each of
    the other devices needing the sum receives at least once: ``D - 1`` if ``f`` needs it, else ``D``. So
    ``k + D - 1 - both`` messages, ``both`` when one device holds a summand and needs the sum. For an
    all_reduce (``D = k``, every device both) that is ``2(k - 1)`` messages per element, ``2(k - 1)/k`` of
    the block per device: the bound ring all-reduce meets, proved optimal by Patarasuk and Yuan, "Bandwidth
    optimal all-reduce algorithms for clusters of workstations", J. Parallel Distrib. Comput. 69(2), 2009
    (and the one-way gossip bound of ``2n - 2`` calls); for a reduce_scatter (``D = 1``) ``(k - 1)/k``.
    Like the ring formulas, (b) counts pieces of values and rounds bytes down; the sums are those of the
    kept partial coordinates (what the planner's reductions produce)."""
    src, dst = src.layout(), dst.layout()
    lack = int(lacking(shape, itemsize, src, dst).max(initial=0))
    kept = set(dst.partial_refs)
    reduced = [r for r in src.partial_refs if r not in kept]
    if not reduced:
        return lack
    # sub-axes: the target may keep part of a source partial axis; count summands on the finest atoms
    k = prod(r.size for r in src.partial_refs) // prod(r.size for r in dst.partial_refs)
    if k == 1:
        return lack
    mesh = src.mesh
    kept_coord = np.array([_radix(mesh, dst.partial_refs, d) for d in mesh.devices], dtype=np.int64)
    return max(lack, _sum_bound(tuple(shape), itemsize, _boxes(src, tuple(shape)), _boxes(dst, tuple(shape)),
                                kept_coord, k))


def _sum_bound(shape, itemsize: int, sb: np.ndarray, tb: np.ndarray, kept_coord: np.ndarray, k: int) -> int:
    """``lower_bound`` with pending sums, from each device's source and target box (devices, rank, 2), its
    coordinate on the kept partial axes, and the number ``k`` of summands each kept sum adds."""
    need = np.prod(tb[..., 1] - tb[..., 0], axis=1)
    # elements in cells between every block boundary: within a cell all devices agree on holding/needing it
    edges = [np.unique(np.concatenate([[0, n], sb[:, j].ravel(), tb[:, j].ravel()])) for j, n in enumerate(shape)]
    lo = [e[:-1] for e in edges]
    width = [np.diff(e) for e in edges]
    cell = np.ones(tuple(len(w) for w in width), dtype=np.int64)
    for j, w in enumerate(width):
        cell = cell * w.reshape((1,) * j + (-1,) + (1,) * (len(shape) - j - 1))
    msgs = 0
    for c in np.unique(kept_coord):
        on = kept_coord == c
        sinks = np.ones((int(on.sum()),) + cell.shape, dtype=bool)
        both = sinks.copy()
        for j in range(len(shape)):
            at = (slice(None),) + (None,) * j + (slice(None),) + (None,) * (len(shape) - j - 1)
            x = lo[j][None, :]
            t_in = (tb[on, j, 0][:, None] <= x) & (x < tb[on, j, 1][:, None])
            s_in = (sb[on, j, 0][:, None] <= x) & (x < sb[on, j, 1][:, None])
            sinks = sinks & t_in[at]
            both = both & (t_in & s_in)[at]
        per = k + sinks.sum(axis=0) - 1 - both.any(axis=0)
        msgs += int((per * cell).sum())
    spread = msgs * itemsize // len(sb)  # bytes, as ring collectives count them (pieces of values, rounded down)
    return max(int(need.max(initial=0)) * itemsize, spread)


def _radix(mesh, refs, device: int) -> int:
    coords = mesh.coords(device)
    pos = 0
    for r in refs:
        pos = pos * r.size + r.coord(coords[mesh.axis_index(r.name)])
    return pos


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
    sb, tb = _boxes(src, shape), _boxes(dst, shape)
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
    edges, boxes = [], []
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
            boxes.append(tuple((p[2], p[3]) for p in pieces))
    colours = _edge_colouring(edges)
    by_colour: dict[int, list] = {}
    for edge, box, c in zip(edges, boxes, colours):
        by_colour.setdefault(c, []).append((edge[0], edge[1], box))
    rounds = []
    coords = _grid_coords(mesh.shape)  # edges name devices by mesh position
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


def _exchange_step(rounds: tuple, after: State, moves: tuple, specs: tuple) -> Step:
    axes = tuple(dict.fromkeys(a for _, crossed, _ in rounds for a in crossed))
    return Step("collective_permute", axes, sum(b for b, _, _ in rounds), max((k for _, _, k in rounds), default=1),
                after, moves=moves, rounds=rounds, exchange=specs)


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


def _across_grids(shape, itemsize: int, src: ShardingSpec, dst: ShardingSpec, model: CostModel) -> Plan:
    """Sub-axes of the two specs do not nest into one grid: sum what must be summed on the source grid,
    then one exchange into the target's grid (or gather everything and cut again, whichever is cheaper)."""
    keep = [a for a in src.partial_axes if a in dst.partial_axes]
    mid = ShardingSpec(src.mesh, src.dim_specs, partial_axes=keep)
    first = _plan(shape, itemsize, src, mid, model)
    rounds = exchange_rounds(shape, itemsize, mid, dst)
    gs, gd = grid(mid), grid(dst)
    g_all = tuple(gd.shape[j] if j in gd.partial else 1 for j in range(len(gd.shape)))
    # on the source grid, every dim gathered whole; then re-entered on the target's grid and cut
    gather = _exchange_step(rounds, State((), frozenset()),
                            tuple((d, gs.dims[d], (), (), shape[d], shape[d]) for d in range(len(shape)) if gs.dims[d]),
                            (mid, dst))
    s_mid, atoms_mid = _state(mid, None)
    seg1 = Segment((), atoms_mid, s_mid, (gather,), (len(gs.shape), len(gs.shape)), gs.shape,
                   tuple(gs.shape[j] if j in gs.partial else 1 for j in range(len(gs.shape))))
    t, atoms_dst = _state(dst, None)
    cuts = [Step("slice", _names(atoms_dst, run), 0, prod(atoms_dst[a].size for a in run), t, dst=d, atoms=run,
                 sizes=tuple(atoms_dst[a].size for a in run), dst_chunk=chunk(shape[d], prod(atoms_dst[a].size for a in run)),
                 fused=True)
            for d, run in enumerate(gd.dims) if run]
    start = State(tuple(() for _ in shape), frozenset(gd.partial))
    seg2 = Segment((), atoms_dst, start, tuple(cuts), (len(gs.shape), len(gd.shape)), g_all, gd.shape)
    via_exchange = Plan(first.segments + (seg1, seg2))
    replicated = ShardingSpec(src.mesh, [()] * len(shape), partial_axes=keep)
    via_gather = Plan(_plan(shape, itemsize, mid, replicated, model).segments
                      + _plan(shape, itemsize, replicated, dst, model).segments)
    return min((via_exchange, via_gather), key=lambda p: (p.total_bytes, len(p.events)))


def _across_meshes(shape, itemsize: int, src: ShardingSpec, dst: ShardingSpec, model: CostModel) -> Plan:
    """Same devices in another order: lay out as asked on the source mesh, then every device sends its
    block to the device that holds that grid position in the target mesh (one collective_permute)."""
    a, b = src.mesh, dst.mesh
    if (a.shape, a.axis_names) != (b.shape, b.axis_names) or set(a.devices) != set(b.devices):
        raise ShardingError(f"with_sharding: source is on mesh {a!r}, target on {b!r}; only a change of device "
                            f"order between meshes of one shape, axes and devices is a reshard (otherwise use "
                            f"nb.tensor(t.numpy()).shard(...))")
    here = ShardingSpec(a, dst.dim_specs, partial_axes=dst.partial_axes)
    first = _plan(shape, itemsize, src, here, model)
    moved = tuple(n for i, n in enumerate(a.axis_names) if any(a.coords(d)[i] != b.coords(d)[i] for d in a.devices))
    if not moved:  # every device keeps its place (meshes that differ only by name): no device sends to itself
        return first
    block = prod(chunk(n, here.num_shards(i)) for i, n in enumerate(shape)) * itemsize
    g = grid(here).shape
    state = State((), frozenset())
    relabel = Step("collective_permute", moved, block, prod(b.shape[a.axis_index(n)] for n in moved), state)
    return Plan(first.segments + (Segment((), (), state, (relabel,), (len(g), len(g)), g, g),))


# ---- carrying a plan out ---------------------------------------------------------------------------


def execute(data, p: Plan, reduce_op: str = "sum"):
    """Run plan ``p`` on stored blocks ``data`` (None for abstract tensors: nothing runs). The moves are logged by
    whoever records the step they belong to (``Plan.events``), not here."""
    if data is None:
        return None
    for seg in p.segments:
        data = data.reshape(seg.start_grid + data.shape[seg.enter[0]:])
        for s in seg.steps:
            data = C.REGISTRY[s.kind].move(data, seg.enter[1], s, reduce_op)
        data = data.reshape(seg.end_grid + data.shape[seg.enter[1]:])
    return data
