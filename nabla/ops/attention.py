"""``dot_product_attention`` (``jax.nn.dot_product_attention``'s meaning and layout) as one op, the way
FlashAttention runs it: the forward kernel computes ``softmax(scale·QKᵀ + bias, masked)·V`` and keeps no scores;
the backward is FlashAttention-2's (Dao, 2023): two fused ops that recompute the probabilities from q, k, v and
the output, one giving dq and one dk and dv (a third, dbias, when the bias is differentiated)."""

from __future__ import annotations

from math import prod, sqrt
from typing import Any

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..collectives import user_op as _user_op
from ..dtypes import is_float
from ..errors import ShardingError
from ..program import Program
from ..args import short_repr
from ..opdef import OpDef
from ..spec import DimSpec, ShardingSpec
from ..value import Value
from .core import ArrayLike, Tensor, apply, _is_diff, _ndim, _shape
from .registry import onnx_export, register
from .shape import expand_dims, reshape, squeeze

_OP = "dot_product_attention"
_F32_MAX = float(np.finfo(np.float32).max)


# ---- the kernels: one device's blocks, grid axes in front ------------------------------------------------------
#
# Blocks: q (*grid, b, t, n, h), k and v (*grid, b, s, kh, h), out and dout like q, bias and mask (*grid, b|1,
# n|1, t|1, s|1), rows (*grid, t). Inside, the heads are split as jax's GQA does, n = (kh, g): scores are
# (*grid, b, kh, g, t, s).


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """float32 for bfloat16, float16 and float32 (jax's logits and softmax dtype); float64 stays float64."""
    return np.promote_types(dtype, np.float32)


def _operands(arrays: list, params: tuple, backward: bool) -> dict:
    """The named blocks of an attention op's operand list (``q, k, v[, out, dout][, bias][, mask][, rows]``)."""
    _, causal, has_bias, has_mask, _ = params
    names = ["q", "k", "v"] + (["out", "dout"] if backward else []) + (["bias"] if has_bias else []) + \
        (["mask"] if has_mask else []) + (["rows"] if causal else [])
    got = dict(zip(names, arrays))
    for n in ("bias", "mask", "rows"):
        got.setdefault(n, None)
    return got


def _heads(x: Any, G: int, kh: int, xp: Any, dtype: np.dtype) -> Any:
    """A (*grid, b, t, n, h) block as (*grid, b, kh, g, t, h) in ``dtype``."""
    b, t, n, h = x.shape[G:]
    x = x.astype(dtype).reshape(x.shape[:G] + (b, t, kh, n // kh if kh else 0, h))
    return xp.moveaxis(x, G + 1, G + 3)


def _unheads(x: Any, G: int, xp: Any) -> Any:
    """The inverse of ``_heads``: (*grid, b, kh, g, t, h) back to (*grid, b, t, n, h)."""
    x = xp.moveaxis(x, G + 3, G + 1)
    b, t, kh, g, h = x.shape[G:]
    return x.reshape(x.shape[:G] + (b, t, kh * g, h))


def _kv(x: Any, G: int, xp: Any, dtype: np.dtype) -> Any:
    """A (*grid, b, s, kh, h) block as (*grid, b, kh, 1, s, h): one kv head for each query head of its group."""
    return xp.expand_dims(xp.moveaxis(x.astype(dtype), G + 1, G + 2), G + 2)


def _scores_layout(x: Any, G: int, kh: int) -> Any:
    """A bias or mask block (*grid, b, n|1, t, s) as (*grid, b, kh|1, g|1, t, s)."""
    b, n, t, s = x.shape[G:]
    return x.reshape(x.shape[:G] + ((b, 1, 1, t, s) if n == 1 else (b, kh, n // kh, t, s)))


def _logits(blocks: dict, G: int, scale: float, xp: Any) -> tuple[Any, Any, np.dtype]:
    """The masked scores ``scale·q·kᵀ + bias`` (masked entries hold jax's large negative number) in the compute
    dtype, and where they are kept (None: everywhere), as jax computes them: the product, then the scale, then
    the bias, then the mask."""
    q, k = blocks["q"], blocks["k"]
    dt = _compute_dtype(q.dtype)
    kh = k.shape[G + 2]
    s = xp.matmul(_heads(q, G, kh, xp, dt), xp.swapaxes(_kv(k, G, xp, dt), -1, -2))
    s = s * xp.asarray(scale, dtype=dt)
    if blocks["bias"] is not None:
        s = (s + _scores_layout(blocks["bias"], G, kh)).astype(dt)
    keep = None
    if blocks["mask"] is not None:
        keep = _scores_layout(blocks["mask"], G, kh)
    if blocks["rows"] is not None:  # causal: key position <= query position (jnp.tril on the last two dims)
        rows = blocks["rows"]
        rows = rows.reshape(rows.shape[:G] + (1, 1, 1, rows.shape[-1], 1))
        causal = rows >= xp.arange(k.shape[G + 1]).reshape((1,) * (G + 4) + (-1,))
        keep = causal if keep is None else xp.logical_and(keep, causal)
    if keep is not None:
        big = -0.7 * min(float(np.finfo(dt).max), _F32_MAX)  # jax's _get_large_negative
        s = xp.where(keep, s, xp.asarray(big, dtype=dt))
    return s, keep, dt


def _probabilities(s: Any, xp: Any) -> Any:
    """softmax over the keys, stably: the row max subtracted (a fully masked row is uniform, as in jax)."""
    p = xp.exp(s - xp.max(s, axis=-1, keepdims=True, initial=-np.inf))  # (no keys: an empty row)
    return p / xp.sum(p, axis=-1, keepdims=True)


def _forward_kernel(arrays: list, local) -> Any:
    scale, causal, _, _, T = local.params
    blocks = _operands(arrays, local.params, False)
    xp, G = _xp(*arrays), local.G
    if xp is not np and G == 0:  # inside nb.jit's shard_map: jax's own, on this device's blocks
        return _jax_forward(blocks, scale, causal, T)
    s, _, dt = _logits(blocks, G, scale, xp)
    out = xp.matmul(_probabilities(s, xp), _kv(blocks["v"], G, xp, dt))
    return _unheads(out, G, xp).astype(blocks["q"].dtype)


def _jax_forward(blocks: dict, scale: float, causal: bool, T: int) -> Any:
    """``jax.nn.dot_product_attention`` on one device's blocks. With the query sequence cut (context
    parallelism) the device's queries are rows ``rows`` of the sequence, so causality is passed as a mask."""
    import jax  # nb.jit runs this only when jax is installed
    mask, rows = blocks["mask"], blocks["rows"]
    whole = rows is None or rows.shape[0] == T
    if rows is not None and not whole:
        keep = (rows[:, None] >= jax.numpy.arange(blocks["k"].shape[1])[None, :])[None, None]
        mask = keep if mask is None else jax.numpy.logical_and(mask, keep)
    return jax.nn.dot_product_attention(blocks["q"], blocks["k"], blocks["v"], blocks["bias"], mask, scale=scale,
                                        is_causal=causal and whole)


def _backward_common(arrays: list, local) -> tuple[dict, Any, Any, Any, Any, np.dtype]:
    """What every backward op recomputes (FlashAttention-2, Algorithm 2): the probabilities P, the cotangent of
    the scores dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)) (zero where masked), and dO in the heads layout."""
    blocks = _operands(arrays, local.params, True)
    xp, G = _xp(*arrays), local.G
    scale = local.params[0]
    s, keep, dt = _logits(blocks, G, scale, xp)
    p = _probabilities(s, xp)
    kh = blocks["k"].shape[G + 2]
    do = _heads(blocks["dout"], G, kh, xp, dt)
    o = _heads(blocks["out"], G, kh, xp, dt)
    dp = xp.matmul(do, xp.swapaxes(_kv(blocks["v"], G, xp, dt), -1, -2))
    ds = p * (dp - xp.sum(do * o, axis=-1, keepdims=True))
    if keep is not None:
        ds = xp.where(keep, ds, xp.zeros((), dt))
    return blocks, p, ds, do, xp, dt


def _dq_kernel(arrays: list, local) -> Any:
    blocks, _, ds, _, xp, dt = _backward_common(arrays, local)
    G = local.G
    dq = xp.matmul(ds, _kv(blocks["k"], G, xp, dt)) * xp.asarray(local.params[0], dtype=dt)
    return _unheads(dq, G, xp).astype(blocks["q"].dtype)


def _dkv_kernel(arrays: list, local) -> Any:
    blocks, p, ds, do, xp, dt = _backward_common(arrays, local)
    G = local.G
    kh = blocks["k"].shape[G + 2]
    q = _heads(blocks["q"], G, kh, xp, dt)
    # summed over the query heads of each group (axis g) and the queries: (*grid, b, kh, s, h)
    dk = xp.sum(xp.matmul(xp.swapaxes(ds, -1, -2), q), axis=G + 2) * xp.asarray(local.params[0], dtype=dt)
    dv = xp.sum(xp.matmul(xp.swapaxes(p, -1, -2), do), axis=G + 2)
    grid = np.broadcast_shapes(dk.shape[:G], dv.shape[:G])
    dkv = xp.stack([xp.broadcast_to(dk, grid + dk.shape[G:]), xp.broadcast_to(dv, grid + dv.shape[G:])], axis=G)
    return xp.moveaxis(dkv, G + 2, G + 3).astype(blocks["k"].dtype)  # (*grid, 2, b, s, kh, h)


def _dbias_kernel(arrays: list, local) -> Any:
    blocks, _, ds, _, xp, _ = _backward_common(arrays, local)
    G = local.G
    b, kh, g, t, s = ds.shape[G:]
    ds = ds.reshape(ds.shape[:G] + (b, kh * g, t, s))
    # the dims the bias is broadcast along are summed (its block has 1 there)
    axes = tuple(G + d for d, n in enumerate(local.out_chunk) if n == 1 and ds.shape[G + d] != 1)
    if axes:
        ds = xp.sum(ds, axis=axes, keepdims=True)
    return ds.astype(blocks["bias"].dtype)


# ---- FLOPs: FlashAttention's counts ------------------------------------------------------------------------------


def _pairs(T: int, S: int, causal: bool) -> int:
    """The (query, key) pairs a FlashAttention kernel computes: all of them, or, causal, those with s <= t."""
    if not causal:
        return T * S
    m = min(T, S)
    return m * (m + 1) // 2 + (T - m) * S


def _score_work(blocks: tuple, params: tuple) -> int:
    """``b·n·t·s·h`` of the device's blocks, causal: its share of the unmasked pairs (its rows' share of them)."""
    _, causal, _, _, T = params
    b, t, n, h = blocks[0]
    S = blocks[1][1]
    if not T or not S:
        return 0
    return b * n * h * t * _pairs(T, S, causal) // T


def _forward_flops(blocks: tuple, out: tuple, params: tuple) -> int:
    """Two matmuls, ``4·B·N·T·S·H`` for the whole op (Dao 2023, sec. 4.1), of the device's blocks."""
    return 4 * _score_work(blocks, params)


def _dq_flops(blocks: tuple, out: tuple, params: tuple) -> int:
    """FlashAttention-2's backward is one pass of five matmuls (Dao 2023, Algorithm 2: S = QKᵀ, dP = dO·Vᵀ,
    dV = Pᵀ·dO, dK = dSᵀ·Q, dQ = dS·K), 2.5 times the forward. Run as two ops, it is counted once: this op
    declares dQ's matmul, the dk/dv op the other four (what this op recomputes of them is the pass's)."""
    return 2 * _score_work(blocks, params)


def _dkv_flops(blocks: tuple, out: tuple, params: tuple) -> int:
    """Four of the backward pass's five matmuls: S, dP, dV and dK (see ``_dq_flops``)."""
    return 8 * _score_work(blocks, params)


def _dbias_flops(blocks: tuple, out: tuple, params: tuple) -> int:
    """One add per score: dS summed into the bias's shape (the matmuls are the other backward ops')."""
    return _score_work(blocks, params) // max(blocks[0][3], 1)


def _lse_bytes(blocks: tuple, out: tuple, params: tuple) -> int:
    """FlashAttention keeps one float32 log-sum-exp per query row for its backward: B·T·N of the block, 4 bytes."""
    return prod(out[:3]) * 4


# ---- the VJP -----------------------------------------------------------------------------------------------------


def _as_read(x: Any, node: Any, i: int) -> Any:
    """Operand ``i`` laid out as the forward kernel read it (keys and values gathered over a cut query sequence),
    moved once for both backward ops, as FlashAttention-2's backward reads them in one pass."""
    prog = node.prog
    if type(prog) is not Program or not isinstance(x, Tensor) or x._spec is None:
        return x
    p = prog.preps[i]
    if p.kind != "sharded" or p.plan is None or not p.plan.collectives:
        return x
    t = p.target
    return x.with_sharding(ShardingSpec(t.mesh, [DimSpec(d.axes) for d in t.dim_specs], t.replicated_axes))


def _vjp(g: Tensor, node: Any, out: Tensor) -> tuple:
    """dq, dk and dv (and dbias) from q, k, v, the output and ``g``, by the fused backward ops (nothing of shape
    (B, N, T, S) is kept or made outside them)."""
    q, k, v, *extra = node.args
    _, causal, has_bias, _, _ = node.params
    read = [_as_read(x, node, i) for i, x in enumerate(node.args)]
    args = (*read[:3], out, g, *read[3:])
    grads: list = [None] * len(node.args)
    if _is_diff(q):
        grads[0] = apply(_DQ, args, node.params)
    if _is_diff(k) or _is_diff(v):
        dkv = apply(_DKV, args, node.params)
        grads[1] = dkv[0] if _is_diff(k) else None
        grads[2] = dkv[1] if _is_diff(v) else None
    if has_bias and _is_diff(extra[0]):
        grads[3] = apply(_DBIAS, args, node.params)
    return tuple(grads)


# ---- ONNX: opset 21 has no Attention op: MatMul, Softmax, Where, Add ------------------------------------------


class _Graph:
    """The nodes every attention op's export shares, named after its result: operands in the heads layout
    (B, K, G|1, T|S, H) in the compute dtype, and the probabilities P (with the kept scores)."""

    def __init__(self, ex: Any, backward: bool) -> None:
        self.ex = ex
        scale, causal, has_bias, has_mask, _ = ex.params
        args = ex.args
        B, T, N, H = _shape(args[0])
        S, K = _shape(args[1])[1], _shape(args[1])[2]
        self.B, self.T, self.N, self.H, self.S, self.K, self.G = B, T, N, H, S, K, N // K
        self.dt = dt = _compute_dtype(_dtype_of(args[0]))
        self.annotated: list[tuple[str, int]] = []
        self.scale = ex.b.constant(np.array(scale, dt), base="scale")
        self.q, self.k, self.v = self.heads(0, "q"), self.kv(1, "k"), self.kv(2, "v")
        s = self.mul(ex.emit("MatMul", [self.q, self.swap(self.k, "kT")], "qk"), self.scale, "scaled")
        i = 5 if backward else 3
        if has_bias:
            s = ex.emit("Add", [s, self.grouped(i, dt, "bias")], "biased")
            i += 1
        self.keep = None
        if has_mask:
            self.keep = self.grouped(i, None, "mask")
            i += 1
        if causal:  # key position <= query position
            rows = ex.emit("Unsqueeze", [self.operand(i, np.int64), ex.ints([1], "axes")], "rows")
            keys = ex.b.constant(np.arange(S, dtype=np.int64), base="keys")
            c = ex.emit("GreaterOrEqual", [rows, keys], "causal")
            self.keep = c if self.keep is None else ex.emit("And", [self.keep, c], "keep")
        if self.keep is not None:
            big = ex.b.constant(np.array(-0.7 * min(float(np.finfo(dt).max), _F32_MAX), dt), base="masked")
            s = ex.emit("Where", [self.keep, s, big], "masked")
        self.p = ex.emit("Softmax", [s], "probs", axis=-1)

    def operand(self, i: int, dtype: Any = None) -> str:
        name = self.ex.operand(i, dtype)
        self.annotated.append((name, i))
        return name

    def heads(self, i: int, what: str) -> str:
        """Operand ``i`` (B, T, N, H) as (B, K, G, T, H)."""
        x = self.ex.emit("Reshape", [self.operand(i, self.dt), self.ex.ints((self.B, self.T, self.K, self.G,
                                                                             self.H))], f"{what}_split")
        return self.ex.emit("Transpose", [x], what, perm=[0, 2, 3, 1, 4])

    def unheads(self, x: str, what: str) -> str:
        """(B, K, G, T, H) back to (B, T, N, H)."""
        x = self.ex.emit("Transpose", [x], f"{what}_t", perm=[0, 3, 1, 2, 4])
        return self.ex.emit("Reshape", [x, self.ex.ints((self.B, self.T, self.N, self.H))], what)

    def kv(self, i: int, what: str) -> str:
        """Operand ``i`` (B, S, K, H) as (B, K, 1, S, H)."""
        x = self.ex.emit("Transpose", [self.operand(i, self.dt)], f"{what}_t", perm=[0, 2, 1, 3])
        return self.ex.emit("Unsqueeze", [x, self.ex.ints([2], "axes")], what)

    def swap(self, x: str, what: str) -> str:
        return self.ex.emit("Transpose", [x], what, perm=[0, 1, 2, 4, 3])

    def mul(self, a: str, b: str, what: str) -> str:
        return self.ex.emit("Mul", [a, b], what)

    def grouped(self, i: int, dtype: Any, what: str) -> str:
        """A bias or mask (b, n, t, s) as (b, K|1, G|1, t, s)."""
        b, n, t, s = _shape(self.ex.args[i])
        shape = (b, 1, 1, t, s) if n == 1 else (b, self.K, self.G, t, s)
        return self.ex.emit("Reshape", [self.operand(i, dtype), self.ex.ints(shape)], what)

    def d_scores(self) -> tuple[str, str]:
        """dO in the heads layout and dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), zero where masked."""
        ex = self.ex
        o, do = self.heads(3, "o"), self.heads(4, "do")
        dp = ex.emit("MatMul", [do, self.swap(self.v, "vT")], "dp")
        rowsum = ex.emit("ReduceSum", [self.mul(do, o, "do_o"), ex.ints([-1], "axes")], "rowsum", keepdims=1)
        ds = self.mul(self.p, ex.emit("Sub", [dp, rowsum], "dp_d"), "ds")
        if self.keep is not None:
            ds = ex.emit("Where", [self.keep, ds, ex.b.constant(np.array(0, self.dt), base="zero")], "ds_kept")
        return do, ds

    def finish(self, x: str) -> tuple:
        """``x`` as the op's result (cast to its dtype), annotated with the operands."""
        ex = self.ex
        if np.dtype(ex.dtype) == self.dt:
            name = ex.out("Identity", [x])
        else:
            name = ex.out("Cast", [x], to=ex.onnx_type(ex.dtype, f"{ex.name}'s result"))
        return ex.finish(name, self.annotated)


_ONNX_TYPES = ("Reshape", "Transpose", "Unsqueeze", "MatMul", "Mul", "Add", "Where", "And", "GreaterOrEqual",
               "Softmax", "Identity")
_ONNX_BACKWARD = _ONNX_TYPES + ("Sub", "ReduceSum", "Concat")


@onnx_export(*_ONNX_TYPES)
def _attention_onnx(ex: Any) -> tuple:
    g = _Graph(ex, False)
    return g.finish(g.unheads(ex.emit("MatMul", [g.p, g.v], "pv"), "heads_out"))


@onnx_export(*_ONNX_BACKWARD)
def _dq_onnx(ex: Any) -> tuple:
    g = _Graph(ex, True)
    _, ds = g.d_scores()
    return g.finish(g.unheads(g.mul(ex.emit("MatMul", [ds, g.k], "ds_k"), g.scale, "dq5"), "dq"))


@onnx_export(*_ONNX_BACKWARD)
def _dkv_onnx(ex: Any) -> tuple:
    g = _Graph(ex, True)
    do, ds = g.d_scores()

    def summed(a: str, b: str, what: str) -> str:  # (aᵀ·b) summed over the group: (B, K, S, H) -> (B, S, K, H)
        x = ex.emit("ReduceSum", [ex.emit("MatMul", [g.swap(a, f"{what}_t"), b], f"{what}_g"), ex.ints([2], "axes")],
                    f"{what}_sum", keepdims=0)
        return ex.emit("Unsqueeze", [ex.emit("Transpose", [x], what, perm=[0, 2, 1, 3]), ex.ints([0], "axes")],
                       f"{what}_1")

    dk = summed(ds, g.q, "dk")
    dk = ex.emit("Mul", [dk, g.scale], "dk_scaled")
    return g.finish(ex.emit("Concat", [dk, summed(g.p, do, "dv")], "dkv", axis=0))


@onnx_export(*_ONNX_BACKWARD)
def _dbias_onnx(ex: Any) -> tuple:
    g = _Graph(ex, True)
    _, ds = g.d_scores()
    ds = ex.emit("Reshape", [ds, ex.ints((g.B, g.N, g.T, g.S))], "ds_scores")
    shape = _shape(ex.args[5])
    axes = [d for d, (n, m) in enumerate(zip(shape, (g.B, g.N, g.T, g.S))) if n == 1 and m != 1]
    if axes:
        ds = ex.emit("ReduceSum", [ds, ex.ints(axes, "axes")], "ds_summed", keepdims=1)
    return g.finish(ds)


# ---- the public function -----------------------------------------------------------------------------------------


def _dtype_of(x: Any) -> np.dtype:
    return x._dtype if isinstance(x, Value) else np.asarray(x).dtype


def _check(q: tuple, k: tuple, v: tuple, dts: tuple, bias: Any, mask: Any) -> None:
    """jax's checks, before anything runs, each naming the operand, the dim and the sizes."""
    names = ("query", "key", "value")
    ranks = tuple(len(s) for s in (q, k, v))
    if ranks[0] not in (3, 4) or len(set(ranks)) != 1:
        raise ShardingError(f"{_OP}: query, key and value must all be (B, T, N, H), (B, S, K, H), (B, S, K, H) (or "
                            f"all without B), got shapes {q}, {k}, {v} (ranks {ranks})")
    for name, dt in zip(names, dts):
        if not is_float(dt):
            raise ShardingError(f"{_OP}: {name} has dtype {dt}; attention needs floating point values")
    if len(set(dts)) != 1:
        raise ShardingError(f"{_OP}: query, key and value have dtypes {dts[0]}, {dts[1]}, {dts[2]}; they must be "
                            f"one dtype (as jax requires)")
    if ranks[0] == 3:  # unbatched: checked as a batch of one
        q, k, v = ((1,) + q, (1,) + k, (1,) + v)
    for d, what in enumerate(("B", "S", "K", "H")):
        if v[d] != k[d]:
            raise ShardingError(f"{_OP}: value dim {d} ({what}) has size {v[d]} but key's has {k[d]}; value must "
                                f"have key's shape {k}")
    if q[0] != k[0]:
        raise ShardingError(f"{_OP}: key dim 0 (B) has size {k[0]} but query's dim 0 has {q[0]}")
    if q[3] != k[3]:
        raise ShardingError(f"{_OP}: key dim 3 (H) has size {k[3]} but query's dim 3 has {q[3]}; query and key "
                            f"heads must have one size")
    if k[2] == 0 or q[2] % k[2]:
        raise ShardingError(f"{_OP}: key dim 2 (K, the kv heads) has size {k[2]}, which does not divide query's dim "
                            f"2 (N, the query heads) of size {q[2]}; grouped-query attention needs N = K x G")
    full = (q[0], q[2], q[1], k[1])  # (B, N, T, S)
    for name, x, kinds in (("bias", bias, "f"), ("mask", mask, "b")):
        if x is None:
            continue
        shape, dt = tuple(_shape(x)), _dtype_of(x)
        if name == "mask" and dt != np.bool_:
            raise ShardingError(f"{_OP}: mask has dtype {dt}; it must be bool (True keeps a score); an additive "
                                f"mask is a bias")
        if name == "bias" and not is_float(dt):
            raise ShardingError(f"{_OP}: bias has dtype {dt}; it must be floating point")
        if len(shape) > 4:
            raise ShardingError(f"{_OP}: {name} has shape {shape} (rank {len(shape)}); it must have rank 4 at most, "
                                f"broadcastable to (B, N, T, S) = {full}")
        shape = (1,) * (4 - len(shape)) + shape
        for d, (n, want, what) in enumerate(zip(shape, full, "BNTS")):
            if n not in (1, want):
                raise ShardingError(f"{_OP}: {name} dim {d} ({what}) has size {n}; it must be 1 or {want} to "
                                    f"broadcast to the scores (B, N, T, S) = {full}")


def dot_product_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
                          mask: ArrayLike | None = None, *, scale: float | None = None,
                          is_causal: bool = False) -> Tensor:
    """``jax.nn.dot_product_attention``: ``softmax(scale·Q·Kᵀ + bias, masked)·V`` per head, with queries
    ``(B, T, N, H)`` and keys and values ``(B, S, K, H)`` (or all without ``B``); ``K`` divides ``N``
    (grouped-query attention: query head ``n`` reads kv head ``n // (N // K)``). ``scale`` defaults to
    ``1/sqrt(H)``; ``bias`` (float) and ``mask`` (bool, True keeps) broadcast to the scores ``(B, N, T, S)``;
    ``is_causal`` keeps keys ``s <= t`` (``jnp.tril`` of the scores). A row with nothing kept attends uniformly,
    as jax's. bfloat16 and float16 are computed in float32 and rounded once (jax also rounds the probabilities);
    float64 stays float64 (jax's softmax is float32). Under ``nb.jit`` each device runs jax's own.

    One op, as FlashAttention runs it: its backward keeps ``query``, ``key``, ``value``, the output and one
    float32 log-sum-exp per query row, and recomputes the scores (FLOPs: ``4·B·N·T·S·H`` forward, causal only
    the kept pairs; backward 2.5 times that, Dao 2023). Sharding: batch and heads pass through (query and kv
    heads cut together: the query heads are (kv head, group), kv head major); the query sequence cut over an
    axis (context parallelism) all_gathers keys and values over it; key positions and the head dim are whole."""
    if not isinstance(is_causal, (bool, np.bool_)):
        raise ShardingError(f"{_OP}: is_causal must be a bool, got {type(is_causal).__name__} {short_repr(is_causal)}")
    q_s, k_s, v_s = (tuple(_shape(x)) for x in (query, key, value))
    dts = tuple(_dtype_of(x) for x in (query, key, value))
    _check(q_s, k_s, v_s, dts, bias, mask)
    if scale is None:
        scale = 1.0 / sqrt(q_s[-1]) if q_s[-1] else 1.0
    elif not isinstance(scale, (int, float, np.integer, np.floating)) or isinstance(scale, (bool, np.bool_)):
        raise ShardingError(f"{_OP}: scale must be a number, got {type(scale).__name__} {short_repr(scale)}")
    with _user_op(_OP):
        unbatched = len(q_s) == 3
        if unbatched:
            query, key, value = (expand_dims(x, 0) for x in (query, key, value))
            q_s = (1,) + q_s
        args = [query, key, value]
        for x in (bias, mask):
            if x is not None:
                r = _ndim(x)
                args.append(x if r == 4 else reshape(x, (1,) * (4 - r) + tuple(_shape(x))))
        T = q_s[1]
        if is_causal:  # the query positions, an operand cut as the queries are: the backward ops sum over the
            # queries, so their result's layout (what an ``aux`` hook sees) cannot tell which rows a device holds
            args.append(np.arange(T, dtype=np.int32))
        out = apply(_ATTENTION, tuple(args), (float(scale), bool(is_causal), bias is not None, mask is not None, T))
        return squeeze(out, 0) if unbatched else out


def _rule(part: str):
    def rule(shapes, scale, causal, has_bias, has_mask, T):
        return R.attention_rule(tuple(tuple(s) for s in shapes), has_bias, has_mask, causal, part)
    return rule


_ATTENTION = register(OpDef(_OP, _rule("forward"), _forward_kernel, dtype=lambda *dts: dts[0], vjp=_vjp,
                            flops=_forward_flops, onnx=_attention_onnx, public=dot_product_attention,
                            saves="all", saved_extra=_lse_bytes))
dot_product_attention.op = _ATTENTION  # as the registry's other public functions carry their op
_DQ = register(OpDef("dot_product_attention_dq", _rule("dq"), _dq_kernel, dtype=lambda *dts: dts[0],
                     flops=_dq_flops, onnx=_dq_onnx))
_DKV = register(OpDef("dot_product_attention_dkv", _rule("dkv"), _dkv_kernel, dtype=lambda *dts: dts[1],
                      flops=_dkv_flops, onnx=_dkv_onnx))
_DBIAS = register(OpDef("dot_product_attention_dbias", _rule("dbias"), _dbias_kernel, dtype=lambda *dts: dts[5],
                        flops=_dbias_flops, onnx=_dbias_onnx))
