"""Gathers by integer indices and their transposes (take, take_along_axis, the scatter-adds of their gradients):
the indices' dims pass through; the gathered dim is a ``reduce`` factor of the table, so sharded it leaves partial
sums (each device looks up the rows it holds, zeros elsewhere: Megatron's vocabulary-parallel lookup)."""

from __future__ import annotations

from functools import lru_cache

from ..errors import ShardingError
from .core import PASS, REDUCE, Rule, build


class _Factors:
    """Factors appended one by one; a dim of size 1 gets none (as every rule does)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.kinds: list = []

    def new(self, n: int, kind=PASS) -> tuple[int, ...]:
        if n == 1:
            return ()
        self.sizes.append(n)
        self.kinds.append(kind)
        return (len(self.sizes) - 1,)


def _rows(op: str, rows: tuple[int, ...], n: int) -> None:
    if rows != (n,):
        raise ShardingError(f"{op}: operand 2 (the row numbers of the gathered dim) has shape {rows}, the gathered "
                            f"dim has {n} rows")


@lru_cache(maxsize=4096)
def take_rule(table: tuple[int, ...], ids: tuple[int, ...], rows: tuple[int, ...], axis: int) -> Rule:
    """``x[..., ids, ...]`` along ``axis``: ``(*pre, n, *post), I, (n,) -> (*pre, *I, *post)``; ``n`` is a reduce
    factor of the table (and of its row numbers), every other dim passes through."""
    n = table[axis]
    _rows("take", rows, n)
    f = _Factors()
    pre = [f.new(s) for s in table[:axis]]
    v = f.new(n, REDUCE)
    post = [f.new(s) for s in table[axis + 1:]]
    idx = [f.new(s) for s in ids]
    return build([pre + [v] + post, idx, [v]], pre + idx + post, f.sizes, f.kinds)


@lru_cache(maxsize=4096)
def scatter_rule(updates: tuple[int, ...], ids: tuple[int, ...], rows: tuple[int, ...], axis: int) -> Rule:
    """The transpose of ``take_rule``: ``(*pre, *I, *post), I, (n,) -> (*pre, n, *post)``; the indices' dims are
    summed (reduce factors), the rows come in the layout of the row numbers."""
    k = len(ids)
    if updates[axis:axis + k] != ids:
        raise ShardingError(f"scatter_add: updates of shape {updates} do not hold the indices' shape {ids} at dim "
                            f"{axis}")
    if len(rows) != 1:
        raise ShardingError(f"scatter_add: operand 2 (the row numbers) must be 1-D, got shape {rows}")
    n = rows[0]
    f = _Factors()
    pre = [f.new(s) for s in updates[:axis]]
    idx = [f.new(s, REDUCE) for s in ids]
    post = [f.new(s) for s in updates[axis + k:]]
    v = f.new(n)
    return build([pre + idx + post, idx, [v]], pre + [v] + post, f.sizes, f.kinds)


def _along(op: str, a: tuple[int, ...], ids: tuple[int, ...], axis: int) -> None:
    if len(a) != len(ids) or any(x != y for d, (x, y) in enumerate(zip(a, ids)) if d != axis):
        raise ShardingError(f"{op}: shapes {a} and {ids} must agree on every dim but dim {axis}")


@lru_cache(maxsize=4096)
def take_along_rule(arr: tuple[int, ...], ids: tuple[int, ...], rows: tuple[int, ...], axis: int) -> Rule:
    """``take_along_axis``: the dims other than ``axis`` are shared by the array, the indices and the result; along
    ``axis`` the array's ``n`` is a reduce factor and the indices' ``k`` passes through."""
    _along("take_along_axis", arr, ids, axis)
    n = arr[axis]
    _rows("take_along_axis", rows, n)
    f = _Factors()
    dims = [f.new(s) if d != axis else () for d, s in enumerate(arr)]
    v = f.new(n, REDUCE)
    k = f.new(ids[axis])
    a_dims, i_dims = list(dims), list(dims)
    a_dims[axis], i_dims[axis] = v, k
    return build([a_dims, i_dims, [v]], i_dims, f.sizes, f.kinds)


@lru_cache(maxsize=4096)
def scatter_along_rule(updates: tuple[int, ...], ids: tuple[int, ...], rows: tuple[int, ...], axis: int) -> Rule:
    """The transpose of ``take_along_rule``: the indices' ``k`` is summed, the rows come as the row numbers."""
    _along("scatter_add_along", updates, ids, axis)
    if updates[axis] != ids[axis]:
        raise ShardingError(f"scatter_add_along: updates {updates} and indices {ids} differ at dim {axis}")
    if len(rows) != 1:
        raise ShardingError(f"scatter_add_along: operand 2 (the row numbers) must be 1-D, got shape {rows}")
    n = rows[0]
    f = _Factors()
    dims = [f.new(s) if d != axis else () for d, s in enumerate(updates)]
    k = f.new(ids[axis], REDUCE)
    v = f.new(n)
    u_dims, o_dims = list(dims), list(dims)
    u_dims[axis], o_dims[axis] = k, v
    return build([u_dims, u_dims, [v]], o_dims, f.sizes, f.kinds)


@lru_cache(maxsize=4096)
def one_hot_rule(ids: tuple[int, ...], n: int, axis: int) -> Rule:
    """``one_hot``: the indices' dims pass through, the new dim of ``n`` classes is the result's own."""
    f = _Factors()
    idx = [f.new(s) for s in ids]
    out = list(idx)
    out.insert(axis, f.new(n))
    return build([idx], out, f.sizes, f.kinds)
