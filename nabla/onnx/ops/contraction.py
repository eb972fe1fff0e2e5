"""Contractions: ``MatMul``, ``Gemm`` and ``Einsum`` (the ONNX sharding formalism's matmul-like group, where a
sharded contracted dim leaves partial sums), with the diagonals a repeated ``Einsum`` letter takes."""

from __future__ import annotations

import numpy as np

import nabla as nb

from ...tensor import Tensor
from .registry import Node, _c, _cast, op


@op("MatMul")
def _matmul(n, a, b):
    return nb.matmul(a, b)


@op("Gemm")
def _gemm(n, a, b, c=None):
    if n.attr("transA", 0):
        a = nb.transpose(a)
    if n.attr("transB", 0):
        b = nb.transpose(b)
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    y = nb.matmul(a, b)
    if alpha != 1.0:
        y = y * _c(y, alpha)
    if c is not None and beta != 0.0:
        y = y + (c if beta == 1.0 else c * _c(c, beta))
    return _cast(y, a.dtype)


@op("Einsum")
def _einsum(n, *xs):
    eq = n.attr("equation").replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(xs):
        raise n.fail(f"equation {eq!r} names {len(terms)} operands, got {len(xs)}")
    if not arrow:  # numpy's implicit output, decided before diagonals are taken
        letters = lhs.replace(".", "").replace(",", "")
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    ops_, new_terms = [], []
    for t, x in zip(terms, xs):
        x, t = _diagonals(n, x, t)
        ops_.append(x)
        new_terms.append(t)
    return nb.einsum(",".join(new_terms) + "->" + rhs, *ops_)


def _diagonals(n: Node, x: Tensor, term: str) -> tuple[Tensor, str]:
    """A letter repeated within one operand takes its diagonal: keep where the two indices agree, sum
    out the second (exact: the other terms are zeros chosen by ``where``, not products)."""
    while True:
        ell = x.ndim - (len(term) - 3) if "..." in term else 0
        dims = term.replace("...", "." * ell)
        rep = next((c for c in dims if c != "." and dims.count(c) > 1), None)
        if rep is None:
            return x, term
        i = dims.index(rep)
        j = dims.index(rep, i + 1)
        k, dt = x.shape[i], x.dtype
        shape = [1] * x.ndim
        shape[i], shape[j] = k, k
        eye = np.eye(k, dtype=bool).reshape(shape)
        x = nb.sum(nb.where(eye, x, _c(x, 0)), j)
        x = _cast(x, dt)
        dims = dims[:j] + dims[j + 1:]
        term = dims.replace("." * ell, "...", 1) if ell else dims
