"""Contractions (matmul, einsum): a contracted letter sharded on the operands leaves partial sums; batch and
free letters keep their sharding."""

from __future__ import annotations

import builtins
from math import prod

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..dtypes import is_float
from ..errors import ShardingError
from ..args import short_repr
from ..opdef import OpDef
from .core import ArrayLike, Tensor, apply, _is_diff, _named, _ndim, _shape
from .registry import _unbroadcast, onnx_export, register
from .shape import broadcast_to, expand_dims, reshape, squeeze, swapaxes


# ---- matmul ----------------------------------------------------------------------------------------------------


def _matmul_kernel(arrays, local):
    a, b = arrays
    G = local.G
    rank = G + len(local.out_chunk)
    batch = rank - G - 2
    # give both operands the result's batch rank so grid axes line up
    if a.ndim != rank:
        a = a.reshape(a.shape[:G] + (1,) * (batch - (a.ndim - G - 2)) + a.shape[G:])
    if b.ndim != rank:
        b = b.reshape(b.shape[:G] + (1,) * (batch - (b.ndim - G - 2)) + b.shape[G:])
    xp = np if type(a) is np.ndarray and type(b) is np.ndarray else _xp(a, b)
    if xp is np and rank > 2 and b.shape[:-2] == (1,) * (rank - 2) and a.size and \
            a.shape[-2] < a.size // a.shape[-1] and a.flags.c_contiguous:
        # one matrix for every device and batch entry (a Gemm's weight): one GEMM over all rows of ``a``, where
        # numpy's batched matmul reads the whole weight again for each batch entry
        out = np.matmul(*_wide(a.reshape(-1, a.shape[-1]), b.reshape(b.shape[-2:])))
        return out.reshape(a.shape[:-1] + out.shape[-1:])
    if xp is np and a.dtype.kind != "V" and b.dtype.kind != "V":  # (the usual case: no operand to widen)
        return np.matmul(a, b)
    return xp.matmul(*_wide(a, b))


def _wide(*arrays):
    """bfloat16 and float8 operands (numpy has no loops for them) in float32: the result is rounded back to the
    operands' dtype, as XLA accumulates them (JAX's matmul of two bfloat16 arrays is bfloat16)."""
    for a in arrays:  # the usual case, cheaply: those dtypes are all of kind V (numpy's own floats are f)
        if getattr(getattr(a, "dtype", None), "kind", "V") == "V":
            break
    else:
        return arrays
    if any(is_float(a.dtype) and a.dtype.kind == "V" or a.dtype.itemsize == 1 and is_float(a.dtype)
           for a in arrays if hasattr(a, "dtype")) and all(isinstance(a, np.ndarray) for a in arrays):
        return tuple(a.astype(np.float32) if is_float(a.dtype) and a.dtype.itemsize < 4 and a.dtype != np.float16
                     else a for a in arrays)
    return arrays


#: letters for a weight gradient's batch dims (every other letter than m, k and n: rank 32 at most, MAX_RANK)
_LEAD = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijlopqrstuvwxyz"


def _matmul_vjp(g, node, out):
    a, b = node.args
    ga = _unbroadcast(matmul(g, swapaxes(b, -1, -2)), a) if _is_diff(a) else None
    if not _is_diff(b):
        gb = None
    elif _ndim(b) == 2 and _ndim(a) >= 2:
        # a weight's gradient contracts the kept operand as it is (no transposed copy of it: the layout its
        # forward use gathered it to, kept on it, serves again) and sums the batch dims in the same contraction
        lead = _LEAD[:_ndim(a) - 2]
        gb = einsum(f"{lead}mk,{lead}mn->kn", a, g)
    else:
        gb = _unbroadcast(matmul(swapaxes(a, -1, -2), g), b)
    return ga, gb


@onnx_export("MatMul")
def _matmul_onnx(ex):
    return ex.one("MatMul")


@_named
def matmul(a: ArrayLike, b: ArrayLike) -> Tensor:
    """numpy's matmul; 1-D operands are lifted to matrices and the added dim removed, as numpy does."""
    ra, rb = _ndim(a), _ndim(b)
    if ra == 0 or rb == 0:
        raise ShardingError(f"matmul: operands must have at least 1 dim, got ranks {ra} and {rb}")
    if ra == 1 or rb == 1:  # (said of the operands as given: lifted, a vector's dim would be misnamed)
        sa, sb = _shape(a), _shape(b)
        db = 0 if rb == 1 else rb - 2
        if sa[-1] != sb[db]:
            raise ShardingError(f"matmul: contracted dims differ: operand 0 (shape {sa}) dim {ra - 1} has size "
                                f"{sa[-1]}, operand 1 (shape {sb}) dim {db} has size {sb[db]}")
    a2 = expand_dims(a, 0) if ra == 1 else a
    b2 = expand_dims(b, 1) if rb == 1 else b
    out = apply(_MATMUL, (a2, b2))
    if ra == 1:
        out = squeeze(out, out.ndim - 2)
    if rb == 1:
        out = squeeze(out, out.ndim - 1)
    return out


def _matmul_flops(blocks, out, params) -> int:
    """A multiply and an add per result element and contracted element: 2mnk (of this device's blocks)."""
    return 2 * prod(out) * blocks[0][-1]


_MATMUL = register(OpDef("matmul", lambda shapes: R.matmul_rule(*shapes), _matmul_kernel, "mul", vjp=_matmul_vjp,
                          saves="cross",
                         dtype=lambda a, b: np.result_type(a, b),
                         numpy="matmul", onnx=_matmul_onnx, arity=2, public=matmul, flops=_matmul_flops))


# ---- einsum ----------------------------------------------------------------------------------------------------


def _einsum_kernel(arrays, local):
    """Carry the grid axes through as extra leading letters, so one einsum serves every device."""
    subscripts = local.params[0].replace(" ", "")
    G = local.G
    lhs, arrow, rhs = subscripts.partition("->")
    terms = lhs.split(",")
    if not arrow:  # numpy's implicit output: ellipsis dims, then the letters used once, sorted
        letters = lhs.replace(".", "").replace(",", "")
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in subscripts]
    g = "".join(free[:G])
    xp = _xp(*arrays)
    if len(arrays) == 2:
        out = _as_matmul(xp, g + terms[0], g + terms[1], g + rhs, *_wide(*arrays))
        if out is not None:
            return out
    grid = np.broadcast_shapes(*(a.shape[:G] for a in arrays))
    arrays = [xp.broadcast_to(a, grid + a.shape[G:]) for a in arrays]
    return xp.einsum(",".join(g + t for t in terms) + "->" + g + rhs, *_wide(*arrays))


def _matrices(x, t: str, batch: list, rows: list, cols: list, size: dict, r: int, c: int):
    """``x`` (letters ``t``) as a stack of ``(r, c)`` matrices over ``batch``: a view where its letters already come
    in that order, or in the order with rows and columns swapped (a transposed view: BLAS reads it as it is);
    else a transposed copy."""
    lead = [size[ch] for ch in batch]
    if list(t) == batch + rows + cols:
        return x.reshape(lead + [r, c])
    if list(t) == batch + cols + rows:
        return x.reshape(lead + [c, r]).swapaxes(-1, -2)
    return x.transpose([t.index(ch) for ch in batch + rows + cols]).reshape(lead + [r, c])


def _as_matmul(xp, ta: str, tb: str, to: str, a, b):
    """A two-operand einsum as one batched matmul (BLAS; numpy's einsum loops in C without it): batch letters (in
    both and the result, grid axes included) stay dims that broadcast, each operand's free letters and the
    contracted ones are merged locally, on the block. None where the letters do not fit that form."""
    if len(set(ta)) != len(ta) or len(set(tb)) != len(tb) or len(set(to)) != len(to) or "." in ta + tb + to:
        return None
    batch = [c for c in to if c in ta and c in tb]
    contract = [c for c in ta if c in tb and c not in to]
    fa = [c for c in ta if c not in tb]
    fb = [c for c in tb if c not in ta]
    if any(c not in to for c in fa + fb) or set(to) != set(batch + fa + fb):
        return None
    sa, sb = dict(zip(ta, a.shape)), dict(zip(tb, b.shape))
    if any(sa[c] != sb[c] for c in contract):
        return None
    m, k, n = prod(sa[c] for c in fa), prod(sa[c] for c in contract), prod(sb[c] for c in fb)
    a = _matrices(a, ta, batch, fa, contract, sa, m, k)
    b = _matrices(b, tb, batch, contract, fb, sb, k, n)
    c = xp.matmul(a, b)
    sizes = dict(zip(batch, c.shape[:len(batch)]), **{x: sa[x] for x in fa}, **{x: sb[x] for x in fb})
    order = batch + fa + fb
    c = c.reshape([sizes[x] for x in order])
    perm = [order.index(x) for x in to]
    return c if perm == list(range(len(perm))) else c.transpose(perm)


def _einsum_terms(subscripts: str, shapes) -> tuple[list[str], str]:
    """Explicit letters for every operand and the output (ellipses spelled out, implicit output made explicit)."""
    spec = subscripts.replace(" ", "")
    lhs, arrow, rhs = spec.partition("->")
    terms = lhs.split(",")
    letters = [c for c in lhs if c.isalpha()]
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in spec]
    ell = builtins.max((len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t), default=0)
    e = "".join(spare[:ell])
    out_terms = [t.replace("...", e[ell - (len(s) - (len(t) - 3)):]) if "..." in t else t
                 for t, s in zip(terms, shapes)]
    if arrow:
        out = rhs.replace("...", e)
    else:
        out = e + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return out_terms, out


def _einsum_vjp(g, node, out):
    operands = node.args
    shapes = [_shape(x) for x in operands]
    terms, res = _einsum_terms(node.params[0], shapes)
    sizes = {c: n for t, s in zip(terms, shapes) for c, n in zip(t, s) if n != 1}
    grads = []
    for i, (x, t) in enumerate(zip(operands, terms)):
        if not _is_diff(x):
            grads.append(None)
            continue
        others = [(o, u) for j, (o, u) in enumerate(zip(operands, terms)) if j != i]
        seen = set(res) | {c for _, u in others for c in u}
        keep = "".join(c for c in t if c in seen)
        d = einsum(",".join([res] + [u for _, u in others]) + "->" + keep, g, *(o for o, _ in others))
        if keep != t:  # letters summed in x alone: their cotangent is broadcast back
            d = broadcast_to(reshape(d, tuple(sizes.get(c, 1) if c in keep else 1 for c in t)),
                             tuple(sizes.get(c, 1) for c in t))
        grads.append(_unbroadcast(d, x) if d.shape != x._shape else
                     (d if d.dtype == x._dtype else d.astype(x._dtype)))
    return tuple(grads)


def _explicit(subscripts: str) -> str:
    """numpy's implicit einsum output made explicit (ellipsis dims, then letters used once, sorted)."""
    s = subscripts.replace(" ", "")
    lhs, arrow, rhs = s.partition("->")
    if arrow:
        return s
    letters = lhs.replace(".", "").replace(",", "")
    rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return f"{lhs}->{rhs}"


@onnx_export("Einsum")
def _einsum_onnx(ex):
    return ex.one("Einsum", equation=_explicit(ex.params[0]))


def einsum(subscripts: str, *operands: ArrayLike) -> Tensor:
    """numpy's einsum (no repeated letters within one operand); contracted letters sharded on the
    operands give partial sums."""
    if not isinstance(subscripts, str):
        raise ShardingError(f"einsum: subscripts (the first argument) must be a str such as 'ij,jk->ik', got "
                            f"{type(subscripts).__name__} {short_repr(subscripts)}")
    return apply(_EINSUM, operands, (subscripts,))


def _einsum_flops(blocks, out, params) -> int:
    """Two per point of the letters' product space (a multiply and an add) for two operands or more; one per
    operand element for a single one (a sum)."""
    terms, _ = _einsum_terms(params[0], blocks)
    if len(terms) == 1:
        return prod(blocks[0])
    sizes: dict = {}
    for t, b in zip(terms, blocks):
        for c, n in zip(t, b):
            sizes[c] = max(sizes.get(c, 1), n)
    return 2 * (len(terms) - 1) * prod(sizes.values())


_EINSUM = register(OpDef("einsum", lambda shapes, sub: R.einsum_rule(sub, tuple(shapes)), _einsum_kernel, "mul",
                         dtype=lambda *dts: np.result_type(*dts),
                         vjp=_einsum_vjp, numpy="einsum", onnx=_einsum_onnx, public=einsum, flops=_einsum_flops,
                         saves="cross"))
