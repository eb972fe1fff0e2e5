"""What ``nox.run`` fuses, as onnxruntime's graph optimizer does: an inference ``BatchNormalization`` that is
the only consumer of a ``Conv`` output, where the conv's weight (and bias) and the norm's four parameters
are initializers, is folded into the conv (``W * s`` and ``(b - mean) * s + beta`` with
``s = scale / sqrt(var + eps)``) and the norm passes its input through. The activations then make one pass
(the conv's bias add) where the normalization made three (subtract, multiply, add). Layouts do not change:
a per-channel affine map keeps whatever sharding the conv's output has, and both nodes' annotations still
act on the same tensors. The model itself is never modified.

Then the epilogues: a conv's bias and a ``Relu`` that is the only consumer of its output run inside the
conv's kernel, in place on the block it just computed (``CONV_ACT``), when the conv's input channels are not
sharded (a sharded contraction leaves partial sums, which a bias or a relu must not see: those convs run
as they are); an ``Add`` whose only consumer is a ``Relu`` runs as one elementwise op (``ADD_RELU``)."""

from __future__ import annotations

from typing import Collection, NamedTuple

import numpy as np
import onnx
from onnx import helper

from .. import ops as _ops
from .. import windows as _windows
from ..opdef import OpDef
from ..ops import elementwise, onnx_export, register
from ..ops.windowed import onnx_pads
from ..rules import conv as _conv_rules
from ..layout import grid


class Fold(NamedTuple):
    conv: int  # node indices
    norm: int
    weight: str  # initializer names
    bias: str | None
    scale: str
    shift: str
    mean: str
    var: str
    eps: float


def foldable(model: onnx.ModelProto, given: Collection[str] = ()) -> list[Fold]:
    """The Conv -> BatchNormalization pairs of ``model`` that fold. ``given`` names graph inputs the caller
    feeds, whose initializers are therefore not constants."""
    g = model.graph
    inits = {i.name: i for i in g.initializer if i.name not in given}
    consumers: dict[str, list[int]] = {}
    for k, n in enumerate(g.node):
        for x in n.input:
            consumers.setdefault(x, []).append(k)
    outputs = {o.name for o in g.output}
    producer = {o: k for k, n in enumerate(g.node) for o in n.output}
    folds = []
    for k, bn in enumerate(g.node):
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") or len(bn.input) != 5:
            continue
        if any(bn.output[1:]) or _attr(bn, "training_mode", 0) or _attr(bn, "spatial", 1) != 1 or \
                not _attr(bn, "is_test", 1):
            continue
        src = bn.input[0]
        c = producer.get(src)
        if c is None or src in outputs or consumers.get(src) != [k]:
            continue
        conv = g.node[c]
        if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(conv.input) < 2 or not conv.input[1]:
            continue
        bias = conv.input[2] if len(conv.input) > 2 and conv.input[2] else None
        params = [conv.input[1]] + ([bias] if bias else []) + list(bn.input[1:])
        if not all(p in inits for p in params):
            continue
        w = inits[conv.input[1]]
        if w.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE) or len(w.dims) < 3 or \
                any(inits[p].data_type != w.data_type or list(inits[p].dims) != [w.dims[0]] for p in params[1:]):
            continue  # anything unusual is left for the ops themselves to run (or report)
        folds.append(Fold(c, k, conv.input[1], bias, *bn.input[1:], float(_attr(bn, "epsilon", 1e-5))))
    return folds


def fold(f: Fold, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The folded weight and bias, from the initializers' values (the scale in float64, applied once)."""
    w = arrays[f.weight]
    b = arrays[f.bias] if f.bias else np.zeros(w.shape[0], w.dtype)
    scale, shift, mean, var = (arrays[p].astype(np.float64) for p in (f.scale, f.shift, f.mean, f.var))
    s = scale / np.sqrt(var + f.eps)
    w2 = w * s.astype(w.dtype).reshape((-1,) + (1,) * (w.ndim - 1))
    b2 = ((b.astype(np.float64) - mean) * s + shift).astype(w.dtype)
    return w2, b2


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


# ---- epilogues: ops nox.run calls in place of a chain of nodes ----------------------------------------------


def _conv_act_kernel(arrays, local):
    x, w = arrays[:2]
    stride, padding, dilation, groups, relu, residual = local.params
    if not local.windowed:
        x = _ops.pad_spatial(x, padding, 0)
    G = local.G
    live = local.aux[0] if local.windowed and local.aux else ()
    bias = arrays[2] if len(arrays) > 2 + residual else None
    return _windows.conv(x, w, G, stride, dilation, x.shape[G + 1] // w.shape[G + 1], live, bias, relu,
                         arrays[-1] if residual else None)


def _conv_act_aux(spec, cuts, shapes, params):
    """Per spatial dim sharded on one grid axis: how many of its blocks hold real output rows (with the ceil
    rule, 28 rows over 8 devices leave the last one only padding), so the kernel skips the rest."""
    stride, padding, dilation = params[:3]
    x, w = shapes[0], shapes[1]
    g = grid(spec, cuts)
    live = []
    for i in range(len(x) - 2):
        atoms = [a for a in g.dims[2 + i] if g.shape[a] > 1]
        if len(atoms) != 1:
            continue
        k = g.shape[atoms[0]]
        n_out = _windows.out_size(x[2 + i], w[2 + i], stride[i], dilation[i], *padding[i])
        co = -(-n_out // k)
        if co and -(-n_out // co) < k:
            live.append((atoms[0], -(-n_out // co)))
    return (tuple(live),)


@onnx_export("Conv", "Add", "Relu")
def _conv_act_onnx(ex):
    """Conv with its bias, then the residual Add and Relu when fused."""
    stride, pads, dilation, groups, relu, residual = ex.params
    ins = [ex.operand(i, ex.dtype) for i in range(len(ex.args))]
    attrs = dict(strides=list(stride), pads=onnx_pads(pads), dilations=list(dilation), group=int(groups),
                 kernel_shape=[int(k) for k in ex.args[1]._shape[2:]])
    main = [(x, i) for i, x in enumerate(ins)]
    conv_ins = ins[:-1] if residual else ins
    if not relu and not residual:
        return ex.finish(ex.out("Conv", conv_ins, **attrs), main)
    y = ex.emit("Conv", conv_ins, "conv", **attrs)
    if not relu:
        return ex.finish(ex.out("Add", [y, ins[-1]]), main)
    if residual:
        y = ex.emit("Add", [y, ins[-1]], "sum")
    return ex.finish(ex.out("Relu", [y]), main)


def _conv_act_rule(shapes, stride, padding, dilation, groups, relu, residual):
    bias = shapes[2] if len(shapes) > 2 + residual else None
    return _conv_rules.conv_rule(shapes[0], shapes[1], stride, padding, dilation, groups, bias, True,
                                 shapes[-1] if residual else None)


CONV_ACT = register(OpDef("conv_act", _conv_act_rule, _conv_act_kernel, dtype=lambda *d: np.result_type(*d),
                          aux=_conv_act_aux, onnx=_conv_act_onnx))


def conv_act(x, w, bias, stride, padding, dilation, groups: int, relu: bool, residual=None):
    """``relu(conv(x, w) + bias + residual)`` (bias, residual and relu optional) as one op: input channels
    needed whole (never partial); the residual (the output's shape, as a ResNet's shortcut) is added while
    the kernel's output is in cache, where an Add after the conv would read and write it all again."""
    nd = x.ndim - 2
    params = (_ops.per_dim(stride, nd, "stride", "conv"), _ops.spatial_pads(padding, nd, "conv"),
              _ops.per_dim(dilation, nd, "dilation", "conv"), int(groups), bool(relu), residual is not None)
    args = (x, w) + (() if bias is None else (bias,)) + (() if residual is None else (residual,))
    return _ops.apply(CONV_ACT, args, params)


# Elements per chunk of ``_add_relu`` on numpy: the sum stays in cache for the relu (256 KB of float32).
_ADD_RELU_CHUNK = 1 << 16


def _add_relu(xp, a, b):
    if xp is np and type(a) is np.ndarray and type(b) is np.ndarray and a.shape == b.shape and \
            a.dtype == b.dtype and a.flags.c_contiguous and b.flags.c_contiguous and a.size > _ADD_RELU_CHUNK:
        out = np.empty_like(a)  # chunk by chunk: add then relu while the chunk is in cache (one pass over memory)
        fa, fb, fo = a.reshape(-1), b.reshape(-1), out.reshape(-1)
        zero = out.dtype.type(0)
        for i in range(0, fo.size, _ADD_RELU_CHUNK):
            o = fo[i:i + _ADD_RELU_CHUNK]
            np.add(fa[i:i + _ADD_RELU_CHUNK], fb[i:i + _ADD_RELU_CHUNK], out=o)
            np.maximum(o, zero, out=o)
        return out
    out = xp.add(a, b)
    if xp is np and isinstance(out, np.ndarray) and out.flags.writeable:
        return np.maximum(out, out.dtype.type(0), out=out)
    return xp.maximum(out, out.dtype.type(0))


@onnx_export("Add", "Relu")
def _add_relu_onnx(ex):
    ins = [ex.operand(i, ex.dtype) for i in range(2)]
    return ex.finish(ex.out("Relu", [ex.emit("Add", ins, "sum")]), [(ins[0], 0), (ins[1], 1)])


ADD_RELU = elementwise("add_relu", _add_relu, onnx=_add_relu_onnx, public=False).op
