"""The choice autoshard makes, as a mixed-integer program: one option per group (a layer class, the rest of the
program), costs per option and per pair of neighbouring groups, memory per device within a limit. Solved with
HiGHS through ``scipy.optimize.milp`` (scipy is the ``plan`` extra, imported here only when a problem is solved)."""

from __future__ import annotations

from math import prod
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import ShardingError


class Group(NamedTuple):
    """A choice of one option. Per option: ``time`` (seconds, already times the group's count), ``memory``
    (bytes per device held at the step's first peak, times the count), ``transient`` (bytes per device held
    only while one instance runs: a peak adds the largest chosen one) and ``late`` (bytes per device held at a
    second peak, times the count: the end of the backward pass, where gradients wait; None: no second peak).
    The model's memory is the larger peak."""

    time: Sequence[float]
    memory: Sequence[float]
    transient: Sequence[float]
    late: Sequence[float] | None = None


class Edge(NamedTuple):
    """Seconds ``cost[i][j]`` when group ``a`` takes option ``i`` and group ``b`` option ``j`` (infinite: the two
    options never go together)."""

    a: int
    b: int
    cost: np.ndarray


class Solution(NamedTuple):
    choice: tuple[int, ...]  # per group, the option taken
    time: float
    memory: float  # the peak per device the model predicts (held plus the largest transient)


#: HiGHS stops within this relative gap of the optimum (its default, 1e-4, lets a 0.01% slower choice through)
GAP = 1e-9
#: a program with at most this many choices its edges allow is solved by trying them all (a chain of fed
#: classes, embedding -> layers -> head, has a few thousand: HiGHS took 1-2 s over what numpy does in milliseconds)
ENUMERATE = 1_000_000
#: times within this fraction of the least are taken as ties (broken toward less memory)
TIE = 1e-6


def _program(groups: Sequence[Group], edges: Sequence[Edge]):
    """Variables: x (one binary per group option), then e (one per pair of an edge's options that may go together:
    a finite cost; an infinite one rules the pair out), then T (the largest chosen transient). Rows: one option
    per group; each edge's pair variables sum to its endpoints' choices (Alpa's linearisation of the product: an
    option with no allowed partner is never taken); T >= each chosen transient. The rows are sparse (a class fed
    by another has hundreds of options, its edge tens of thousands of pairs)."""
    off, n = [], 0
    for g in groups:
        off.append(n)
        n += len(g.time)
    pairs = []  # per edge, the allowed (i, j) and their variables' first index
    for e in edges:
        ii, jj = np.nonzero(np.isfinite(e.cost))
        pairs.append((ii, jj, n))
        n += len(ii)
    t_var = n
    n += 1
    # memory in units of the largest number in it (HiGHS calls a program whose coefficients span 1 to 1e12 bytes
    # infeasible): the rows below and ``mem``, ``late`` are bytes / ``scale``, and so is T
    scale = max([1.0] + [float(max(list(g.memory) + list(g.transient) + list(g.late if g.late is not None else [])))
                         for g in groups if len(g.time)])
    r_idx: list = []  # (row, column, value) of the nonzero entries
    c_idx: list = []
    vals: list = []
    lo: list = []
    hi: list = []

    def row(cols: Sequence[int], coefs: Sequence[float], low: float, high: float) -> None:
        r_idx.extend([len(lo)] * len(cols))
        c_idx.extend(cols)
        vals.extend(coefs)
        lo.append(low)
        hi.append(high)

    for g, o in zip(groups, off):
        row(range(o, o + len(g.time)), [1.0] * len(g.time), 1.0, 1.0)
    for e, (ii, jj, o) in zip(edges, pairs):
        na, nb = e.cost.shape
        for side, count, owner in ((ii, na, off[e.a]), (jj, nb, off[e.b])):
            order = np.argsort(side, kind="stable")
            bounds = np.searchsorted(side[order], np.arange(count + 1))
            for k in range(count):
                cols = (o + order[bounds[k]:bounds[k + 1]]).tolist()
                row(cols + [owner + k], [1.0] * len(cols) + [-1.0], 0.0, 0.0)
    for g, o in zip(groups, off):
        for i, t in enumerate(g.transient):
            if t > 0:
                row([o + i, t_var], [float(t) / scale, -1.0], -np.inf, 0.0)
    time = np.zeros(n)
    mem = np.zeros(n)
    late = np.zeros(n)
    for g, o in zip(groups, off):
        time[o:o + len(g.time)] = g.time
        mem[o:o + len(g.memory)] = g.memory
        late[o:o + len(g.memory)] = g.memory if g.late is None else g.late
    for e, (ii, jj, o) in zip(edges, pairs):
        time[o:o + len(ii)] = e.cost[ii, jj]
    mem /= scale
    late /= scale
    mem[t_var] = late[t_var] = 1.0
    integral = np.zeros(n)
    for g, o in zip(groups, off):
        integral[o:o + len(g.time)] = 1
    A = _sparse().coo_array((vals, (r_idx, c_idx)), shape=(len(lo), n)).tocsr()
    return off, t_var, A, np.array(lo), np.array(hi), time, mem, late, integral, scale


def _sparse():
    """``scipy.sparse`` (the plan extra, loaded with the solver)."""
    _scipy()
    import scipy.sparse  # noqa: PLC0415 - the plan extra, loaded here only
    return scipy.sparse


def _scipy() -> tuple:
    """scipy's ``Bounds``, ``LinearConstraint`` and ``milp``; without scipy, a ``ShardingError`` naming the call
    that needs it (``nb.autoshard``, this module's only user) and the pip command, as ``nb.jit`` names jax's."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp  # noqa: PLC0415 - the plan extra, loaded here only
    except ImportError:
        raise ShardingError("autoshard needs scipy (its MILP solver, HiGHS): pip install 'nabla-spmd[plan]' (in a "
                            "clone: pip install -e '.[plan]')") from None
    return Bounds, LinearConstraint, milp


def solve(groups: Sequence[Group], edges: Sequence[Edge] = (), memory_limit: float = np.inf,
          exclude: Sequence[Sequence[int]] = (), enumerate_up_to: int = ENUMERATE) -> Solution | None:
    """The least-time choice whose memory stays within ``memory_limit``; among those within a relative 1e-6 of
    the least time, the one with the least memory (a second solve). ``exclude``: choices not to return again.
    ``None`` when no choice fits. Up to ``enumerate_up_to`` choices the edges allow: every one evaluated
    (exact; ties toward less memory, then less time, then the earlier options: the standard layouts)."""
    Bounds, LinearConstraint, milp = _scipy()  # (the plan extra: needed whichever way the program is solved)
    every = _choices(groups, edges, enumerate_up_to)
    if every is not None:
        return _best(groups, edges, every, memory_limit, exclude)
    near = _near_fastest(groups, edges, enumerate_up_to)
    if near is not None:  # where one of the choices as fast as the fastest fits, it is the answer (a slower one
        # may not be: a faster one that fits may take an option no near-fastest choice takes)
        rows, fastest = near
        sol = _best(groups, edges, rows, memory_limit, exclude)
        if sol is not None and sol.time <= fastest * (1 + TIE) + 1e-12 * max(1.0, abs(fastest)):
            return sol
    off, t_var, A, lo, hi, time, mem, late, integral, scale = _program(groups, edges)
    n = len(time)
    extra = []
    for ch in exclude:  # at most len-1 of an excluded choice's options may be taken again
        r = np.zeros(n)
        for g, i in enumerate(ch):
            r[off[g] + i] = 1.0
        extra.append((r, -np.inf, len(ch) - 1))
    bounds = Bounds(np.zeros(n), np.r_[np.ones(n - 1), np.inf])

    def run(c: np.ndarray, more: list) -> np.ndarray | None:
        rows = [A] + [_sparse().csr_array(r[None, :]) for r, _, _ in more]
        cons = LinearConstraint(_sparse().vstack(rows, format="csr"), np.r_[lo, [l for _, l, _ in more]],
                                np.r_[hi, [h for _, _, h in more]])
        res = milp(c, constraints=cons, integrality=integral, bounds=bounds, options={"mip_rel_gap": GAP})
        return res.x if res.status == 0 and res.x is not None else None

    cap = [] if not np.isfinite(memory_limit) else [(mem, -np.inf, float(memory_limit) / scale),
                                                     (late, -np.inf, float(memory_limit) / scale)]
    # time in units of the largest option's: HiGHS's absolute gap and feasibility tolerances (1e-6, 1e-7) are
    # a good part of a step of 100 microseconds
    time = time / max(1e-30, float(np.abs(time[np.isfinite(time)]).max(initial=0.0)))
    x = run(time, cap + extra)
    if x is None:
        return None
    best = float(time @ x)
    # ties: the least memory, as the larger peak (an extra variable M >= both peaks, minimised)
    x2 = _least(A, lo, hi, integral, mem, late, cap + extra + [(time, -np.inf, best * (1 + TIE) + 1e-12)])
    if x2 is not None:
        x = x2
    choice = tuple(int(np.argmax(x[o:o + len(g.time)])) for g, o in zip(groups, off))
    return Solution(choice, *evaluate(groups, edges, choice))


def _least(A, lo, hi, integral, mem, late, more) -> np.ndarray | None:
    """Minimise M >= both peaks subject to the program's rows and ``more``; the solution without M."""
    Bounds, LinearConstraint, milp = _scipy()
    n = A.shape[1]
    sp = _sparse()
    dense = [np.r_[r, 0.0] for r, _, _ in more] + [np.r_[mem, -1.0], np.r_[late, -1.0]]
    rows = [sp.hstack([A, sp.csr_array((A.shape[0], 1))]), sp.csr_array(np.array(dense))]
    cons = LinearConstraint(sp.vstack(rows, format="csr"), np.r_[lo, [l for _, l, _ in more], -np.inf, -np.inf],
                            np.r_[hi, [h for _, _, h in more], 0.0, 0.0])
    c = np.zeros(n + 1)
    c[-1] = 1.0
    res = milp(c, constraints=cons, integrality=np.r_[integral, 0],
               bounds=Bounds(np.zeros(n + 1), np.r_[np.ones(n - 1), np.inf, np.inf]), options={"mip_rel_gap": GAP})
    return res.x[:n] if res.status == 0 and res.x is not None else None


def least_memory(groups: Sequence[Group], edges: Sequence[Edge] = (), enumerate_up_to: int = ENUMERATE
                 ) -> Solution:
    """The choice with the least predicted memory per device."""
    _scipy()
    every = _choices(groups, edges, enumerate_up_to)
    if every is not None:
        t, m = _evaluate_all(groups, edges, every)
        if not len(t):
            raise ShardingError(_NONE_ALLOWED)
        k = np.lexsort((np.arange(len(t)), t, m))[0]
        return Solution(tuple(int(i) for i in every[k]), float(t[k]), float(m[k]))
    off, t_var, A, lo, hi, time, mem, late, integral, _ = _program(groups, edges)
    x = _least(A, lo, hi, integral, mem, late, [])
    if x is None:
        raise ShardingError(_NONE_ALLOWED)
    choice = tuple(int(np.argmax(x[o:o + len(g.time)])) for g, o in zip(groups, off))
    return Solution(choice, *evaluate(groups, edges, choice))


_NONE_ALLOWED = ("autoshard: there is no choice of one layout per layer class that its neighbours accept (each "
                 "class fed by another takes only the layouts that one hands over)")


def _choices(groups: Sequence[Group], edges: Sequence[Edge], cap: int) -> np.ndarray | None:
    """Every choice (one row, an option per group, rows in lexicographic order) no edge rules out (an infinite
    cost), built group by group; None when some step would hold more than ``cap`` rows."""
    rows = np.zeros((1, 0), dtype=np.int64)
    for g, grp in enumerate(groups):
        k = len(grp.time)
        if len(rows) * k > cap:
            return None
        prev = np.repeat(rows, k, axis=0)
        mine = np.tile(np.arange(k, dtype=np.int64), len(rows))
        ok = np.ones(len(prev), dtype=bool)
        for e in edges:
            if e.b == g and e.a < g:
                ok &= np.isfinite(e.cost[prev[:, e.a], mine])
            elif e.a == g and e.b < g:
                ok &= np.isfinite(e.cost[mine, prev[:, e.b]])
            elif e.a == g == e.b:
                ok &= np.isfinite(e.cost[mine, mine])
        rows = np.column_stack([prev[ok], mine[ok]])
    return rows


#: the largest table (entries) eliminating one group may build; a program needing more is left to HiGHS
MAX_TABLE = 4_000_000
#: at most this many groups are eliminated (once per group: the work grows as the cube of their number; 40 take
#: 0.2 s, a chain of 160 took 23 s where HiGHS takes 0.24 s)
MAX_ELIMINATED = 40


def _near_fastest(groups: Sequence[Group], edges: Sequence[Edge], cap: int) -> tuple[np.ndarray, float] | None:
    """Every choice whose time is within twice ``TIE`` of the least (rows of options, as ``_choices``; with
    them, some slower ones), and the least time, found without a solver: per group, each option's least time
    over all choices taking it (the other groups eliminated one by one, a min-sum over the edges' tables), the
    options no such choice can take dropped, and the rest enumerated. When ``_best`` over them returns a choice
    within the tie of the least time, it is ``solve``'s answer (every choice it ties with is among them); a
    slower one is not (the limit binds: HiGHS decides). None when the groups, the tables or the choices left
    grow past ``MAX_ELIMINATED``, ``MAX_TABLE`` or ``cap``."""
    if len(groups) > MAX_ELIMINATED:
        return None
    unary = [np.asarray(g.time, dtype=float).copy() for g in groups]
    pairs: list[tuple[tuple[int, ...], np.ndarray]] = []
    for e in edges:
        cost = np.asarray(e.cost, dtype=float)
        if e.a == e.b:
            unary[e.a] = unary[e.a] + np.diagonal(cost)
        else:
            pairs.append(((e.a, e.b), cost))
    factors = [((g,), u) for g, u in enumerate(unary)] + pairs
    sizes = [len(u) for u in unary]
    least = []
    for g in range(len(groups)):
        m = _marginal(factors, sizes, g)
        if m is None:
            return None
        least.append(m)
    best = min((float(m.min()) for m in least), default=0.0)
    if not np.isfinite(best):
        return None
    slack = best * (1 + TIE) ** 2 + 1e-12 * max(1.0, abs(best))
    keep = [np.flatnonzero(m <= slack) for m in least]
    sub = [Group(*(np.asarray(f, dtype=float)[k] if f is not None else None for f in g)) for g, k in zip(groups, keep)]
    sub_edges = [Edge(e.a, e.b, np.asarray(e.cost, dtype=float)[np.ix_(keep[e.a], keep[e.b])]) for e in edges]
    rows = _choices(sub, sub_edges, cap)
    if rows is None:
        return None
    return (np.column_stack([k[rows[:, g]] for g, k in enumerate(keep)]) if len(keep) else rows), best


def _marginal(factors: list, sizes: list[int], target: int) -> np.ndarray | None:
    """Per option of group ``target``, the least sum of ``factors`` (each (groups, table)) over every choice of
    the other groups: they are eliminated in turn, the one making the smallest table first."""
    factors = list(factors)
    left = set(range(len(sizes))) - {target}
    while left:
        spans = {v: sorted({u for vs, _ in factors if v in vs for u in vs} - {v}) for v in left}  # what eliminating
        # v joins
        v = min(left, key=lambda v: (prod(sizes[u] for u in spans[v]), v))
        span = spans[v]
        if prod(sizes[u] for u in span) * sizes[v] > MAX_TABLE:
            return None
        axes = span + [v]
        total = np.zeros([sizes[u] for u in axes])
        rest = []
        for vs, t in factors:
            if v not in vs:
                rest.append((vs, t))
                continue
            order = sorted(range(len(vs)), key=lambda i: axes.index(vs[i]))
            shape = [1] * len(axes)
            for i in order:
                shape[axes.index(vs[i])] = sizes[vs[i]]
            total = total + np.transpose(t, order).reshape(shape)
        factors = rest + [(tuple(span), total.min(axis=-1))]
        left.discard(v)
    out = np.zeros(sizes[target])
    for vs, t in factors:
        out = out + (t if vs else np.full(sizes[target], float(t)))
    return out


def _evaluate_all(groups: Sequence[Group], edges: Sequence[Edge], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``evaluate`` of every row of choices: (times, memories)."""
    t = np.zeros(len(rows))
    first, second, top = np.zeros(len(rows)), np.zeros(len(rows)), np.zeros(len(rows))
    for g, grp in enumerate(groups):
        c = rows[:, g]
        t += np.asarray(grp.time, dtype=float)[c]
        first += np.asarray(grp.memory, dtype=float)[c]
        second += np.asarray(grp.memory if grp.late is None else grp.late, dtype=float)[c]
        top = np.maximum(top, np.asarray(grp.transient, dtype=float)[c])
    for e in edges:
        t += np.asarray(e.cost, dtype=float)[rows[:, e.a], rows[:, e.b]]
    return t, np.maximum(first, second) + top


def _best(groups: Sequence[Group], edges: Sequence[Edge], rows: np.ndarray, memory_limit: float,
          exclude: Sequence[Sequence[int]]) -> Solution | None:
    """``solve`` over the rows of choices: the least time within the limit, then among the ties the least memory."""
    t, m = _evaluate_all(groups, edges, rows)
    ok = m <= memory_limit
    for ch in exclude:
        ok &= np.any(rows != np.asarray(ch, dtype=np.int64), axis=1)
    if not ok.any():
        return None
    scale = max(1e-30, float(np.abs(t).max(initial=0.0)))  # as the MILP sees times: in units of the largest
    best = float(t[ok].min()) / scale
    tied = np.flatnonzero(ok & (t / scale <= best * (1 + TIE) + 1e-12))
    k = tied[np.lexsort((np.arange(len(tied)), t[tied], m[tied]))[0]]
    return Solution(tuple(int(i) for i in rows[k]), float(t[k]), float(m[k]))


def evaluate(groups: Sequence[Group], edges: Sequence[Edge], choice: Sequence[int]) -> tuple[float, float]:
    """(time, memory) the model gives ``choice``."""
    t = sum(g.time[i] for g, i in zip(groups, choice)) + sum(float(e.cost[choice[e.a], choice[e.b]]) for e in edges)
    first = sum(g.memory[i] for g, i in zip(groups, choice))
    second = sum((g.memory if g.late is None else g.late)[i] for g, i in zip(groups, choice))
    return float(t), float(max(first, second) + max([g.transient[i] for g, i in zip(groups, choice)], default=0.0))
