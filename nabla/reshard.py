"""Plan, then move: a pure, cached planner from (shape, dtype, source spec, target spec) to the
fewest-bytes list of collectives, worked out per mesh atom, and ``execute``, which carries a plan out.
Uneven dims move one atom at a time where their ceil-rule blocks nest, else are gathered and cut again."""

from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import NamedTuple

import numpy as np

from . import collectives as C
from .errors import ShardingError
from .layout import chunk, grid, is_nested, merge_cuts, spec_cuts
from .mesh import AxisRef, merge_adjacent
from .spec import ShardingSpec


class State(NamedTuple):
    dims: tuple[tuple[int, ...], ...]  # per dim, atom indices major to minor
    partial: frozenset[int]


class Step(NamedTuple):
    """One move. ``kind`` is a collective or ``"slice"`` (local, free); ``after`` is the new state."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    group: int
    after: State
    src: int | None = None  # dim the atoms leave (gather, all_to_all, permute)
    dst: int | None = None  # dim the atoms join (slice, reduce_scatter, all_to_all)
    atoms: tuple[int, ...] = ()
    moves: tuple = ()  # permute: per dim (dim, atoms leaving, atoms arriving, their sizes, block length)
    sizes: tuple[int, ...] = ()  # filled by `plan`: the atoms' sizes
    src_chunk: int = 0  # filled by `plan`: block length of `src` after the move
    dst_chunk: int = 0  # filled by `plan`: block length of `dst` after the move


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
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.steps)


def _state(spec: ShardingSpec, cuts) -> tuple[State, tuple[AxisRef, ...]]:
    g = grid(spec, cuts)
    return State(g.dims, frozenset(g.partial)), g.atoms


@lru_cache(maxsize=65536)
def plan(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> Plan:
    """The collectives that turn blocks laid out as ``src`` into ``dst``, fewest bytes first."""
    src, dst = src.layout(), dst.layout()
    if src.mesh != dst.mesh:
        return _across_meshes(shape, itemsize, src, dst)
    src.check_rank(shape, "with_sharding", "source")
    dst.check_rank(shape, "with_sharding", "target")
    extra = set(dst.partial_axes) - set(src.partial_axes)
    if extra:
        raise ShardingError(
            f"with_sharding: target {dst!r} is partial over {sorted(extra)} but the value {src!r} is not; "
            f"a sum cannot be made partial without an op that produces it")
    cuts = merge_cuts(spec_cuts(src), spec_cuts(dst))
    if cuts is not None:
        s0, atoms = _state(src, cuts)
        t, _ = _state(dst, cuts)
        steps = tuple(_fill(st, atoms, shape) for st in _greedy(s0, t, atoms, shape, itemsize))
        if not steps and grid(src).shape == grid(dst).shape:
            return Plan(())
        # no steps but other grids: one placement spelled two ways (a size-1 axis between sub-axes)
        return Plan((Segment(cuts, atoms, s0, steps, (len(grid(src).shape), len(atoms)), _grid_shape(atoms, s0),
                             grid(dst).shape),))
    # Sub-axes of the two specs do not nest: gather to replicated on the source grid, cut on the target's.
    mid = ShardingSpec(src.mesh, [()] * len(shape), partial_axes=[a for a in src.partial_axes if a in dst.partial_axes])
    a, b = plan(shape, itemsize, src, mid), plan(shape, itemsize, mid, dst)
    return Plan(a.segments + b.segments)


def _across_meshes(shape, itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> Plan:
    """Same devices in another order: lay out as asked on the source mesh, then every device sends its
    block to the device that holds that grid position in the target mesh (one collective_permute)."""
    a, b = src.mesh, dst.mesh
    if (a.shape, a.axis_names) != (b.shape, b.axis_names) or set(a.devices) != set(b.devices):
        raise ShardingError(f"with_sharding: source is on mesh {a!r}, target on {b!r}; only a change of device "
                            f"order between meshes of one shape, axes and devices is a reshard (otherwise use "
                            f"nb.tensor(t.numpy()).shard(...))")
    here = ShardingSpec(a, dst.dim_specs, partial_axes=dst.partial_axes)
    first = plan(shape, itemsize, src, here)
    moved = tuple(n for i, n in enumerate(a.axis_names) if any(a.coords(d)[i] != b.coords(d)[i] for d in a.devices))
    block = prod(chunk(n, here.num_shards(i)) for i, n in enumerate(shape)) * itemsize
    g = grid(here).shape
    state = State((), frozenset())
    relabel = Step("collective_permute", moved, block, prod(b.shape[a.axis_index(n)] for n in moved), state)
    return Plan(first.segments + (Segment((), (), state, (relabel,), (len(g), len(g)), g, g),))


def _fill(s: Step, atoms, shape) -> Step:
    def chunk_of(d):
        return 0 if d is None else chunk(shape[d], prod(atoms[a].size for a in s.after.dims[d]))
    return s._replace(sizes=tuple(atoms[a].size for a in s.atoms), src_chunk=chunk_of(s.src), dst_chunk=chunk_of(s.dst))


def _greedy(cur: State, target: State, atoms: tuple[AxisRef, ...], shape, itemsize: int) -> list[Step]:
    steps: list[Step] = []
    sizes = [a.size for a in atoms]
    where_t = {a: d for d, run in enumerate(target.dims) for a in run}

    def k_of(run) -> int:
        return prod(sizes[a] for a in run)

    def block_bytes(state: State) -> int:
        return prod(chunk(n, k_of(run)) for n, run in zip(shape, state.dims)) * itemsize

    def names(run) -> tuple[str, ...]:
        return tuple(str(r) for r in merge_adjacent([atoms[a] for a in sorted(run, key=lambda a: (atoms[a].name, atoms[a].pre))]))

    def is_prefix(d: int, state: State) -> bool:
        return target.dims[d][:len(state.dims[d])] == state.dims[d]

    def next_atoms(d: int, state: State) -> tuple[int, ...]:
        return target.dims[d][len(state.dims[d]):] if is_prefix(d, state) else ()

    def nests_add(d: int, state: State, add) -> bool:
        k = k_of(state.dims[d])
        return k == 1 or is_nested(shape[d], k, k_of(add))

    def fits(d: int, state: State, add) -> bool:
        """Adding ``add`` to dim d is a local cut now, and the rest of the target can follow later."""
        rest = target.dims[d][len(state.dims[d]) + len(add):]
        k = k_of(state.dims[d]) * k_of(add)
        return nests_add(d, state, add) and (not rest or is_nested(shape[d], k, k_of(rest)))

    def nests_remove(d: int, state: State, remove) -> bool:
        k = k_of(state.dims[d]) // k_of(remove)
        return k == 1 or is_nested(shape[d], k, k_of(remove))

    def with_dim(state: State, d: int, run, partial=None) -> State:
        dims = list(state.dims)
        dims[d] = tuple(run)
        return State(tuple(dims), state.partial if partial is None else frozenset(partial))

    def used(state: State) -> set[int]:
        return set(state.partial).union(*state.dims) if state.dims else set(state.partial)

    seen = {cur}
    while cur != target:
        B = block_bytes(cur)
        busy = used(cur)
        move: Step | None = None
        # 0. every dim keeps its shard count but other atoms (or another order) pick each block: every
        #    device needs one block that another device holds, one collective_permute of a block each.
        if cur.partial == target.partial:
            moves = []
            for d, run in enumerate(cur.dims):
                lcp = 0
                while lcp < min(len(run), len(target.dims[d])) and run[lcp] == target.dims[d][lcp]:
                    lcp += 1
                old, new = run[lcp:], target.dims[d][lcp:]
                if k_of(old) != k_of(new):
                    moves = []
                    break
                if old or new:
                    moves.append((d, old, new))
            leaving = {a for _, old, _ in moves for a in old}
            arriving = [a for _, _, new in moves for a in new]
            if moves and all(a in leaving or a not in busy for a in arriving):
                group = prod(k_of(old) for _, old, _ in moves)
                move = Step("collective_permute", names(tuple(leaving | set(arriving))), B, group, target,
                            moves=tuple((d, old, new, tuple(sizes[a] for a in new),
                                         chunk(shape[d], k_of(target.dims[d])))
                                        for d, old, new in moves))
        # 1. local slices: atoms that are free and next in a target dim.
        if move is None:
            for d in range(len(shape)):
                add = tuple(a for a in _take_while(next_atoms(d, cur), lambda a: a not in busy))
                if add and fits(d, cur, add):
                    move = Step("slice", names(add), 0, k_of(add), with_dim(cur, d, cur.dims[d] + add), dst=d, atoms=add)
                    break
        # 2. reduce_scatter: partial atoms the target puts next on a dim.
        if move is None:
            for d in range(len(shape)):
                add = tuple(_take_while(next_atoms(d, cur), lambda a: a in cur.partial and a not in target.partial))
                if add and fits(d, cur, add):
                    k = k_of(add)
                    move = Step("reduce_scatter", names(add), (k - 1) * B // k, k,
                                with_dim(cur, d, cur.dims[d] + add, cur.partial - set(add)), dst=d, atoms=add)
                    break
        # 3. all_to_all: a misplaced minor run of one dim that comes next in another dim.
        if move is None:
            for d, run in enumerate(cur.dims):
                if not run or is_prefix(d, cur):
                    continue
                for i in range(len(run)):
                    group = run[i:]
                    e = where_t.get(group[0])
                    if e is None or e == d or next_atoms(e, cur)[:len(group)] != group or \
                            not (nests_remove(d, cur, group) and fits(e, cur, group)):
                        continue
                    k = k_of(group)
                    mid = with_dim(cur, d, run[:i])
                    move = Step("all_to_all", names(group), (k - 1) * B // k, k,
                                with_dim(mid, e, cur.dims[e] + group), src=d, dst=e, atoms=group)
                    break
                if move is not None:
                    break
        # 4. all_reduce: partial atoms the target keeps on no dim and not partial.
        if move is None:
            red = tuple(sorted(a for a in cur.partial if a not in target.partial and a not in where_t))
            if red:
                k = k_of(red)
                move = Step("all_reduce", names(red), 2 * (k - 1) * B // k, k,
                            State(cur.dims, cur.partial - set(red)), atoms=red)
        # 5. all_gather: atoms past the agreeing prefix of a dim (the whole dim where shards don't nest).
        #    Atoms bound for another dim go last: once they reach a dim's minor end, all_to_all moves them.
        if move is None:
            options = []
            for d, run in enumerate(cur.dims):
                keep = 0
                while keep < len(run) and keep < len(target.dims[d]) and run[keep] == target.dims[d][keep]:
                    keep += 1
                stuck = keep == len(run) and next_atoms(d, cur) and not nests_add(d, cur, next_atoms(d, cur)[:1])
                if keep == len(run) and not stuck:
                    continue
                if stuck or not nests_remove(d, cur, run[keep:]):
                    keep = 0
                gone = run[keep:]
                elsewhere = sum(1 for a in gone if where_t.get(a, d) != d)
                options.append((elsewhere, d, keep, gone))
            if options:
                _, d, keep, gone = min(options)
                k = k_of(gone)
                move = Step("all_gather", names(gone), (k - 1) * B, k, with_dim(cur, d, cur.dims[d][:keep]),
                            src=d, atoms=gone)
        # 6. partial atoms waiting for a dim that cannot take them yet: reduce now, cut later.
        if move is None:
            red = tuple(sorted(a for a in cur.partial if a not in target.partial))
            if red:
                k = k_of(red)
                move = Step("all_reduce", names(red), 2 * (k - 1) * B // k, k,
                            State(cur.dims, cur.partial - set(red)), atoms=red)
        if move is None or move.after in seen:
            break
        steps.append(move)
        cur = move.after
        seen.add(cur)
    if cur == target:
        return steps
    return steps + _gather_then_cut(cur, target, sizes, shape, itemsize, names)


def _gather_then_cut(cur: State, target: State, sizes, shape, itemsize: int, names) -> list[Step]:
    """The always-valid route, for layouts the greedy moves cannot reach: gather every dim whole,
    sum the partial atoms the target does not keep, then cut every dim to the target at once."""
    def k_of(run) -> int:
        return prod(sizes[a] for a in run)

    steps: list[Step] = []
    for d, run in enumerate(cur.dims):
        if run:
            B = prod(chunk(n, k_of(r)) for n, r in zip(shape, cur.dims)) * itemsize
            dims = list(cur.dims)
            dims[d] = ()
            after = State(tuple(dims), cur.partial)
            steps.append(Step("all_gather", names(run), (k_of(run) - 1) * B, k_of(run), after, src=d, atoms=run))
            cur = after
    red = tuple(sorted(a for a in cur.partial if a not in target.partial))
    if red:
        B = prod(shape) * itemsize
        k = k_of(red)
        cur = State(cur.dims, cur.partial - set(red))
        steps.append(Step("all_reduce", names(red), 2 * (k - 1) * B // k, k, cur, atoms=red))
    for d, run in enumerate(target.dims):
        if run:
            dims = list(cur.dims)
            dims[d] = run
            cur = State(tuple(dims), cur.partial)
            steps.append(Step("slice", names(run), 0, k_of(run), cur, dst=d, atoms=run))
    return steps


def _take_while(seq, pred):
    for a in seq:
        if not pred(a):
            return
        yield a


# ---- carrying a plan out ---------------------------------------------------------------------------


def execute(data: np.ndarray | None, p: Plan, op: str = "with_sharding", reduce_op: str = "sum") -> np.ndarray | None:
    """Run plan ``p`` on stored blocks ``data`` (None for abstract tensors: only the log is written)."""
    for seg in p.segments:
        if data is not None:
            data = data.reshape(seg.start_grid + data.shape[seg.enter[0]:])
        cur = seg.start
        for s in seg.steps:
            if s.kind != "slice" and C.logging():
                C.record(C.CommEvent(s.kind, s.axes, s.bytes, s.group, op))
            if data is not None:
                data = _apply(data, seg.enter[1], s, reduce_op)
            cur = s.after
        if data is not None:
            data = data.reshape(seg.end_grid + data.shape[seg.enter[1]:])
    return data


def _grid_shape(atoms, state: State) -> tuple[int, ...]:
    used = set(state.partial).union(*state.dims) if state.dims else set(state.partial)
    return tuple(a.size if j in used else 1 for j, a in enumerate(atoms))


def _apply(x: np.ndarray, G: int, s: Step, reduce_op: str) -> np.ndarray:
    if s.kind == "collective_permute":
        if not s.moves:  # devices relabelled between meshes: the grid is unchanged
            return x
        if all(set(old) == set(new) for _, old, new, _, _ in s.moves):
            for _, old, new, _, _ in s.moves:
                x = C.permute_blocks(x, old, new)
            return x
        # other atoms pick the blocks; a dim's block length is the same before and after, so move the
        # leaving atoms into their dims, then cut the dims onto the arriving atoms
        for d, old, _, sizes, c in s.moves:
            x = C.gather_into(x, G, d, old, c * prod(sizes))
        for d, _, new, sizes, c in s.moves:
            x = C.split_onto(x, G, d, new, sizes, c)
        return x
    if s.kind == "all_reduce":
        return C.reduce_over(x, s.atoms, reduce_op)
    if s.kind == "reduce_scatter":
        x = C.reduce_over(x, s.atoms, reduce_op)
        return C.split_onto(x, G, s.dst, s.atoms, s.sizes, s.dst_chunk)
    if s.kind == "slice":
        return C.split_onto(x, G, s.dst, s.atoms, s.sizes, s.dst_chunk)
    if s.kind == "all_gather":
        return C.gather_into(x, G, s.src, s.atoms, s.src_chunk)
    if s.kind == "all_to_all":
        x = C.gather_into(x, G, s.src, s.atoms, s.src_chunk)
        return C.split_onto(x, G, s.dst, s.atoms, s.sizes, s.dst_chunk)
    raise ShardingError(f"internal: unknown step {s.kind}")
