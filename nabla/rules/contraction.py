"""Contractions: batched matmul (broadcasting batch dims) and einsum from its subscripts."""

from __future__ import annotations

from functools import lru_cache

from ..errors import ShardingError
from .core import PASS, REDUCE, Rule, build
from .elementwise import broadcast_shapes


@lru_cache(maxsize=4096)
def matmul_rule(a: tuple[int, ...], b: tuple[int, ...]) -> Rule:
    """``...mk,...kn->...mn`` for operands of rank >= 2 (1-D operands are lifted by the op)."""
    if len(a) < 2 or len(b) < 2:
        raise ShardingError(f"matmul: rule needs rank >= 2 operands, got shapes {a} and {b}")
    if a[-1] != b[-2]:
        raise ShardingError(f"matmul: contracted dims differ: operand 0 dim {len(a) - 1} has size {a[-1]}, "
                            f"operand 1 dim {len(b) - 2} has size {b[-2]}")
    try:
        batch = broadcast_shapes((a[:-2], b[:-2]), "matmul")
    except ShardingError as e:
        raise ShardingError(f"matmul of shapes {a} and {b}: the batch dims (all but the last two) "
                            f"{a[:-2]} and {b[:-2]} do not broadcast ({str(e).split(': ')[-1]})") from None
    nb = len(batch)
    m, k, n = nb, nb + 1, nb + 2

    def batch_dims(s):
        off = nb - len(s)
        return [(off + d,) if x == batch[off + d] and x != 1 else () for d, x in enumerate(s)]

    operands = [batch_dims(a[:-2]) + [(m,), (k,)], batch_dims(b[:-2]) + [(k,), (n,)]]
    result = [(d,) if batch[d] != 1 else () for d in range(nb)] + [(m,), (n,)]
    sizes = list(batch) + [a[-2], a[-1], b[-1]]
    return build(operands, result, sizes, [PASS] * nb + [PASS, REDUCE, PASS])


@lru_cache(maxsize=4096)
def einsum_rule(subscripts: str, shapes: tuple[tuple[int, ...], ...]) -> Rule:
    spec = subscripts.replace(" ", "")
    lhs, arrow, rhs = spec.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ShardingError(f"einsum: {subscripts!r} names {len(terms)} operands, got {len(shapes)}")
    letters = [c for c in lhs if c.isalpha()]
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in letters]
    ell_rank = max((len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t), default=0)
    ell = "".join(spare[:ell_rank])
    expanded = []
    for k, (t, s) in enumerate(zip(terms, shapes)):
        if "..." in t:
            r = len(s) - (len(t) - 3)
            if r < 0:
                raise ShardingError(f"einsum: operand {k} has rank {len(s)}, too small for {t!r}")
            t = t.replace("...", ell[ell_rank - r:])
        if len(t) != len(s):
            raise ShardingError(f"einsum: operand {k} term {t!r} has {len(t)} dims but shape {s}")
        if len(set(t)) != len(t):
            raise ShardingError(f"einsum: operand {k} term {t!r} repeats a letter (diagonals are not supported)")
        expanded.append(t)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        counts = {c: letters.count(c) for c in letters}
        out = ell + "".join(sorted(c for c in counts if counts[c] == 1))
    sizes: dict[str, int] = {}
    for k, (t, s) in enumerate(zip(expanded, shapes)):
        for d, (c, n) in enumerate(zip(t, s)):
            if n == 1 and c in ell:
                continue  # broadcast dim from the ellipsis
            if sizes.setdefault(c, n) != n:
                raise ShardingError(f"einsum: operand {k}, dim {d}: letter {c!r} has size {n} but {sizes[c]} elsewhere")
    for c in ell:
        sizes.setdefault(c, 1)
    order = list(dict.fromkeys("".join(expanded) + out))
    for c in out:
        if c not in sizes:
            raise ShardingError(f"einsum: output letter {c!r} is in no operand of {subscripts!r}")
    idx = {c: i for i, c in enumerate(order)}

    def dims(t, s):
        return [(idx[c],) if sizes[c] == n and n != 1 else () for c, n in zip(t, s)]

    operands = [dims(t, s) for t, s in zip(expanded, shapes)]
    result = [(idx[c],) if sizes[c] != 1 else () for c in out]
    kinds = [PASS if c in out else REDUCE for c in order]
    return build(operands, result, [sizes[c] for c in order], kinds)
