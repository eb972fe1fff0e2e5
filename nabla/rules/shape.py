"""Ops that move elements without arithmetic: transpose, reshape, concatenate, slicing, squeeze, expand_dims."""

from __future__ import annotations

from functools import lru_cache
from typing import Any
from math import gcd, prod

from ..errors import ShardingError
from ..factors import Window, WindowSpec
from .core import PASS, PERMUTE, REPLICATE, Rule, build


@lru_cache(maxsize=4096)
def transpose_rule(shape: tuple[int, ...], perm: tuple[int, ...]) -> Rule:
    operand = [(d,) if n != 1 else () for d, n in enumerate(shape)]
    return build([operand], [operand[p] for p in perm], shape, [PASS] * len(shape))


@lru_cache(maxsize=4096)
def reshape_rule(shape: tuple[int, ...], target: tuple[int, ...]) -> Rule:
    """Split and merge dims into common factors: (8,4)->(2,16) is ``(ij)k->i(jk)``.

    Where a run of dims cannot be cut into common factors (coprime sizes, e.g. (6,4)->(4,6)), each dim
    in that run gets a factor of its own that needs replication.
    """
    if prod(shape) != prod(target):
        raise ShardingError(f"reshape: cannot reshape size {prod(shape)} {shape} into size {prod(target)} {target}")
    sizes: list[int] = []
    kinds: list = []
    ins: list[list[int]] = [[] for _ in shape]
    outs: list[list[int]] = [[] for _ in target]

    def new(size: int, kind=PASS) -> int:
        sizes.append(size)
        kinds.append(kind)
        return len(sizes) - 1

    if prod(shape) == 0:
        for d, n in enumerate(shape):
            ins[d] = [new(n, REPLICATE)] if n != 1 else []
        for d, n in enumerate(target):
            outs[d] = [new(n, REPLICATE)] if n != 1 else []
        return build([ins], outs, sizes, kinds)
    # Segments: runs of input and output dims whose products agree.
    i = j = 0
    while i < len(shape) or j < len(target):
        seg_in, seg_out = [], []
        p_in = p_out = 1
        while True:
            while i < len(shape) and shape[i] == 1:
                i += 1
            while j < len(target) and target[j] == 1:
                j += 1
            if p_in == p_out and (seg_in or seg_out or (i >= len(shape) and j >= len(target))):
                break
            if p_in <= p_out and i < len(shape):
                seg_in.append(i)
                p_in *= shape[i]
                i += 1
            elif j < len(target):
                seg_out.append(j)
                p_out *= target[j]
                j += 1
            else:
                break
        if not seg_in and not seg_out:
            break
        _factor_segment(seg_in, seg_out, shape, target, ins, outs, new)
    return build([ins], outs, sizes, kinds)


def _factor_segment(seg_in, seg_out, shape, target, ins, outs, new) -> None:
    """Cut one segment into common factors: gcd steps from the major end, then from the minor end, until a
    step finds nothing in common; what is left in the middle of each dim needs replication. (6,4)->(4,6) is
    ``(i m)(n o) -> (i x)(y)`` with i = 2 shared; (3,4,4)->(2,3,8) shares m and n at the minor end."""
    rem_in = {d: shape[d] for d in seg_in}
    rem_out = {d: target[d] for d in seg_out}
    major = {("i", d): [] for d in seg_in} | {("o", d): [] for d in seg_out}
    minor = {k: [] for k in major}
    ia = ib = 0
    while ia < len(seg_in) and ib < len(seg_out):
        da, db = seg_in[ia], seg_out[ib]
        g = gcd(rem_in[da], rem_out[db])
        if g == 1:
            break
        f = new(g)
        major[("i", da)].append(f)
        major[("o", db)].append(f)
        rem_in[da] //= g
        rem_out[db] //= g
        ia += rem_in[da] == 1
        ib += rem_out[db] == 1
    ja, jb = len(seg_in) - 1, len(seg_out) - 1
    while ja >= ia and jb >= ib:
        da, db = seg_in[ja], seg_out[jb]
        g = gcd(rem_in[da], rem_out[db])
        if g == 1:
            break
        f = new(g)
        minor[("i", da)].insert(0, f)
        minor[("o", db)].insert(0, f)
        rem_in[da] //= g
        rem_out[db] //= g
        ja -= rem_in[da] == 1
        jb -= rem_out[db] == 1
    for d in seg_in:
        ins[d] = major[("i", d)] + ([new(rem_in[d], REPLICATE)] if rem_in[d] > 1 else []) + minor[("i", d)]
    for d in seg_out:
        outs[d] = major[("o", d)] + ([new(rem_out[d], REPLICATE)] if rem_out[d] > 1 else []) + minor[("o", d)]


@lru_cache(maxsize=4096)
def concatenate_rule(shapes: tuple[tuple[int, ...], ...], axis: int) -> Rule:
    """Dims other than ``axis`` share factors; the joined dim is one window factor: result row ``r`` reads row
    ``r - offset`` of the operand placed at ``offset`` (rows outside it are padding), so a sharded joined dim
    stays sharded and each device receives only the rows it lacks."""
    rank = len(shapes[0])
    for k, s in enumerate(shapes):
        if len(s) != rank:
            raise ShardingError(f"concatenate: operand {k} has rank {len(s)}, operand 0 has rank {rank}")
        for d in range(rank):
            if d != axis and s[d] != shapes[0][d]:
                raise ShardingError(f"concatenate: operand {k}, dim {d}: size {s[d]} but operand 0 has {shapes[0][d]}")
    total = sum(s[axis] for s in shapes)
    offsets = [sum(s[axis] for s in shapes[:k]) for k in range(len(shapes))]
    sizes = list(shapes[0])
    sizes[axis] = total
    kinds = [PASS] * rank
    kinds[axis] = Window(total, tuple(WindowSpec(s[axis], pad_lo=off) for s, off in zip(shapes, offsets)))
    operands = []
    for s in shapes:
        dims = [(d,) if s[d] != 1 else () for d in range(rank)]
        dims[axis] = (axis,)
        operands.append(dims)
    result = [(d,) if shapes[0][d] != 1 else () for d in range(rank)]
    result[axis] = (axis,)
    return build(operands, result, sizes, kinds)


@lru_cache(maxsize=4096)
def index_rule(shape: tuple[int, ...], key: tuple[tuple, ...]) -> Rule:
    """Basic indexing, ``key`` normalised to entries ``("full",)``, ``("reverse",)``, ``("slice", start,
    stop, step)``, ``("int", i)`` and ``("new",)``: whole dims pass through, a reversed dim is a permutation
    factor (block ``p`` comes from block ``k-1-p``), a forward slice is a window factor (each device receives
    only the rows of its result block it lacks), other cuts need replication."""
    sizes: list[int] = []
    kinds: list = []
    operand: list[tuple[int, ...]] = []
    result: list[tuple[int, ...]] = []
    windows: list[tuple] = []
    d = 0
    for entry in key:
        if entry[0] == "new":
            result.append(())
            continue
        if entry[0] == "empty":  # a new axis of size 0 (numpy's x[False])
            sizes.append(0)
            kinds.append(PASS)
            result.append((len(sizes) - 1,))
            continue
        n = shape[d]
        d += 1
        if entry[0] in ("full", "reverse"):
            sizes.append(n)
            kinds.append(PASS if entry[0] == "full" else PERMUTE)
            f = (len(sizes) - 1,) if n != 1 else ()
            operand.append(f)
            result.append(f)
            continue
        if entry[0] == "slice" and entry[3] > 0:
            start, stop, step = entry[1:]
            m = len(range(start, stop, step))
            sizes.append(m)
            win = WindowSpec(n, 1, step, 1, -start)
            # (the halo of a later sliced dim is sized on this one's window, as the executor cuts it first)
            kinds.append(Window(m, (win,), 0.0, (tuple(windows),)))
            windows.append((d - 1, m, win))
            operand.append((len(sizes) - 1,))
            result.append((len(sizes) - 1,))
            continue
        sizes.append(n)
        kinds.append(REPLICATE)
        operand.append((len(sizes) - 1,) if n != 1 else ())
        if entry[0] == "slice":
            m = len(range(*entry[1:]))
            sizes.append(m)
            kinds.append(PASS)
            result.append((len(sizes) - 1,) if m != 1 else ())
    return build([operand], result, sizes, kinds)


@lru_cache(maxsize=4096)
def squeeze_rule(shape: tuple[int, ...], axes: tuple[int, ...]) -> Rule:
    operand = [(d,) if n != 1 else () for d, n in enumerate(shape)]
    return build([operand], [operand[d] for d in range(len(shape)) if d not in axes], shape, [PASS] * len(shape))


@lru_cache(maxsize=4096)
def expand_dims_rule(shape: tuple[int, ...], axes: tuple[int, ...]) -> Rule:
    operand = [(d,) if n != 1 else () for d, n in enumerate(shape)]
    it = iter(operand)
    result = [() if d in axes else next(it) for d in range(len(shape) + len(axes))]
    return build([operand], result, shape, [PASS] * len(shape))


@lru_cache(maxsize=4096)
def pad_rule(shape: tuple[int, ...], widths: tuple[tuple[int, int], ...], fill: Any) -> Rule:
    """``pad``: a padded dim is a window factor (result row ``r`` reads operand row ``r - before``; rows outside
    the operand are ``fill``), so it keeps its sharding and each device receives only the rows its result block
    lacks; other dims pass through."""
    sizes, kinds, dims, wins, outs = [], [], [], [], []
    for d, (n, (lo, hi)) in enumerate(zip(shape, widths)):
        if lo < 0 or hi < 0:
            raise ShardingError(f"pad: dim {d}: pad widths must be >= 0, got ({lo}, {hi})")
        if not lo and not hi:
            sizes.append(n)
            kinds.append(PASS)
            dims.append((d,) if n != 1 else ())
            continue
        win = WindowSpec(n, pad_lo=lo)
        kinds.append(Window(n + lo + hi, (win,), fill, (tuple(wins),)))
        wins.append((d, n + lo + hi, win))
        sizes.append(n + lo + hi)
        dims.append((d,))
    return build([dims], dims, sizes, kinds)


@lru_cache(maxsize=4096)
def roll_rule(shape: tuple[int, ...], axis: int, shift: int) -> Rule:
    """``roll`` by ``shift`` (0 < shift < n) along ``axis``, with the operand given twice: result row ``r`` reads
    row ``r - shift`` of the first (rows ``r >= shift``) and row ``r - shift + n`` of the second (rows below), two
    windows of one factor, so the dim keeps its sharding and each device receives only the rows that change
    owner (a collective_permute of them)."""
    n = shape[axis]
    kinds = [PASS] * len(shape)
    kinds[axis] = Window(n, (WindowSpec(n, pad_lo=shift), WindowSpec(n, pad_lo=shift - n)))
    dims = [(d,) if m != 1 or d == axis else () for d, m in enumerate(shape)]
    return build([dims, dims], dims, shape, kinds)
