"""``nb.vmap``: a function of unbatched tensors run once on a batch. ``fn`` is traced on unbatched abstract
stand-ins, then its recorded ops are run again on the batched values, each op given a leading batch dim that
its kernel treats as one more grid axis (kernels run over grid axes in front already). Sits on top of the ops."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import collectives as C
from .backends import xp as _xp
from .pytree import flatten, unflatten
from .errors import ShardingError
from .value import Value
from .factors import Window
from .opdef import Local, OpDef
from .ops import broadcast_to, expand_dims, sum as _sum, tensor, transpose
from .ops.core import apply
from .rules.core import PASS, Rule
from .spec import DimSpec, ShardingSpec
from .tensor import Tensor
from .backprop import topological
from .trace import LEAF, PLACE, RELAYOUT, Link, differentiating, entry, link, link_of, recorded, replay_trace

_BATCHED: dict[OpDef, OpDef] = {}
_LOCK = threading.Lock()


# ---- an op with a leading batch dim --------------------------------------------------------------------------


def _unbatched_shapes(shapes) -> tuple:
    """Operand shapes without their batch dim (a Python scalar's ``()`` stays ``()``: values always have one)."""
    return tuple(tuple(s[1:]) if len(s) else () for s in shapes)


def _shift(kind: Any) -> Any:
    """A factor kind whose data names operand dims (a window's earlier windowed dims) one dim further on."""
    if isinstance(kind, Window) and kind.before:
        return dataclasses.replace(kind, before=tuple(tuple((d + 1, n, w) for d, n, w in per) if per else per
                                                      for per in kind.before))
    return kind


def _batched_rule(op: OpDef, shapes, *params) -> Rule:
    inner = op.rule(_unbatched_shapes(shapes), *params)
    B = max((s[0] for s in shapes if len(s)), default=1)
    f = len(inner.sizes)
    lead = (f,) if B != 1 else ()
    operands = tuple(((lead if s[0] == B else ()),) + tuple(dims) if len(s) else tuple(dims)
                     for s, dims in zip(shapes, inner.operands))
    return Rule(operands, (lead,) + tuple(inner.result), tuple(inner.sizes) + (B,),
                tuple(_shift(k) for k in inner.kinds) + (PASS,))


def _unbatched_spec(spec: ShardingSpec) -> ShardingSpec:
    return ShardingSpec(spec.mesh, spec.dim_specs[1:], spec.replicated_axes, spec.partial_axes)


def _with_batch_axis(aux: tuple, G: int) -> tuple:
    """Per-layout constants of the op (grid axes in front): a size-1 batch axis after the grid axes."""
    return tuple(np.expand_dims(a, G) if isinstance(a, np.ndarray) and a.ndim >= G else a for a in aux)


def batched(op: OpDef) -> OpDef:
    """``op`` on operands that all have a leading batch dim (of the batch's size, or 1 for an operand the batch
    does not change; Python scalars stay scalars): the rule gains a pass-through batch factor, and the kernel runs
    with the batch dim as one more grid axis. Its VJP is ``op``'s, batched the same way."""
    with _LOCK:
        b = _BATCHED.get(op)
        if b is not None:
            return b

    def kernel(arrays, local):
        if local.G == 0 and not local.windowed:  # whole host values: one batch element at a time
            B = local.out_chunk[0]
            if B == 0:
                return op.kernel(arrays, Local(1, local.out_chunk[1:], local.params))
            outs = [op.kernel([a[i if a.shape[0] > 1 else 0] if _is_block(a) else a for a in arrays],
                              Local(0, local.out_chunk[1:], local.params)) for i in range(B)]
            return _xp(*outs).stack(outs)
        return op.kernel(arrays, local._replace(G=local.G + 1, out_chunk=local.out_chunk[1:],
                                                aux=_with_batch_axis(local.aux, local.G)))

    def aux(spec, cuts, shapes, params):
        return op.aux(_unbatched_spec(spec), cuts, _unbatched_shapes(shapes), params)

    def flops(blocks, out, params):
        inner = op.flops(_unbatched_shapes(blocks), tuple(out[1:]), params)
        return inner * (out[0] if out else 1)

    b = OpDef(op.name, lambda shapes, *params: _batched_rule(op, shapes, *params), kernel, op.linear, op.linear_args,
              op.reduction, op.dtype, op.fast, aux if op.aux is not None else None, None, op.folds,
              flops if op.flops is not None else None, onnx=op.onnx if op.fast is not None else None,
              arity=op.arity)
    b.vjp = _batched_vjp(op) if op.vjp is not None else None
    with _LOCK:
        return _BATCHED.setdefault(op, b)


def _is_block(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "ndim") and a.ndim >= 1 and not isinstance(a, np.generic)


def _batched_vjp(op: OpDef) -> Callable:
    """The VJP of ``batched(op)``: ``op.vjp`` traced on unbatched stand-ins of the cotangent, operands and
    result, then run on the batched ones; an operand the batch did not change (batch dim 1) gets its cotangent
    summed over the batch."""
    def vjp(g, node, out):
        stand = [_stand_in(a, diff=getattr(link_of(a), "diff", False)) if isinstance(a, Value)
                 else a for a in node.args]
        g_u, out_u = _stand_in(g, False), _stand_in(out, False)
        with _tracing():
            parts = op.vjp(g_u, entry(op, node.params, tuple(stand)), out_u)
        env = {id(g_u): g, id(out_u): out}
        env.update({id(s): a for s, a in zip(stand, node.args) if isinstance(a, Value)})
        got = _replay([p for p in parts if p is not None], env)
        res, it = [], iter(got)
        for a, p in zip(node.args, parts):
            if p is None:
                res.append(None)
                continue
            c, is_batched = next(it)
            if not is_batched:
                c = expand_dims(c, 0)
            if c.shape[0] != a._shape[0]:
                c = _sum(c, 0, keepdims=True) if a._shape[0] == 1 else broadcast_to(c, a._shape)
            res.append(c)
        return tuple(res)
    return vjp


# ---- tracing and replaying -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _tracing() -> Iterator[None]:
    """Record ops on stand-ins (backward passes inside too), publishing nothing to open comm logs."""
    with C.unlogged(), differentiating(), recorded(), replay_trace():
        yield


_STAND_IN = Link(LEAF, ("vmap",), diff=False)
_STAND_IN_DIFF = Link(LEAF, ("vmap",), diff=True)


def _stand_in(v: Value, diff: bool) -> Tensor:
    """An abstract value shaped like one element of the batched ``v`` (its layout without the batch dim)."""
    spec = v._spec
    if spec is not None and not isinstance(spec, ShardingSpec):
        raise ShardingError("vmap: cannot batch per-device values (inside nb.shard_map)")
    return link(Tensor(None, None if spec is None else _unbatched_spec(spec), tuple(v._shape[1:]), v._dtype),
                _STAND_IN_DIFF if diff else _STAND_IN)


def _replay(outputs: Sequence[Any], env: dict[int, Any]) -> list[tuple[Any, bool]]:
    """Run again, on batched values, every recorded op between the stand-ins in ``env`` (by id, each mapped to
    its batched value) and ``outputs``; values that depend on no stand-in are what the trace computed. Returns
    each output and whether it is batched."""
    batched_ids: set[int] = set(env)
    vals = dict(env)
    for v, node, _ in topological([o for o in outputs if isinstance(o, Value)]):
        if id(v) in vals:
            continue
        if not any(isinstance(a, Value) and id(a) in batched_ids for a in node.args):
            continue  # unbatched: the value the trace computed (real, as its operands are)
        args = [vals.get(id(a), a) if isinstance(a, Value) else a for a in node.args]
        if node.op in (LEAF,) or getattr(node.op, "name", None) == "gather to host":
            out = args[0]  # the same value (an inner differentiation's leaf; a host copy of a gradient)
        elif node.op == RELAYOUT:
            out = _relayout(args[0], node.params[0])
        elif node.op == PLACE:
            spec = node.params[0]
            out = args[0].shard(spec.mesh, [DimSpec(())] + list(spec.dim_specs), spec.replicated_axes,
                                spec.partial_axes)
        elif isinstance(node.op, OpDef):
            ins = []
            for a, orig in zip(args, node.args):
                if isinstance(orig, Value) and id(orig) not in batched_ids:  # the same for every batch element
                    a = expand_dims(a, 0)
                ins.append(a)
            out = apply(batched(node.op), ins, node.params)
        else:
            raise ShardingError(f"vmap: cannot batch {getattr(node.op, 'name', node.op)!r} (only nabla's registered "
                                f"ops, with_sharding and placements are batched)")
        vals[id(v)] = out
        batched_ids.add(id(v))
    return [(vals[id(o)], True) if isinstance(o, Value) and id(o) in batched_ids else (o, False) for o in outputs]


def _relayout(x: Tensor, target: ShardingSpec) -> Tensor:
    """``with_sharding`` of a batched value: the target's dims after the batch dim, which keeps those of its
    axes the target does not use."""
    used = {a for d in target.dim_specs for a in d.axes} | set(target.replicated_axes) | set(target.partial_axes)
    have = x.sharding.dim_specs[0].axes if x.sharding is not None else ()
    lead = DimSpec(tuple(a for a in have if a not in used))
    return x._with_spec(ShardingSpec(target.mesh, [lead] + list(target.dim_specs), target.replicated_axes,
                                     target.partial_axes))


# ---- vmap ----------------------------------------------------------------------------------------------------


def _axis_of(axes: Any, i: int, n: int, what: str) -> Any:
    if axes is None or isinstance(axes, (int, np.integer)):
        return axes
    if isinstance(axes, (tuple, list)) and len(axes) == n:
        return axes[i]
    raise ShardingError(f"vmap: {what} must be an int, None, or a tuple with one entry per "
                        f"{'argument' if what == 'in_axes' else 'output'} ({n}), got {axes!r}")


def _move(t: Tensor, src: int, dst: int) -> Tensor:
    perm = list(range(t.ndim))
    perm.insert(dst, perm.pop(src))
    return t if perm == sorted(perm) else transpose(t, perm)


def vmap(fn: Callable, in_axes: Any = 0, out_axes: Any = 0) -> Callable:
    """``jax.vmap`` for functions of nabla tensors: ``vmap(fn)(xs)`` is ``stack([fn(x) for x in xs])``, computed
    once for the whole batch.

    ``in_axes``: the mapped dim of every argument (an int), or one entry per argument (an int, or None for an
    argument passed to every call as it is; a pytree argument maps every leaf alike). ``out_axes``: where the
    batch dim goes in the outputs (an int, or one per output of a tuple). Mapped arguments must agree on the batch
    size.

    How: ``fn`` runs once on unbatched abstract stand-ins (shapes and layouts without the batch dim; nothing is
    computed), recording its ops; then each recorded op runs on the batched values with a leading batch dim that
    its kernel treats as one more grid axis, so every op keeps its sharding rule (the batch dim is one more
    pass-through factor: a batch dim sharded on ``dp`` stays sharded, and nothing moves for it). ``with_sharding``
    inside ``fn`` lays out the other dims. What ``fn`` does in Python depends only on shapes and layouts, as under
    ``jax.vmap``: reading a value (``.numpy()``, ``float(t)``) inside raises. Ops that are not nabla's registered
    ops (``nb.shard_map``, ``nb.checkpoint``) raise ``ShardingError``; gradients inside ``fn`` and of the batched
    function are batched like any op."""
    def batched_fn(*args):
        n = len(args)
        B = None
        stand_args, env = [], {}
        for i, a in enumerate(args):
            ax = _axis_of(in_axes, i, n, "in_axes")
            leaves, tree = flatten(a)
            if ax is None:
                stand_args.append(a)
                continue
            new = []
            for leaf in leaves:
                t = leaf if isinstance(leaf, Tensor) else tensor(leaf)
                if t.ndim == 0:
                    raise ShardingError(f"vmap: argument {i} is 0-d; it has no dim {ax} to map over")
                if not isinstance(ax, (int, np.integer)) or not -t.ndim <= ax < t.ndim:
                    raise ShardingError(f"vmap: in_axes {ax!r} is out of range for argument {i} of shape {t.shape}")
                if B is None:
                    B = t.shape[ax]
                elif t.shape[ax] != B:
                    raise ShardingError(f"vmap: mapped dims have different sizes: argument {i} has {t.shape[ax]} "
                                        f"along dim {ax}, an earlier one {B}")
                t = _move(t, int(ax) % t.ndim, 0)
                s = _stand_in(t, diff=False)
                env[id(s)] = t
                new.append(s)
            stand_args.append(unflatten(tree, new))
        if B is None:
            raise ShardingError("vmap: no argument is mapped (every in_axes entry is None)")
        with _tracing():
            result = fn(*stand_args)
        leaves, tree = flatten(result)
        for o in leaves:
            if not isinstance(o, Tensor):
                raise ShardingError(f"vmap: fn must return tensors (or a pytree of them), got {type(o).__name__}")
        outs = []
        top = len(result) if isinstance(result, (tuple, list)) else 1
        counts = [len(flatten(r)[0]) for r in result] if isinstance(result, (tuple, list)) else [len(leaves)]
        owner = [i for i, c in enumerate(counts) for _ in range(c)]
        for (o, is_batched), i in zip(_replay(leaves, env), owner):
            ax = _axis_of(out_axes, i, top, "out_axes")
            if not is_batched:
                if o._data is None:
                    raise ShardingError("vmap: an output of fn has no value and depends on no mapped argument through "
                                        "an op vmap can batch")
                o = broadcast_to(expand_dims(o, 0), (B,) + tuple(o.shape))
            if ax is None:
                raise ShardingError("vmap: out_axes None asks for an unbatched output; every output of a batched "
                                    "call has the batch dim")
            if not -o.ndim <= ax < o.ndim:
                raise ShardingError(f"vmap: out_axes {ax} is out of range for an output of rank {o.ndim - 1}")
            outs.append(_move(o, 0, int(ax) % o.ndim))
        return unflatten(tree, outs)

    batched_fn.__name__ = f"vmap({getattr(fn, '__name__', 'fn')})"
    batched_fn.__doc__ = fn.__doc__
    return batched_fn
