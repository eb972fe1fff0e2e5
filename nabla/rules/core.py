"""The rule data type and the einsum-like parser every template goes through."""

from __future__ import annotations

from math import prod
from typing import NamedTuple, Sequence

from ..errors import ShardingError

from ..factors import PASS, PERMUTE, REDUCE, REPLICATE, FactorKind  # noqa: F401 - the kinds rules use


class Rule(NamedTuple):
    """Factors (sizes, kinds) and, per operand and for the result, each dim's factors major to minor."""

    operands: tuple[tuple[tuple[int, ...], ...], ...]
    result: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    kinds: tuple[FactorKind, ...]

    @property
    def result_shape(self) -> tuple[int, ...]:
        return tuple(prod(self.sizes[f] for f in dim) for dim in self.result)

    @property
    def elementwise(self) -> bool:
        """Each result element reads the same element of every operand (numpy broadcasting aside): every factor
        passes through and each operand dim holds its trailing-aligned result dim's factor, or none. Shardy
        resolves conflicts between the factors of such ops (and of no others) by how sharded they are."""
        if any(k != PASS for k in self.kinds) or any(len(d) > 1 for d in self.result):
            return False
        rank = len(self.result)
        return all(len(dims) <= rank and all(not d or d == self.result[rank - len(dims) + i] for i, d in enumerate(dims))
                   for dims in self.operands)

    def __str__(self) -> str:
        names = factor_names(len(self.sizes))

        def t(dims):
            return "".join(names[d[0]] if len(d) == 1 else "(" + "".join(names[f] for f in d) + ")"
                           if d else "1" for d in dims)

        sig = ",".join(t(o) for o in self.operands) + "->" + t(self.result)
        extra = " ".join(f"{names[f]}={s}" for f, s in enumerate(self.sizes))
        rep = [names[f] for f, k in enumerate(self.kinds) if not k.shardable]
        return sig + " {" + extra + ("; replicate " + "".join(rep) if rep else "") + "}"


def factor_names(n: int) -> str:
    """The names a rule of ``n`` factors prints them with: one letter each (``ijk...``), ``f0, f1, ...`` past 52."""
    base = "ijklmnopqrstuvwxyzabcdefghIJKLMNOPQRSTUVWXYZABCDEFGH"
    if n > len(base):
        return [f"f{i}" for i in range(n)]  # type: ignore[return-value]
    return base


def parse(signature: str, shapes: Sequence[Sequence[int]], replicate: str = "",
          sizes: dict[str, int] | None = None, op: str = "rule") -> Rule:
    """Build a rule from ``"mk,kn->mn"``; ``(ij)`` groups factors into one dim, ``1`` is a dim with none.

    Factor sizes come from the operand shapes (or ``sizes`` for grouped factors); a factor absent from
    the result is a reduction unless listed in ``replicate``.
    """
    lhs, _, rhs = signature.replace(" ", "").partition("->")
    ins = lhs.split(",") if lhs else []
    if len(ins) != len(shapes):
        raise ShardingError(f"{op}: signature {signature!r} has {len(ins)} operands, got {len(shapes)} shapes")
    order: list[str] = []
    known = dict(sizes or {})

    def dims_of(term: str) -> list[list[str]]:
        out, i = [], 0
        while i < len(term):
            ch = term[i]
            if ch == "(":
                j = term.index(")", i)
                out.append(list(term[i + 1:j]))
                i = j + 1
            else:
                out.append([] if ch == "1" else [ch])
                i += 1
        return out

    operand_dims = [dims_of(t) for t in ins]
    result_dims = dims_of(rhs)
    for k, (dims, shape) in enumerate(zip(operand_dims, shapes)):
        if len(dims) != len(shape):
            raise ShardingError(f"{op}: operand {k} has shape {tuple(shape)} (rank {len(shape)}) but "
                                f"signature {signature!r} gives it {len(dims)} dims")
        for d, (fs, n) in enumerate(zip(dims, shape)):
            for f in fs:
                if f not in order:
                    order.append(f)
            if len(fs) == 1 and fs[0] not in known:
                known[fs[0]] = n
            if fs and prod(known.get(f, 0) for f in fs) != n:
                raise ShardingError(f"{op}: operand {k}, dim {d}: size {n} does not match factors "
                                    f"{''.join(fs)} of sizes {[known.get(f) for f in fs]}")
            if not fs and n != 1:
                raise ShardingError(f"{op}: operand {k}, dim {d}: size {n} where the signature has a size-1 dim")
    for fs in result_dims:
        for f in fs:
            if f not in order:
                order.append(f)
            if f not in known:
                raise ShardingError(f"{op}: result factor {f!r} has no size")
    index = {f: i for i, f in enumerate(order)}
    in_result = {f for fs in result_dims for f in fs}
    kinds = tuple(REPLICATE if f in replicate else PASS if f in in_result else REDUCE for f in order)
    return Rule(tuple(tuple(tuple(index[f] for f in fs) for fs in dims) for dims in operand_dims),
                tuple(tuple(index[f] for f in fs) for fs in result_dims),
                tuple(known[f] for f in order), kinds)


def build(operands: Sequence[Sequence[Sequence[int]]], result: Sequence[Sequence[int]],
          sizes: Sequence[int], kinds: Sequence[str]) -> Rule:
    """A rule from factor indices directly (templates whose factors are computed, e.g. reshape)."""
    return Rule(tuple(tuple(tuple(d) for d in o) for o in operands), tuple(tuple(d) for d in result),
                tuple(sizes), tuple(kinds))
