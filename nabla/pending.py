"""When a pending sum is made. A partial value (each device holds a summand) is not summed when it is made: its
sum is deferred until an op needs it, made once, and made at the cheaper of the places it can be made. This
module decides, per op, which pending sums survive it (``surviving_partials``), whether making them before a
contraction is cheaper than passing them to its result (``cheaper_to_sum_now``), which must be made before a
product that repeats them (``repeated_partials``), which sums an earlier use already made (``reused_sum``), and
what must hold at run time for a kept sum to stay exact (``survival_checks``, ``breaks_linearity``,
``overflowed``; an op that fails them is redone with ``STRICT`` set: every pending sum made first). The executor
asks; it carries out what is decided (plans, moves, steps)."""

from __future__ import annotations

import contextvars
from math import prod
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from . import backends, storage
from .dtypes import is_inexact
from .layout import chunks
from .mesh import AxisRef
from .opdef import OpDef
from .spec import ShardingSpec
from .value import Value, serial

if TYPE_CHECKING:
    from .program import Program

#: the last check of a program that keeps a pending sum of floats
KEEPS = (-1, "keeps", None)
#: set while a program is redone with its pending sums made first (per thread and task: a context variable)
STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("nabla_strict", default=False)

#: Ops that negate an operand: the devices that hold no summand of it hold +0.0 there, so that after the
#: negation they hold -0.0, the identity of the sum.
_NEGATED = {"subtract": (1,), "negative": (0,)}


def mask_zero(op: OpDef, i: int) -> Any:
    """What the add-once mask leaves on devices holding no summand of operand ``i`` (None: -0.0, IEEE's additive
    identity; 0 where ``op`` negates the operand: s - (+0) is s for every s, -0 included)."""
    return 0 if i in _NEGATED.get(op.name, ()) else None


def repeated_partials(args: Sequence[Any]) -> list:
    """The pending sums that are more than one factor of a product (``x * x``), each once: they are made first.
    The product is not linear in them, and keeping one factor's summands would only defer a second sum of the
    result."""
    partial = [a for a in args if isinstance(a, Value) and a._spec is not None and a._spec.partial_axes]
    if len(partial) < 2:  # the common case: at most one pending factor
        return []
    return list({id(a): a for a in partial if sum(b is a for b in partial) > 1}.values())


def reused_sum(a: Any) -> Any:
    """A partial value that an earlier use already summed is used summed: it is the same value (the same
    serial), and its sum has been paid for (tensors are immutable)."""
    if isinstance(a, Value) and a._moved and a._spec.partial_axes:
        for spec, data in a._moved.items():
            if not spec.partial_axes:
                return Value(data, spec, a._shape, a._dtype, serial=serial(a))
    return a


def surviving_partials(op: OpDef, sigs: tuple, shapes, dtype: np.dtype) -> tuple[set[str], list[set[str]]]:
    """Which partial axes stay partial through ``op`` (all of them, and per operand), as atoms (sub-axes cut
    where any operand's partial axes start or end, so that ``y`` and ``y:(1)2`` meet as ``y:(1)2, y:(2)2``); the
    rest are summed while the operands are resharded. Design decision 4: linear uses keep the sum pending,
    unless another operand's dims use the axis (then one reduce_scatter beats gathering that operand); an
    addition keeps every operand's axes (an operand partial over fewer is added once over the others, no
    communication); a product keeps each atom on one operand (the largest), as a product of two sums needs one
    of them summed. A sum is kept only in the result's dtype (an int8 sum wraps, a float16 one rounds and
    overflows in float16, as numpy's would). What a pending sum does not promise is the sign of an exact zero:
    -(x + -x) is -0.0, the sum of the negated summands +0.0 (and likewise for a negative or zero factor)."""
    n = len(sigs)
    linear_args = range(n) if op.linear_args is None else op.linear_args
    refs = [list(s[3].partial_refs) if s[0] == "s" and i in linear_args else [] for i, s in enumerate(sigs)]
    in_dims = [[r for rs in s[3].dim_refs for r in rs] if s[0] == "s" else [] for s in sigs]
    if op.linear is None:
        refs = [[] for _ in sigs]
    flt = is_inexact(dtype)
    elementwise_mul = op.linear == "mul" and op.fast is not None
    for i, s in enumerate(sigs):
        if refs[i] and s[2] != dtype:
            refs[i] = []
        refs[i] = [r for r in refs[i] if not any(r.overlaps(b) for j in range(n) if j != i for b in in_dims[j])]
    order = sorted(range(n), key=lambda i: -prod(shapes[i]))
    if elementwise_mul and flt:
        # one operand keeps its sums; the others' values are checked at run time (finite factors, nonzero
        # divisors), and a non-finite result is redone with the sums made first
        first = next((i for i in order if refs[i]), None)
        refs = [r if i == first else [] for i, r in enumerate(refs)]
    # Cut every kept axis where any operand's kept axes start or end; where the cuts do not nest (x:(1)2 and
    # x:(1)3 on x=6) only the largest operand's pieces of that axis are kept.
    cuts: dict[str, set[int]] = {}
    for i in order:
        for r in refs[i]:
            pts = cuts.setdefault(r.name, set())
            new = sorted(pts | {r.pre, r.pre * r.size})
            if any(b % a for a, b in zip(new, new[1:])):
                refs[i] = [q for q in refs[i] if q.name != r.name]
                break
            pts.update((r.pre, r.pre * r.size))
    atoms = [set() for _ in range(n)]
    for i in range(n):
        for r in refs[i]:
            pts = sorted(p for p in cuts[r.name] if r.pre <= p <= r.pre * r.size)
            atoms[i] |= {str(AxisRef(r.name, a, b // a, r.full)) for a, b in zip(pts, pts[1:])}
    keep: set[str] = set().union(*atoms) if atoms else set()
    keep_by = atoms
    if op.linear == "mul":
        owner: dict[str, int] = {}
        for i in order:
            for a in sorted(atoms[i]):
                owner.setdefault(a, i)
        keep_by = [{a for a in atoms[i] if owner[a] == i} for i in range(n)]
    return keep, keep_by


class Survival(NamedTuple):
    """The policy's one answer for a program: the partial axes that stay pending through the op (``keep``; per
    operand, ``keep_by``), per operand the axes it is added once over and what its mask leaves elsewhere, and
    what must hold at run time for the kept sums to survive (``checks``)."""

    keep: frozenset
    keep_by: tuple
    add_once: tuple  # per operand: the axes an addend partial over fewer is added once over
    zeros: tuple  # per operand: ``mask_zero``
    checks: tuple


def survival(op: OpDef, sigs: tuple, shapes, dtype: np.dtype, strict: bool | str = False) -> Survival:
    """What happens to the operands' pending sums through ``op`` (``strict``: none survives), decided once per
    program (the executor asks for nothing else before it plans, except ``cheaper_to_sum_now`` once the result's
    layout is known)."""
    keep, keep_by = surviving_partials(op, sigs, shapes, dtype) if not strict else (set(), [set() for _ in sigs])
    linear = range(len(sigs)) if op.linear_args is None else op.linear_args
    add_once = tuple(tuple(sorted(keep - keep_by[i])) if op.linear == "add" and i in linear else ()
                     for i in range(len(sigs)))
    checks = survival_checks(op, sigs, keep_by, dtype) if keep else ()
    return Survival(frozenset(keep), tuple(keep_by), add_once, tuple(mask_zero(op, i) for i in range(len(sigs))),
                    checks)


def cheaper_to_sum_now(mesh, sigs: tuple, shapes: tuple, keep_by: list, result: ShardingSpec,
                       result_shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether a contraction should make its operands' pending sums now rather than pass them to its result:
    kept, they are paid later on the result, at least a reduce_scatter of its block; made now, an all_reduce
    of each operand's block. (The gradient of an embedding table: summing the small incoming gradient beats
    summing the table-sized product; Megatron's activations keep theirs.)"""
    def ring(k: int, nbytes: int, factor: int) -> float:
        return factor * (k - 1) / k * nbytes

    kept = set().union(*keep_by)
    k_keep = prod(mesh.axis_ref(a).size for a in kept)
    later = ring(k_keep, prod(chunks(result, result_shape)) * dtype.itemsize, 1)
    now = sum(ring(prod(mesh.axis_ref(a).size for a in atoms), prod(chunks(s[3], shp)) * s[2].itemsize, 2)
              for s, shp, atoms in zip(sigs, shapes, keep_by) if atoms)
    return later > now


def survival_checks(op: OpDef, sigs: tuple, keep_by: list, dtype: np.dtype) -> tuple:
    """What must hold at run time for the pending sums ``keep_by`` keeps to survive ``op`` (see
    ``breaks_linearity``), plus ``KEEPS`` for floats (a non-finite result is redone strictly)."""
    if not is_inexact(dtype):
        return ()  # integers wrap and bools or, as numpy's sums do: every product distributes
    checks = []
    if op.linear == "mul":
        for j, s in enumerate(sigs):
            if not keep_by[j]:
                checks.append((j, "divisor" if op.linear_args == (0,) else "finite", dtype))
    return tuple(checks) + (KEEPS,)


def breaks_linearity(checks: tuple, args: Sequence[Any]) -> bool:
    """Whether scaling a pending sum summand by summand would not give the scaled sum. The factor is taken as
    cast to the result's dtype (``1e300`` is inf in float32): an infinite factor meets the zeros other devices
    hold (0 * inf); a factor <= 0 (or -0.0) flips the sign of an exact zero sum (-(+0) is -0, but the negated
    summands add to +0); a divisor must be positive with a finite reciprocal; ``a - sum`` needs an ``a`` with
    no -0.0. ``KEEPS`` marks a program that keeps a pending sum: it breaks when a retry asks for the strict
    program (the executor's ``_rerun_strict``)."""
    for check in checks:
        if check is KEEPS:
            continue
        j, kind, dtype = check
        a = args[j]
        data = a._data if isinstance(a, Value) else a
        if data is None:
            continue
        xp = backends.xp(data)
        with np.errstate(all="ignore"):
            c = xp.asarray(data).astype(dtype)
            ok = xp.isfinite(c)
            if kind == "divisor":
                ok = ok & (c != 0) & xp.isfinite(dtype.type(1) / c)
        if not bool(xp.all(ok)):
            return True
    return False


def overflowed(data: Any, prog: Program) -> bool:
    """Whether a result that keeps a pending sum holds a non-finite summand (ignoring padding): then the sum
    of the summands may differ from the op on the sum (finite summands that overflow, inf - inf)."""
    if data is None:
        return False
    xp = backends.xp(data)
    if prog.padded:
        for d in range(len(prog.result_shape)):
            data = storage.fill(data, storage.pad_regions(prog.result, prog.result_shape, d), 0)
    return not bool(xp.all(xp.isfinite(data)))
