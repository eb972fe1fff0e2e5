"""Factor-based sharding propagation (Shardy; the Nabla sharding README): collect dims -> factors, merge, update
factors -> dims. Pure and data-free, cached on (rule, specs, strategy); the executor decides what
happens to partial sums and passes the axes that must stay free as ``reserved``."""

from __future__ import annotations

import contextlib
import contextvars
from functools import lru_cache
from math import prod
from typing import Iterator, NamedTuple, Sequence

from .errors import ShardingError
from .scoped import setting
from .mesh import AxisRef, DeviceMesh, merge_adjacent
from .factors import divisible_prefix
from .rules.core import Rule, factor_names
from .spec import DimSpec, ShardingSpec

BASIC, AGGRESSIVE = "basic", "aggressive"
_strategy: contextvars.ContextVar[str] = contextvars.ContextVar("nabla_strategy", default=AGGRESSIVE)


@contextlib.contextmanager
def strategy(name: str) -> Iterator[None]:
    """``with nb.strategy("basic"):`` resolve conflicts as Shardy's basic propagation does (the default,
    ``"aggressive"``, is what JAX's Shardy pipeline runs: results take the most parallel sharding)."""
    if name not in (BASIC, AGGRESSIVE):
        raise ShardingError(f"strategy: unknown strategy {name!r}; use 'basic' or 'aggressive'")
    with setting(_strategy, name):
        yield


def current_strategy() -> str:
    return _strategy.get()


class Opinion(NamedTuple):
    """What one operand's dims say of a factor: the axes, whether the dim is open, its priority, the operand
    and its size in elements (propagation's conflict order reads them: ``why`` tells it)."""

    operand: int
    axes: tuple[str, ...]
    is_open: bool
    priority: int
    size: int


class Decision(NamedTuple):
    """What an op needs: each operand's layout, the result's spec, and the merged factor shardings; with what
    each operand said of each factor and the strategy that resolved them, its reasons (``why``)."""

    operands: tuple[ShardingSpec, ...]
    result: ShardingSpec
    factors: tuple[tuple[AxisRef, ...], ...]
    #: the result as the kernel computes it, when ``result`` holds more: factors that the operands' dims cannot
    #: hold but the result's can (a reshape's minor-most factor, a factor behind a replicated one); the
    #: executor slices the kernel's output to ``result`` locally, or keeps this layout when that would move data
    computed: ShardingSpec | None = None
    opinions: tuple[tuple[Opinion, ...], ...] = ()  # per factor, in operand order
    strategy: str = AGGRESSIVE


class _Entry(NamedTuple):
    axes: tuple[AxisRef, ...]
    is_open: bool
    priority: int
    size: int  # elements of the tensor it comes from: AGGRESSIVE prefers larger tensors
    banned: tuple[AxisRef, ...] = ()  # the tensor's explicitly replicated axes: never shard it on them
    operand: int = 0  # which operand it comes from: AGGRESSIVE prefers the lhs on ties


_NO_PRIORITY = 1 << 30


def project_dim(refs: Sequence[AxisRef], factors: Sequence[int], sizes: Sequence[int],
                always: frozenset[int] = frozenset()) -> dict[int, list[AxisRef]]:
    """A dim's axes spread over its factors major to minor; an axis straddling two factors splits into
    sub-axes, one that does not divide stops the projection, except on the minor-most factor, which takes
    whatever is left (uneven or overflowing, as in Shardy). A lone factor takes any axes (uneven ok)."""
    real = [f for f in factors if sizes[f] > 1 or f in always]
    out: dict[int, list[AxisRef]] = {f: [] for f in real}
    if len(real) == 1:
        out[real[0]] = list(refs)
        return out
    q, rem = 0, sizes[real[0]] if real else 1
    todo = list(refs)
    while todo and q < len(real):
        if q == len(real) - 1:  # the minor-most factor
            out[real[q]] += todo
            break
        r = todo.pop(0)
        if rem % r.size == 0:
            out[real[q]].append(r)
            rem //= r.size
        elif r.size % rem == 0:
            out[real[q]].append(AxisRef(r.name, r.pre, rem, r.full))
            todo.insert(0, AxisRef(r.name, r.pre * rem, r.size // rem, r.full))
            rem = 1
        else:
            break
        if rem == 1:
            q += 1
            rem = sizes[real[q]] if q < len(real) else 1
    return out


def _overlaps_any(r: AxisRef, taken: Sequence[AxisRef]) -> bool:
    return any(r.overlaps(t) for t in taken)


def _prefix_free(axes: Sequence[AxisRef], taken: Sequence[AxisRef]) -> tuple[AxisRef, ...]:
    """The longest prefix of ``axes`` that overlaps nothing in ``taken``."""
    keep: list[AxisRef] = []
    for r in axes:
        if _overlaps_any(r, taken):
            break
        keep.append(r)
    return tuple(keep)


def _merge_factor(entries: list[_Entry], strat: str) -> tuple[tuple[AxisRef, ...], int, int, int]:
    """The factor's axes from its tensors' opinions: (axes, priority, size of the largest source, the first
    operand among the sources)."""
    active = [e for e in entries if e.axes or not e.is_open]
    if not active:
        return (), _NO_PRIORITY, 0, 0
    p = min(e.priority for e in active)
    top = [e for e in active if e.priority == p]
    longest = max((e.axes for e in top), key=len)
    if all(longest[:len(e.axes)] == e.axes for e in top):
        axes = longest
    else:  # lists that are not prefixes of one another: keep only what they share
        axes = ()
        for i in range(min(len(e.axes) for e in top)):
            if len({e.axes[i] for e in top}) > 1:
                break
            axes = longest[:i + 1]
    if strat == BASIC:
        closed = [len(e.axes) for e in top if not e.is_open]
        if closed:
            axes = axes[:min(closed)]
    banned = [b for e in entries for b in e.banned]
    for i, r in enumerate(axes):  # explicitly replicated axes hold in every strategy
        if _overlaps_any(r, banned):
            axes = axes[:i]
            break
    # Shardy's source of a factor's axes: a tensor that holds them all (its list starts with them); of several,
    # the first of the largest
    sources = [e for e in top if axes and e.axes[:len(axes)] == axes]
    size = max((e.size for e in sources), default=0)
    return axes, p, size, min((e.operand for e in sources if e.size == size), default=0)


@lru_cache(maxsize=8192)
def propagate(rule: Rule, specs: tuple[ShardingSpec | None, ...], mesh: DeviceMesh,
              strat: str = BASIC, reserved: tuple[str, ...] = ()) -> Decision:
    """Decide every factor's axes, then each operand's required layout and the result's spec.

    ``specs[i]`` is None for an operand with no sharding yet (all dims open). Partial axes of the
    operands are ignored here; ``reserved`` lists axes no factor may take (partial sums kept alive).
    """
    nf = len(rule.sizes)
    windowed = frozenset(f for f in range(nf) if rule.kinds[f].windowed)
    entries: list[list[_Entry]] = [[] for _ in range(nf)]
    for k, (spec, dims) in enumerate(zip(specs, rule.operands)):
        if spec is None:
            continue
        if spec.rank != len(dims):
            raise ShardingError(f"propagate: operand {k} spec {spec!r} has rank {spec.rank}, rule {rule} wants {len(dims)}")
        tsize = prod(prod(rule.sizes[f] for f in d) for d in dims)
        banned = tuple(mesh.axis_ref(a) for a in spec.replicated_axes)
        for ds, refs, factors in zip(spec.dim_specs, spec.dim_refs, dims):
            for f, axes in project_dim(refs, factors, rule.sizes, windowed).items():
                entries[f].append(_Entry(tuple(axes), ds.is_open, ds.priority, tsize, banned, k))

    merged = [_merge_factor(entries[f], strat) if rule.kinds[f].shardable else ((), _NO_PRIORITY, 0, 0)
              for f in range(nf)]
    taken: list[AxisRef] = [mesh.axis_ref(a) for a in reserved]
    factor_axes: list[tuple[AxisRef, ...]] = [()] * nf
    if strat == AGGRESSIVE:
        # One factor at a time, each taking what is left: stronger priority first, then a factor of the
        # result before a contracting one (which only takes axes left over), then the larger source
        # tensor, then (elementwise ops only, as in Shardy) the more sharded factor, then the lhs.
        most_sharded = rule.elementwise

        def rank(f: int):
            axes, p, size, operand = merged[f]
            sharded = prod(r.size for r in axes) if most_sharded else 1
            return (p, rule.kinds[f].contracting, -size, -sharded, operand, f)

        for f in sorted(range(nf), key=rank):
            factor_axes[f] = _prefix_free(merged[f][0], taken)
            taken += factor_axes[f]
    else:
        # Shardy's basic propagation: a factor's axes stop at the first one that another factor already
        # holds on some tensor (at this priority or a stronger one), so a contested axis goes to neither.
        for p in sorted({m[1] for m in merged}):
            level = [f for f in range(nf) if merged[f][1] == p]
            held = {f: [r for g in range(nf) if g != f for e in entries[g] if e.priority <= p for r in e.axes]
                    for f in level}
            for f in level:
                factor_axes[f] = _prefix_free(merged[f][0], taken + held[f])
            for f in level:
                taken += factor_axes[f]

    for f, kind in enumerate(rule.kinds):  # what each kind accepts (a permutation: even shards only)
        factor_axes[f] = kind.limit(rule.sizes[f], factor_axes[f])
    wide = list(factor_axes)
    _make_representable(rule, factor_axes)
    result_axes = _result_only(rule, wide, factor_axes)

    def dims_of(dims, old: ShardingSpec | None, is_result: bool, factor_axes=factor_axes) -> list[DimSpec]:
        out = []
        for i, factors in enumerate(dims):
            axes = merge_adjacent([r for f in factors for r in factor_axes[f]])
            names = tuple(str(r) for r in axes)
            if is_result:
                prios = [merged[f][1] for f in factors if merged[f][1] != _NO_PRIORITY]
                out.append(DimSpec(names, True, min(prios, default=0)))
            elif old is None:
                out.append(DimSpec(names, True))
            else:
                out.append(DimSpec(names, old.dim_specs[i].is_open, old.dim_specs[i].priority))
        return out

    operands = tuple(ShardingSpec(mesh, dims_of(dims, spec, False)) for dims, spec in zip(rule.operands, specs))
    partial = merge_adjacent([r for f in range(nf) if rule.kinds[f].contracting for r in factor_axes[f]])
    result = ShardingSpec(mesh, dims_of(rule.result, None, True), partial_axes=[str(r) for r in partial])
    said = tuple(tuple(Opinion(e.operand, tuple(str(r) for r in e.axes), e.is_open, e.priority, e.size) for e in es)
                 for es in entries)
    if result_axes is None:
        return Decision(operands, result, tuple(factor_axes), None, said, strat)
    wider = ShardingSpec(mesh, dims_of(rule.result, None, True, result_axes), partial_axes=result.partial_axes)
    return Decision(operands, wider, tuple(factor_axes), result, said, strat)


def why(rule: Rule, dec: Decision, f: int) -> str:
    """Why factor ``f`` took the axes it did, in the order propagation resolved its conflicts (what ``nb.explain``
    prints; read from the decision, not derived again)."""
    names = factor_names(len(rule.sizes))
    got = tuple(str(r) for r in dec.factors[f])
    ops = dec.opinions[f]
    show = " vs ".join(f"operand {o.operand} [{','.join(o.axes)}]{'?' if o.is_open else ''}" for o in ops)
    wanted = [o.axes for o in ops if o.axes]
    longest = max(wanted, key=len, default=())
    if len(got) >= len(longest):
        return f"factor {names[f]} takes [{','.join(got)}], the longest list its operands agree on ({show})"
    if any(a[:len(b)] != b and b[:len(a)] != a for a in wanted for b in wanted):
        return (f"the operands shard factor {names[f]} differently ({show}): lists that are not prefixes of one "
                f"another propagate only their common prefix")
    lost = longest[len(got)]
    holders = [g for g in range(len(rule.sizes)) if g != f and lost in {str(r) for r in dec.factors[g]}]
    if holders:
        g = holders[0]
        pf = min((o.priority for o in ops if o.axes), default=0)
        pg = min((o.priority for o in dec.opinions[g] if lost in o.axes), default=0)
        size_f = max((o.size for o in ops if lost in o.axes), default=0)
        size_g = max((o.size for o in dec.opinions[g] if lost in o.axes), default=0)
        if pg < pf:
            reason = f"its annotation has the stronger priority (p{pg} < p{pf})"
        elif rule.kinds[f].contracting and not rule.kinds[g].contracting:
            reason = ("a factor of the result beats a contracting one, which only takes axes left over (Shardy's "
                      "fake conflict between contracting and non-contracting dims)")
        elif size_g != size_f:
            reason = f"it comes from the larger tensor ({size_g:,} elements vs {size_f:,})"
        else:
            reason = ("on a tie the more sharded factor, then the left operand, wins (an elementwise op)"
                      if rule.elementwise else
                      "on a tie the left operand's factor wins (not an elementwise op: how sharded does not count)")
        return f"axis {lost} went to factor {names[g]}, which also wants it: {reason}"
    if dec.strategy == BASIC:
        if any(not o.is_open and len(o.axes) < len(longest) for o in ops):
            return (f"strategy basic: a closed operand never gains an axis, so factor {names[f]} stays "
                    f"[{','.join(got)}] ({show})")
        return (f"strategy basic: axis {lost} is held by another factor on some tensor, so neither takes it "
                f"({show})")
    return (f"factor {names[f]} ({rule.kinds[f].name}) can only be sharded [{','.join(got)}] here: its kind or the "
            f"dims it shares with other factors limit it ({show})")


def _result_only(rule: Rule, wide: list, common: list) -> list | None:
    """Factor shardings the result's dims can hold though an operand's cannot (``wide`` before, ``common`` after
    making every tensor representable), as far as each extends the common one; None when nothing is gained."""
    if wide == common:
        return None
    mine = list(wide)
    _make_representable(rule, mine, tensors=[rule.result])
    out = list(common)
    for f in range(len(out)):
        if not rule.kinds[f].contracting and mine[f][:len(common[f])] == common[f] and len(mine[f]) > len(common[f]):
            out[f] = mine[f]
    if out == common:
        return None
    check = list(out)
    _make_representable(rule, check, tensors=[rule.result])
    return out if check == out else None


def _make_representable(rule: Rule, factor_axes: list[tuple[AxisRef, ...]], tensors: list | None = None) -> None:
    """Truncate factor shardings until every tensor dim can hold them: in a dim of several factors each
    sharded factor divides evenly, and a factor is sharded only if all factors before it are fully."""
    tensors = list(rule.operands) + [rule.result] if tensors is None else tensors
    changed = True
    while changed:
        changed = False
        for dims in tensors:
            for factors in dims:
                real = [f for f in factors if rule.sizes[f] > 1]
                if len(real) < 2:
                    continue
                full = True
                for f in real:
                    axes = factor_axes[f]
                    if not full and axes:
                        factor_axes[f] = ()
                        changed = True
                        continue
                    axes = divisible_prefix(axes, rule.sizes[f])
                    if axes != factor_axes[f]:
                        factor_axes[f] = axes
                        changed = True
                    full = prod(r.size for r in axes) == rule.sizes[f]


def keep_open(current: ShardingSpec, target: ShardingSpec) -> ShardingSpec:
    """``with_sharding``'s open dims, like JAX's ``P.UNCONSTRAINED``: an open target dim whose axes are a
    prefix of what the value already has there keeps the value's axes (as far as no other part of the target
    uses them), so nothing moves for that dim; other dims are taken as given."""
    if current is None or current.mesh != target.mesh or not any(d.is_open for d in target.dim_specs):
        return target
    mesh = target.mesh
    used = [r for refs in target.dim_refs for r in refs]
    used += [mesh.axis_ref(a) for a in target.replicated_axes + target.partial_axes]
    dims = list(target.dim_specs)
    for i, (d, want, have) in enumerate(zip(target.dim_specs, target.dim_refs, current.dim_refs)):
        if not d.is_open or have[:len(want)] != want:
            continue
        more = _prefix_free(have[len(want):], used)
        if more:
            dims[i] = DimSpec(tuple(str(r) for r in want + more), True, d.priority)
        used += list(more)
    if dims == list(target.dim_specs):
        return target
    return ShardingSpec(mesh, dims, target.replicated_axes, target.partial_axes)
