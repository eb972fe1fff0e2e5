"""The op registry: every op by name, with what numpy, ONNX export and random programs know it by.
``nb.<name>``, ``np.<ufunc>(tensor)``, ``nabla.onnx.export`` and ``nabla.testing.programs()`` read it when they
run, so an op registered here (at import or later) is in all of them. The op families (``pointwise``,
``reduction``, ...) fill it.

Adding an op
------------
An elementwise op is one call::

    from nabla.ops import elementwise
    elementwise("tan", numpy="tan", onnx="Tan", vjp=lambda g, x, out: g * (1 + out * out), domain=(-1.2, 1.2))

``elementwise`` returns the op's function (its ``OpDef`` is ``fn.op``); its docstring lists the options. Any
other op is an ``OpDef`` (``nabla.opdef``) with its rule, kernel and VJP, and ``public`` set to its user-facing
function: ``register(OpDef(...))``.

An export function takes the export context ``ex`` of one recorded step and returns ``ex.finish(...)``; mark it
with the ONNX op types it emits (``nabla.onnx.export.MAPPING`` lists them)::

    @onnx_export("Softmax")
    def _softmax_onnx(ex):
        return ex.one("Softmax", axis=int(ex.params[0]))

``ex`` holds ``step`` (the recorded ``Step``), ``args`` (its operands: values, or Python scalars), ``name`` (the
op's), ``params``, ``v`` (the result), ``dtype`` (the result's) and ``base`` (a name stem). ``ex.operand(i, dtype=None)``: the name of operand ``i`` (cast when a dtype
is given); ``ex.out(op_type, inputs, **attrs)``: the op's main node, named as its result; ``ex.emit(op_type,
inputs, suffix, **attrs)``: an intermediate node; ``ex.ints(values, base)``: an int64 constant;
``ex.onnx_type(dtype, what)``: an ONNX element type; ``ex.finish(name, [(input name, operand index), ...])``: the
result and the main node's annotated inputs; ``ex.one(op_type, cast=True, **attrs)``: all of it, one node over
every operand.

``unregister(name)`` removes an op (tests that register one clean up with it). Lookups: ``lookup(name)``,
``by_numpy(name)``, ``by_onnx(op_type)``, ``function(name)`` (the public function), ``names()``.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .. import rules as R
from ..backends import xp as _xp
from ..errors import ShardingError
from ..opdef import OpDef
from .core import Tensor, _align, apply, _is_diff

#: op name -> OpDef, in registration order (random programs draw in this order)
REGISTRY: dict[str, OpDef] = {}
_BY_NUMPY: dict[str, OpDef] = {}
_AS_ONNX: dict[str, tuple[OpDef, ...]] = {}  # ONNX op type -> the ops exported as exactly one node of it
_LOCK = threading.Lock()


# ---- the table ----------------------------------------------------------------------------------------------


def register(op: OpDef) -> OpDef:
    """Add ``op`` under its name (and its numpy name); a name already taken by another op is refused."""
    with _LOCK:
        held = REGISTRY.get(op.name)
        if held is not None and held is not op:
            raise ShardingError(f"register: an op named {op.name!r} is registered already ({held!r}); "
                                f"unregister it first")
        taken = _BY_NUMPY.get(op.numpy) if op.numpy is not None else None
        if taken is not None and taken is not op:
            raise ShardingError(f"register: np.{op.numpy} already runs op {taken.name!r}; {op.name!r} cannot "
                                f"answer to it too")
        REGISTRY[op.name] = op
        if op.numpy is not None:
            _BY_NUMPY[op.numpy] = op
        if isinstance(op.onnx, str):
            _AS_ONNX[op.onnx] = tuple(o for o in _AS_ONNX.get(op.onnx, ()) if o is not op) + (op,)
    return op


def unregister(op: OpDef | str) -> OpDef:
    """Remove an op (by name or itself); returns it."""
    name = op if isinstance(op, str) else op.name
    with _LOCK:
        held = REGISTRY.pop(name, None)
        if held is None:
            raise ShardingError(f"unregister: no op named {name!r} is registered")
        if held.numpy is not None and _BY_NUMPY.get(held.numpy) is held:
            del _BY_NUMPY[held.numpy]
        if isinstance(held.onnx, str):
            _AS_ONNX[held.onnx] = tuple(o for o in _AS_ONNX.get(held.onnx, ()) if o is not held)
    return held


def lookup(name: str) -> OpDef:
    op = REGISTRY.get(name)
    if op is None:
        raise ShardingError(f"no op named {name!r} is registered (registered: {sorted(REGISTRY)})")
    return op


def reduce_cotangent(g: Tensor, axes: tuple[int, ...], keepdims: bool) -> Tensor:
    """The sum a VJP makes of a broadcast operand's cotangent, with ``jax.lax.reduce_sum``'s meaning (JAX's
    transpose of a broadcast): in ``g``'s dtype, each device accumulating its block in float32 and rounding it,
    a partial sum carried in ``g``'s dtype. So bf16 gradients are reduce_scattered (or all_reduced) in bf16 at
    the end, as Megatron and XLA on GPU sum them, not all_reduced in float32 where the sum is made."""
    return apply(lookup("sum"), (g,), (tuple(axes), bool(keepdims), False))  # (reduction.py registers it)


def _unbroadcast(g: Tensor, x: Any) -> Tensor | None:
    """The cotangent of an operand that broadcasting stretched: summed back to its shape, in its dtype."""
    if not _is_diff(x):
        return None
    shape = x._shape
    lead = g.ndim - len(shape)
    if lead:
        g = reduce_cotangent(g, tuple(range(lead)), False)
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = reduce_cotangent(g, axes, True)
    return g if g.dtype == x._dtype else g.astype(x._dtype)


def by_numpy(name: str) -> OpDef | None:
    """The op answering to numpy's ufunc or function ``name`` on tensors, if any."""
    return _BY_NUMPY.get(name)


def onnx_types(op: OpDef) -> tuple[str, ...]:
    """The ONNX op types ``op``'s export emits (besides Cast); () when it has no export."""
    how = op.onnx
    if how is None:
        return ()
    return (how,) if isinstance(how, str) else tuple(getattr(how, "types", ()))


def by_onnx(op_type: str) -> list[OpDef]:
    """The ops whose export emits ONNX nodes of ``op_type``."""
    return [op for op in list(REGISTRY.values()) if op_type in onnx_types(op)]


def as_onnx(op_type: str) -> tuple[OpDef, ...]:
    """The ops whose export is exactly one ``op_type`` node over their operands (``OpDef.onnx`` naming it): what
    the ONNX importer runs such a node as."""
    return _AS_ONNX.get(op_type, ())


def function(name: str) -> Callable | None:
    """The public function of the op registered as ``name`` (what ``nb.<name>`` is), or None."""
    op = REGISTRY.get(name)
    return None if op is None else op.public


def names() -> list[str]:
    """The names of the registered ops that have a public function, in registration order."""
    return [n for n, op in list(REGISTRY.items()) if op.public is not None]


def onnx_export(*types: str) -> Callable:
    """Mark an op's ONNX export function with the ONNX op types it emits."""
    def mark(fn: Callable) -> Callable:
        fn.types = types
        return fn
    return mark


# ---- one call per elementwise op ------------------------------------------------------------------------------


def elementwise(name: str, fn: str | Callable | None = None, *, numpy: str | None = None,
                onnx: str | Callable | None = None, vjp: Callable | Sequence[Callable | None] | None = None,
                reference: Callable | None = None, domain: tuple[float, float] | None = None,
                arity: int | None = None, operands: Sequence[str] | None = None, linear: str | None = None,
                linear_args: tuple[int, ...] | None = None, dtype: Any = "sample", flops: Callable | None = None,
                public: bool = True, doc: str | None = None, reads: Sequence[str] | str | None = None) -> Callable:
    """Define, register and return an elementwise op's function; its OpDef is ``.op``.

    - ``fn``: the kernel, as a name that ``numpy`` and ``jax.numpy`` both have (default: ``name``), or a function
      ``fn(xp, *blocks)`` of the array module and the operands' blocks;
    - ``numpy``: the numpy ufunc or function it answers to on tensors (``np.tan(t)``);
    - ``onnx``: an ONNX op type (one node, operands cast to the result's dtype) or an export function (see the
      module doc);
    - ``vjp``: for one operand ``vjp(g, x, out)``, else one function per operand ``d(g, *operands, out)`` (None:
      no cotangent); each result is summed back over broadcast dims. Left out: the op is not differentiable;
    - ``reference``: numpy's version (default: ``np.<fn>``, or ``fn(np, ...)``); ``domain``: the ``(low, high)``
      interval random programs clip operands to (default: any value); ``arity``: the operand count (default: from
      ``fn``); ``operands``: the public function's parameter names (default ``x``; ``a, b``; ``a, b, c``);
    - ``linear``, ``linear_args``, ``dtype``, ``flops``: as ``OpDef`` has them;
    - ``public``: whether ``nb.<name>`` is it (False: an op nabla calls internally); ``doc``: its docstring;
    - ``reads``: what each operand's derivative reads (its residuals), one string per operand (one for a unary op)
      of operand positions and ``o`` for the output: ``multiply`` reads ``("1", "0")``, ``exp`` ``"o"``, ``add``
      ``("", "")``. Left out: every operand and the output (always right, never lean).
    """
    fn = name if fn is None else fn
    if isinstance(fn, str):
        if not hasattr(np, fn):
            raise ShardingError(f"elementwise: numpy has no function {fn!r} for op {name!r}; pass fn=, a name "
                                f"numpy and jax.numpy both have, or a function fn(xp, *blocks)")
        np_f = getattr(np, fn)
        arity = arity if arity is not None else getattr(np_f, "nin", None)
    else:
        np_f = functools.partial(fn, np)  # (a partial is called without a frame of its own, as a lambda is not)
        arity = arity if arity is not None else len(inspect.signature(fn).parameters) - 1
    if arity is None:
        raise ShardingError(f"elementwise: cannot tell how many operands op {name!r} takes; pass arity=")

    def kernel(arrays, local):
        xp = _xp(*arrays)
        f = np_f if xp is np else getattr(xp, fn) if isinstance(fn, str) else (lambda *a: fn(xp, *a))
        return f(*_align(arrays, local))

    op = OpDef(name, lambda shapes, *params: R.elementwise_rule(tuple(shapes), op=name), kernel, linear,
               linear_args, dtype=dtype, fast=np_f, vjp=_vjp(vjp, arity, name), flops=flops, numpy=numpy,
               onnx=onnx, reference=reference if reference is not None else np_f, domain=domain, arity=arity,
               saves=_saves(reads, arity, name, vjp))
    f = _function(op, tuple(operands) if operands is not None else _OPERANDS.get(arity, ()), doc)
    op.public = f if public else None
    register(op)
    return f


_OPERANDS = {1: ("x",), 2: ("a", "b"), 3: ("a", "b", "c")}


def _saves(reads: Sequence[str] | str | None, arity: int, name: str, vjp: Any = None) -> Any:
    """``OpDef.saves`` from what each derivative reads: the operands and output read for those that need one."""
    if reads is None:
        none = vjp is None or not callable(vjp) and all(d is None for d in vjp)
        return "none" if none else "all"
    rs = (reads,) if isinstance(reads, str) else tuple(reads)
    if len(rs) != arity or any(c not in "o" + "0123456789"[:arity] for r in rs for c in r):
        raise ShardingError(f"elementwise: op {name!r} takes {arity} operands; reads needs one string each, of "
                            f"operand positions and 'o' (the output), got {reads!r}")

    def saves(diff: tuple, params: tuple) -> tuple:
        used = "".join(r for r, d in zip(rs, diff) if d)
        return tuple(int(c) for c in set(used) if c != "o"), "o" in used
    return saves


def _vjp(d: Any, arity: int, name: str) -> Callable | None:
    """The op's VJP from one derivative per operand: each applied where its operand needs a cotangent."""
    if d is None:
        return None
    ds = (d,) if callable(d) else tuple(d)
    if len(ds) != arity:
        raise ShardingError(f"elementwise: op {name!r} takes {arity} operands; vjp needs one derivative each "
                            f"(None where there is none), got {len(ds)}")

    def vjp(g, node, out):
        args = node.args
        return tuple(_unbroadcast(di(g, *args, out), x) if di is not None and _is_diff(x) else None
                     for di, x in zip(ds, args))
    return vjp


def _function(op: OpDef, operands: tuple[str, ...], doc: str | None) -> Callable:
    """``op``'s function: its operands by position (or by name, as a def takes them)."""
    sig = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="ArrayLike")
                             for p in operands], return_annotation="Tensor") if operands else None
    n = len(operands)

    def f(*args, **kwargs):
        if kwargs or len(args) != n:
            if sig is not None:
                args = sig.bind(*args, **kwargs).args  # a TypeError naming what is missing, as a def gives
            elif kwargs:
                raise TypeError(f"{op.name}() takes its operands by position")
        return apply(op, args)

    f.__name__ = f.__qualname__ = op.name
    f.__module__ = "nabla"
    f.__doc__ = doc if doc is not None else \
        f"``{op.name}``, elementwise{f' (numpy: np.{op.numpy})' if op.numpy else ''}; operands broadcast as numpy's."
    if sig is not None:
        f.__signature__ = sig
    f.op = op
    return f
