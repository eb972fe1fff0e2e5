"""The reshard planner: ``plan`` (cached on shape, itemsize, layouts, cost model and the registry's epoch) finds
the cheapest sequence of moves under the cost model by A* over atom states, and plans moves across grids
and meshes; the moves come from ``moves``, exchanges from ``exchange``, the search's guide from ``bounds``."""

from __future__ import annotations

import heapq
from functools import lru_cache
from itertools import count
from math import prod
from typing import NamedTuple

from .. import collectives as C
from ..cost import CostModel, current as current_cost_model
from ..errors import ShardingError
from ..layout import chunk, grid, merge_cuts, spec_cuts
from ..mesh import AxisRef
from ..spec import ShardingSpec
from .exchange import planned_exchange
from .moves import LegalMoves, Move, Segment, State, atom_names, exchange_move, spec_of


class Plan(NamedTuple):
    """The moves from one layout to another, by segment; ``query`` (shape, itemsize, source and target layouts,
    cost model) what the planner was asked, for a plan ``plan`` returns (empty for a part of one)."""

    segments: tuple[Segment, ...]
    query: tuple = ()

    @property
    def steps(self) -> tuple[Move, ...]:
        return tuple(s for seg in self.segments for s in seg.steps)

    @property
    def collectives(self) -> tuple[Move, ...]:
        return tuple(s for s in self.steps if s.kind != "slice")

    @property
    def events(self) -> tuple[C.CommEvent, ...]:
        return tuple(e for s in self.steps for e in s.events())

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.events)

    @property
    def hops(self) -> tuple[Hop, ...] | None:
        """The move as one plan per collective, each from the layout the last one reached, when planning each
        hop anew sends what the whole plan sends (a later move to one of those layouts can then be made once, as
        XLA's CSE makes it); None when it is one collective or less, when hop-by-hop planning would send other
        bytes, or for a part of a plan. The planner's, worked out on first read and cached (a search makes
        thousands of plans; only ``nb.jit`` reads their hops): no reader plans them."""
        return _hops(self.segments, *self.query, C.epoch()) if self.query and len(self.collectives) > 1 else None


class Hop(NamedTuple):
    """One collective of a plan as a plan of its own: from layout ``src`` to ``dst``."""

    src: ShardingSpec
    dst: ShardingSpec
    plan: Plan


def plan(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> Plan:
    """The collectives that turn blocks laid out as ``src`` into ``dst``, cheapest first under ``nb.CostModel``."""
    return _plan(tuple(shape), itemsize, src.layout(), dst.layout(), current_cost_model(), C.epoch())


@lru_cache(maxsize=8192)
def _plan(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec, model: CostModel,
          epoch: int = 0) -> Plan:
    """A plan as its readers get it: the cheapest route, with what it was planned for (its hops are read from
    that)."""
    return _route(shape, itemsize, src, dst, model, epoch)._replace(query=(shape, itemsize, src, dst, model))


@lru_cache(maxsize=8192)
def _hops(segments: tuple[Segment, ...], shape: tuple[int, ...], itemsize: int, src: ShardingSpec,
          dst: ShardingSpec, model: CostModel, epoch: int) -> tuple[Hop, ...] | None:
    """``Plan.hops`` of the route ``segments`` from ``src`` to ``dst``: through the layouts its collectives
    reach, each hop planned anew, when the hops send what the route sends (kind, axes and bytes, in order)."""
    route = Plan(segments)
    steps = [(st, seg) for seg in route.segments for st in seg.steps if st.kind != "slice"]
    if len(steps) < 2:
        return None
    try:
        mids = [spec_of(st.after, seg.atoms, src.mesh).layout() for st, seg in steps[:-1]]
        specs = [src] + mids + [dst]
        plans = [_route(shape, itemsize, a, b, model, epoch) for a, b in zip(specs, specs[1:])]
    except Exception:  # noqa: BLE001 - a state that names no spec, or a hop no plan makes: the move stays whole
        return None
    got = [(e.kind, tuple(e.axes), e.bytes) for p in plans for e in p.events]
    if got != [(e.kind, tuple(e.axes), e.bytes) for e in route.events]:
        return None
    return tuple(Hop(a, b, p) for a, b, p in zip(specs, specs[1:], plans))


@lru_cache(maxsize=8192)
def _route(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec, model: CostModel,
           epoch: int = 0) -> Plan:
    """The cheapest sequence of moves from ``src`` to ``dst`` (layouts) under ``model``."""
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
    via = Plan(_route(shape, itemsize, src, whole, model).segments
               + _route(shape, itemsize, whole, dst, model).segments)
    return via if _price(via, model) < _price(direct, model) else direct


def _step_price(step: Move, model: CostModel) -> tuple[int, int, int]:
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


def _search(s0: State, t: State, atoms, shape, itemsize: int, mesh, model: CostModel) -> list[Move]:
    """Cheapest path from ``s0`` to ``t``: A* on (transfer time, latency, collectives), the transfer part guided by
    the bytes each device still lacks (no move delivers more than it sends). An exchange is priced at that
    bound first and worked out only when the bound could still win."""
    if s0 == t:
        return []
    ctx = LegalMoves(t, atoms, shape, itemsize, mesh)
    fastest = max(model.link([str(a)]).bandwidth for a in atoms) if atoms else 1.0
    quickest = min(model.split(1, 0, [str(a)])[1] for a in atoms) if atoms else 0
    dst = spec_of(t, atoms, mesh)

    def h(s: State) -> int:
        return round(ctx.bound(s) / fastest * 1e15)  # rounded as CostModel.split rounds: equal bytes tie

    costs: dict = {}

    def cost_of(step: Move) -> tuple[int, int, int]:
        if step.rounds:
            return _step_price(step, model)
        key = (step.kind, step.group, step.bytes, step.axes)
        got = costs.get(key)
        if got is None:
            got = costs[key] = _step_price(step, model)
        return got

    tie = count()
    best = {s0: (0, 0, 0)}
    back: dict[State, tuple[State, Move]] = {}
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
        raise ShardingError(f"internal: no reshard plan from {spec_of(s0, atoms, mesh)!r} to {dst!r}")
    out: list[Move] = []
    s = t
    while s != s0:
        s, step = back[s]
        out.append(step._replace(pre=()))
        out.extend(step.pre[::-1])
    return out[::-1]


def _across_grids(shape, itemsize: int, src: ShardingSpec, dst: ShardingSpec, model: CostModel) -> Plan:
    """Sub-axes of the two specs do not nest into one grid: sum what must be summed on the source grid,
    then one exchange into the target's grid (or gather everything and cut again, whichever is cheaper)."""
    keep = [a for a in src.partial_axes if a in dst.partial_axes]
    mid = ShardingSpec(src.mesh, src.dim_specs, partial_axes=keep)
    first = _route(shape, itemsize, src, mid, model)
    ex = planned_exchange(shape, itemsize, mid, dst)
    gs, gd = grid(mid), grid(dst)
    g_all = tuple(gd.shape[j] if j in gd.partial else 1 for j in range(len(gd.shape)))
    # on the source grid, every dim gathered whole; then re-entered on the target's grid and cut
    gather = exchange_move(ex, State((), frozenset()),
                           tuple((d, gs.dims[d], (), (), shape[d], shape[d]) for d in range(len(shape)) if gs.dims[d]))
    s_mid, atoms_mid = _state(mid, None)
    seg1 = Segment((), atoms_mid, s_mid, (gather,), (len(gs.shape), len(gs.shape)), gs.shape,
                   tuple(gs.shape[j] if j in gs.partial else 1 for j in range(len(gs.shape))))
    t, atoms_dst = _state(dst, None)
    cuts = [Move("slice", atom_names(atoms_dst, run), 0, prod(atoms_dst[a].size for a in run), t, dst=d,
                 atoms=run, sizes=tuple(atoms_dst[a].size for a in run),
                 dst_chunk=chunk(shape[d], prod(atoms_dst[a].size for a in run)), fused=True)
            for d, run in enumerate(gd.dims) if run]
    start = State(tuple(() for _ in shape), frozenset(gd.partial))
    seg2 = Segment((), atoms_dst, start, tuple(cuts), (len(gs.shape), len(gd.shape)), g_all, gd.shape)
    via_exchange = Plan(first.segments + (seg1, seg2))
    replicated = ShardingSpec(src.mesh, [()] * len(shape), partial_axes=keep)
    via_gather = Plan(_route(shape, itemsize, mid, replicated, model).segments
                      + _route(shape, itemsize, replicated, dst, model).segments)
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
    first = _route(shape, itemsize, src, here, model)
    moved = tuple(n for i, n in enumerate(a.axis_names) if any(a.coords(d)[i] != b.coords(d)[i] for d in a.devices))
    if not moved:  # every device keeps its place (meshes that differ only by name): no device sends to itself
        return first
    block = prod(chunk(n, here.num_shards(i)) for i, n in enumerate(shape)) * itemsize
    g = grid(here).shape
    state = State((), frozenset())
    relabel = Move("collective_permute", moved, block, prod(b.shape[a.axis_index(n)] for n in moved), state)
    return Plan(first.segments + (Segment((), (), state, (relabel,), (len(g), len(g)), g, g),))
