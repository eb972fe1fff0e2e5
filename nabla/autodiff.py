"""Reverse-mode differentiation over the trace: ``grad``, ``value_and_grad``, ``vjp`` (JAX's meanings, over
pytrees), ``checkpoint`` (rematerialisation) and the Nabla sharding README's ``t.trace()`` / ``loss.backward()`` /
``.grad``. The backward pass they run is ``backprop``'s; each gradient ends with its primal's dim specs."""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Sequence

from . import collectives as C
from .backprop import Finisher, VjpOp, as_tensor, backward_pass, detach, ones_seed, topological, traced_leaf
from .dtypes import is_float
from .errors import ShardingError
from .pytree import flatten, leaf_paths, unflatten
from .sharding import specs_like
from .tensor import Tensor
from .trace import (LEAF, Remat, Watch, by_link, differentiating, held_grad, link_of, outer_live, record, recorded,
                    recording, regathering, remat, swapped, taping, watching)


def vjp(f: Callable, *primals: Any, has_aux: bool = False):
    """``out, vjp_fn = nb.vjp(f, *primals)``: ``vjp_fn(cotangent)`` returns one gradient pytree per primal."""
    return _vjp(f, primals, has_aux, arg_names(f, len(primals)))


def arg_names(f: Callable, n: int) -> list[str]:
    """The names of ``f``'s first ``n`` positional parameters (``args[2]`` for a ``*args``), for the comm log
    (``f``'s signature read once: autoshard's replays call ``vjp`` hundreds of times, with ten primals)."""
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        return [f"arg{i}" for i in range(n)]
    return [_arg_name(params, i) for i in range(n)]


def _arg_name(params: list, i: int) -> str:
    for j, p in enumerate(params):
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return f"{p.name}[{i - j}]"
        if j == i and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            return p.name
    return f"arg{i}"


def _vjp(f: Callable, primals: Sequence, has_aux: bool, names: Sequence[str], params: bool = True,
         bucket_bytes: int | None = None, grad_specs: Sequence[Any] | None = None, raw: bool = False,
         who: str = "vjp"):
    """``raw``: the cotangents as the pass leaves them (pending sums pending, None where none reached), for a pass
    nested in another's backward (``nb.checkpoint``'s recompute): the enclosing pass sums each gradient once, at
    its own leaf, under its parameter's name. ``who``: the call the user made, which errors name. The links made
    are the call's when it is the outermost differentiation (``trace.taping``): ``vjp_fn`` reads them, so they go
    when it does (those nothing after it reads)."""
    with taping(end=False) as tape:
        got = _vjp_run(f, primals, has_aux, names, params, bucket_bytes, grad_specs, raw, who)
        if tape is not None:  # (not at exit: the table goes with the interpreter)
            weakref.finalize(got[1], tape.end).atexit = False
        return got


def _vjp_run(f: Callable, primals: Sequence, has_aux: bool, names: Sequence[str], params: bool,
             bucket_bytes: int | None, grad_specs: Sequence[Any] | None, raw: bool, who: str):
    flat, trees, traced, labels = [], [], [], {}
    for i, p in enumerate(primals):
        leaves, tree = flatten(p)
        leaves = [as_tensor(x, who) for x in leaves]
        flat.append(leaves)
        trees.append(tree)
        traced.append([traced_leaf(x, who) for x in leaves])
        if params:  # to a memory log: the values being differentiated are the parameters (the caller holds them)
            C.tag(leaves + traced[-1], "params")
        for t, path in zip(traced[-1], leaf_paths(p, names[i])):
            labels[by_link(t)] = f"grad of {path}"  # the comm log names a gradient's sums after its parameter
    with differentiating():
        res = f(*(unflatten(t, lv) for t, lv in zip(trees, traced)))
    if has_aux:
        if not (isinstance(res, tuple) and len(res) == 2):
            raise ShardingError(f"{who}: with has_aux=True, f must return (output, aux)")
        res, aux = res
        if not outer_live():  # returned as values: no record keeps f's activations alive
            aux_leaves, aux_tree = flatten(aux)
            aux = unflatten(aux_tree, [detach(x) for x in aux_leaves])
    out_leaves, out_tree = flatten(res)
    for o in out_leaves:
        if not isinstance(o, Tensor):
            raise ShardingError(f"{who}: f must return tensors, got {type(o).__name__}")

    def vjp_fn(cotangent: Any):
        cts, ct_tree = flatten(cotangent)
        if len(cts) != len(out_leaves):
            raise ShardingError(f"vjp: the cotangent has {len(cts)} leaves but the output has {len(out_leaves)}")
        cts = [as_tensor(c, "vjp") for c in cts]
        for o, c in zip(out_leaves, cts):
            if o.shape != c.shape:
                raise ShardingError(f"vjp: cotangent of shape {c.shape} for an output of shape {o.shape}")
        specs = None
        if grad_specs is not None:
            specs = [s for fl, tree, gs in zip(flat, trees, grad_specs) for s in _grad_specs(unflatten(tree, fl), gs)]
        ids = [by_link(t) for tr in traced for t in tr]
        if raw:
            got = backward_pass(out_leaves, cts, ids, labels, None)
            live = outer_live()
            grads = [_raw(got.get(i), x, live) for i, x in zip(ids, (x for fl in flat for x in fl))]
        else:
            finish = Finisher([t for tr in traced for t in tr], [x for fl in flat for x in fl], labels,
                               bucket_bytes, specs)
            grads = finish.done(backward_pass(out_leaves, cts, ids, labels, finish))
        grads = [grads[sum(map(len, traced[:k])):sum(map(len, traced[:k + 1]))] for k in range(len(traced))]
        if params:
            C.tag([g for gs in grads for g in gs if isinstance(g, Tensor)], "grads")
        return tuple(unflatten(tree, gs) for tree, gs in zip(trees, grads))

    # inside an enclosing differentiation the result stays recorded: the outer pass differentiates through it
    out = unflatten(out_tree, out_leaves if outer_live() else [detach(o) for o in out_leaves])
    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def _raw(g: Tensor | None, primal: Tensor, live: bool) -> Tensor | None:
    """A cotangent handed to an enclosing pass: in the primal's dtype (a local cast), its sums left pending."""
    if g is None:
        return None
    if g.dtype != primal.dtype:
        with C.phase("backward"):
            g = g.astype(primal.dtype)
    return g if live else detach(g)


def _grad_specs(primal: Any, given: Any) -> list:
    """Per leaf of the argument ``primal``, the layout its gradient is summed into (``given``: a pytree like it, of
    ShardingSpecs or dim-spec lists; None leaves keep the primal's)."""
    return specs_like(primal, given, "grad")


def value_and_grad(f: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   bucket_bytes: int | None = None, grad_specs: Any = None) -> Callable:
    """``(value, grads) = nb.value_and_grad(f)(*args)``; ``f`` returns a scalar tensor (or (scalar, aux)).
    ``bucket_bytes``: the data-parallel sums of gradients (one all_reduce each) are fused into buckets of at most
    that many bytes per device, packed in the order of the arguments, as PyTorch's DDP does; the comm log shows
    one all_reduce per bucket. None (the default): one sum per gradient. ``grad_specs`` (a pytree like the
    differentiated arguments, or a tuple of them for several ``argnums``; ShardingSpecs or dim-spec lists): the
    layouts the gradients are summed into instead of their parameters' (ZeRO stage 2: gradients
    reduce_scattered over the data-parallel axis, never whole on any device)."""
    return _value_and_grad(f, argnums, has_aux, bucket_bytes, grad_specs, "value_and_grad")


def _value_and_grad(f: Callable, argnums: int | Sequence[int], has_aux: bool, bucket_bytes: int | None,
                    grad_specs: Any, name: str) -> Callable:
    """``value_and_grad``, its errors naming ``name``: the call the user made (``grad`` or ``value_and_grad``)."""
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or
                                     bucket_bytes <= 0):
        raise ShardingError(f"{name}: bucket_bytes must be a positive int (bytes per device) or None, got "
                            f"{bucket_bytes!r}")
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    @functools.wraps(f, updated=())  # (its name and parameters, what ONNX export and the comm log name inputs
    # after; not its __dict__: a jitted f's would make an outer nb.jit of this call f instead)
    def wrapped(*args, **kwargs):
        for n in nums:
            if not -len(args) <= n < len(args):
                raise ShardingError(f"{name}: argnums {argnums} out of range for {len(args)} positional arguments")
        seen = [n % len(args) for n in nums]
        if len(set(seen)) != len(seen):  # each would get a separate copy and only one of them the gradient
            dup = next(n for n in seen if seen.count(n) > 1)
            raise ShardingError(f"{name}: argnums {argnums} names argument {dup} more than once; name each argument "
                                f"once (jax.grad fails on repeated argnums too)")

        def g(*diff):
            full = list(args)
            for n, d in zip(nums, diff):
                full[n] = d
            return f(*full, **kwargs)

        names = arg_names(f, len(args))
        with taping():  # an outermost differentiation's links go when it returns (those nothing after it reads)
            return _call(g, args, nums, names)

    def _call(g: Callable, args: tuple, nums: tuple, names: list) -> Any:
        res = _vjp(g, [args[n] for n in nums], has_aux, [names[n % len(args)] for n in nums],
                   bucket_bytes=bucket_bytes, grad_specs=None if grad_specs is None else
                   ((grad_specs,) if single else tuple(grad_specs)), who=name)
        out, fn = res[0], res[1]
        if not isinstance(out, Tensor) or out.shape != ():
            shape = getattr(out, "shape", None)
            raise ShardingError(f"{name}: f must return a scalar (0-d) tensor, got {type(out).__name__}"
                                + (f" of shape {shape}" if shape is not None else ""))
        if not is_float(out.dtype):  # jax.grad's rule, with its reasons
            why = ("For holomorphic differentiation of a complex function, or a non-holomorphic one with complex "
                   "outputs, use nb.vjp directly" if out.dtype.kind == "c" else
                   "For differentiation of functions with integer outputs, use nb.vjp directly")
            raise ShardingError(f"{name}: requires real-valued outputs (a floating dtype), but got {out.dtype} "
                                f"(nb.grad is not holomorphic). {why}.")
        with C.phase("backward"):  # the seed is the backward pass's first value, not one kept for it
            seed = ones_seed(out)
        grads = fn(seed)
        grads = grads[0] if single else grads
        return ((out, res[2]), grads) if has_aux else (out, grads)

    return wrapped


def grad(f: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         bucket_bytes: int | None = None, grad_specs: Any = None) -> Callable:
    """``nb.grad(f)(*args)``: the gradient of scalar ``f`` with respect to ``args[argnums]`` (``bucket_bytes`` and
    ``grad_specs``: as ``value_and_grad``'s)."""
    vg = _value_and_grad(f, argnums, has_aux, bucket_bytes, grad_specs, "grad")

    @functools.wraps(f, updated=())
    def wrapped(*args, **kwargs):
        (value, grads) = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


# ---- rematerialisation ------------------------------------------------------------------------------------------

#: what ``policy="save_matmuls"`` keeps from the forward run (the rest is recomputed)
_MATMULS = frozenset({"matmul", "einsum", "conv"})


def checkpoint(fn: Callable, policy: str = "full") -> Callable:
    """``nb.checkpoint(fn)``: differentiated, ``fn`` keeps nothing of its forward run for the backward pass; its
    gradient runs ``fn``'s forward again first (a recompute, its steps in phase ``"recompute"``, their
    collectives in the comm log and their FLOPs in ``nb.flops``), then its backward. ``policy="save_matmuls"``
    keeps the outputs of its matmuls (einsums, convolutions) and recomputes the rest. As ``jax.checkpoint``.
    ``policy="regather"`` recomputes only gathers: ``fn`` keeps what its ops' VJPs read, except that a value an
    all_gather made (``with_sharding``, or an op gathering its operand) is kept as the shard it was gathered from
    and gathered again, once, in the backward pass (Megatron-LM's sequence parallelism: a norm's output kept 1/t
    as large, one all_gather more). Without it, an activation an op gathers is gathered once and that copy serves
    its later uses, the backward pass's included, as XLA keeps it."""
    if policy not in ("full", "save_matmuls", "regather"):
        raise ShardingError(f"checkpoint: policy must be 'full', 'save_matmuls' or 'regather', got {policy!r}")
    name = getattr(fn, "__name__", "fn")
    if policy == "regather":
        def regathered(*args: Any) -> Any:
            with regathering():
                return fn(*args)

        regathered.__name__ = f"checkpoint_{name}"
        return regathered

    def wrapped(*args: Any) -> Any:
        if not recording():  # nothing is differentiated: an ordinary call
            return fn(*args)
        leaves, tree = flatten(args)
        diff = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and getattr(link_of(x), "diff", False)]
        keep = Remat(_MATMULS if policy == "save_matmuls" else frozenset())
        # no link: nothing of fn's run is kept but what ``keep`` holds; the watch notes what fn closes over
        with watching(Watch(leaves[i] for i in diff)) as watch, remat(keep):
            out = fn(*args)
        outer = list(watch.seen.values())  # differentiated tensors fn reads but was not given: their gradients too
        if not diff and not outer:
            return out
        outs, out_tree = flatten(out)
        for o in outs:
            if not isinstance(o, Tensor):
                raise ShardingError(f"checkpoint: {name} must return tensors (or pytrees of them), got "
                                    f"{type(o).__name__}")
        op = VjpOp(f"checkpoint({name})", _recompute_vjp(fn, tree, leaves, diff, outer, keep))
        inputs = tuple(leaves[i] for i in diff) + tuple(outer)
        res = []
        for k, o in enumerate(outs):
            # the same value fn made (its bytes counted once, where fn made it)
            res.append(record(o.twin(), op, (k,), inputs, diff=True))
        return unflatten(out_tree, res)

    wrapped.__name__ = f"checkpoint_{name}"
    return wrapped


def _recompute_vjp(fn: Callable, tree: Any, leaves: list, diff: list, outer: list, keep: Any) -> Callable:
    def vjp_fn(g: Tensor, node: Any, out: Tensor) -> tuple:
        k = node.params[0]

        def again(*variables):
            full = list(leaves)
            for i, v in zip(diff, variables):
                full[i] = v
            # the closed-over tensors fn reads are the recompute's variables too: its links read their twins
            with swapped({id(w): v for w, v in zip(outer, variables[len(diff):])}):
                outs, _ = flatten(fn(*unflatten(tree, full)))
            return outs[k]

        again_keep = Remat(keep.ops)  # the recompute: matmul outputs handed back in order, gathered operands kept
        again_keep.saved, again_keep.gather = keep.saved, True
        if keep.ops:
            again_keep.replay = iter(keep.saved)
        with taping():  # (its own tape in an eager ``.backward()``: its links go once its gradients are made)
            with recorded(), remat(again_keep), C.phase("recompute"):
                _, back = _vjp(again, node.args, False, [f"recompute[{i}]" for i in range(len(node.args))], False,
                               raw=True)
            return back(g)

    return vjp_fn


# ---- the Nabla sharding README's spelling ----------------------------------------------------------------------------------


def trace(t: Tensor) -> Tensor:
    """``x = t.trace()``: a leaf whose gradient ``loss.backward()`` will store in ``x.grad``."""
    return traced_leaf(t, "trace")


def backward(out: Tensor, cotangent: Any = None) -> None:
    """``loss.backward()``: every traced leaf ``loss`` depends on gets (or adds to) its ``.grad``."""
    if link_of(out) is None:
        raise ShardingError("backward: this tensor does not depend on any traced tensor (use x = t.trace())")
    if cotangent is None:
        if out.shape != ():
            raise ShardingError(f"backward: a tensor of shape {out.shape} needs a cotangent; only a scalar's is 1")
        with C.phase("backward"):
            cotangent = ones_seed(out)
    got = backward_pass([out], [as_tensor(cotangent, "backward")])
    for v, node, _ in topological([out]):
        if node.op == LEAF and id(node) in got:
            g, = Finisher([v], [v], None).done(got)
            v.grad = g if v.grad is None else v.grad + g
            if link_of(v.grad) is not None:  # (inside a differentiation: recorded, and made from ``v``)
                held_grad(v)


def _trace_method(self: Tensor) -> Tensor:
    """A leaf to differentiate with respect to: after ``loss.backward()``, its ``.grad`` holds the gradient."""
    return trace(self)


def _backward_method(self: Tensor, cotangent: Any = None) -> None:
    """Accumulate into ``.grad`` of every traced leaf this value depends on (a scalar's cotangent is 1)."""
    backward(self, cotangent)


# the Nabla sharding README's spelling (t.trace(), loss.backward(); nb.grad and friends are the functional form),
# set here, where it is answered: tensor.py sits below this module
_trace_method.__name__, _trace_method.__qualname__ = "trace", "Tensor.trace"
_backward_method.__name__, _backward_method.__qualname__ = "backward", "Tensor.backward"
Tensor.trace = _trace_method  # type: ignore[attr-defined]
Tensor.backward = _backward_method  # type: ignore[attr-defined]
