"""Reverse-mode differentiation over the trace: ``grad``, ``value_and_grad``, ``vjp`` (JAX's meanings, over
pytrees) and the Nabla sharding README's ``t.trace()`` / ``loss.backward()`` / ``.grad``. The backward pass runs each op's VJP
(registered next to its rule and kernel) with nabla ops, so it goes through the same propagation and planner
and its collectives show in the comm log as ``backward``; each gradient ends with its primal's dim specs."""

from __future__ import annotations

import contextlib
import inspect
from math import prod
from typing import Any, Callable, Sequence

import numpy as np

from .dtypes import is_float, is_inexact
from . import collectives as C
from .errors import ShardingError
from .lax import as_manual, in_vjp, manual_constant, out_vjp, settle
from .manual import ManualSpec
from .shard_map import SM_IN, SM_OUT
from .executor import relayout_bucket
from .pytree import flatten, leaf_paths, unflatten
from .sharding import specs_like
from .spec import ShardingSpec
from .layout import chunks
from .step import serial
from .tensor import Tensor
from .trace import (HUSK, LEAF, PLACE, RELAYOUT, Node, Remat, Watch, by_node, differentiating, husk, outer_live,
                    paused, recorded, recording, regathering, remat, swapped, topological, tracing_for_replay,
                    tracing_whole, watching)
from .ops import getitem
from .ops import add
from .ops import tensor
from .ops.creation import zeros, zeros_as
from .reshard import plan
from .ops import ones
from .ops import abstract

# ---- the engine ----------------------------------------------------------------------------------------


def _as_tensor(x: Any, what: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (np.ndarray, float, int, np.generic)):
        return tensor(x)
    raise ShardingError(f"{what}: expected a Tensor (or an array), got {type(x).__name__}")


def _leaf(t: Tensor, what: str) -> Tensor:
    """A traced twin of ``t``: the same blocks, recording every op that uses it."""
    if not is_inexact(t.dtype):
        raise ShardingError(f"{what}: differentiating with respect to a {t.dtype} tensor of shape {t.shape}; "
                            f"gradients need float or complex inputs (cast with .astype('float32'))")
    leaf = Tensor(t._data, t._spec, t._shape, t._dtype, t._sid)
    # a leaf made from a traced value remembers it (a whole-program trace computes it from there)
    # (each leaf its own node: a backward pass names values by their node)
    leaf._node = Node(LEAF, GRAD_LEAF.params, () if t._node is None else (t,), diff=True)
    leaf._serial = serial(t)  # the same value: steps that read the leaf read ``t``
    return leaf


GRAD_LEAF = Node(LEAF, ("autodiff",), diff=True)  # a value being differentiated (not a twin nb.explain or ONNX export traces)


def _from_local_vjp(g, node, out):
    """Each block that the value was assembled from gets its block of the cotangent: the device holding it
    (a replica that was only checked against it gets none; every summand of a partial value gets it)."""
    spec, devices, holders = node.params
    return tuple(getitem(g, spec.shard_slices(out.shape, d)) if d in holders else None for d in devices)


_FROM_LOCAL = None


def record_from_local(out: Tensor, blocks: dict, spec: Any, holders: set) -> None:
    """``nb.from_local`` of traced blocks: the result records them, so gradients reach them."""
    global _FROM_LOCAL
    if not recording():
        return
    if _FROM_LOCAL is None:
        _FROM_LOCAL = _Op("from_local", _from_local_vjp)
    devices = tuple(blocks)
    out._node = Node(_FROM_LOCAL, (spec, devices, frozenset(holders)), tuple(blocks[d] for d in devices))


def _detach(t: Any) -> Any:
    """The value without its record (a whole-program trace, nb.jit's, keeps it: the value is computed there)."""
    if isinstance(t, Tensor) and t._node is not None and not tracing_whole():
        out = Tensor(t._data, t._spec, t._shape, t._dtype, t._sid)
        out._serial = serial(t)
        return out
    return t


def _unreduced(c: Tensor, v: Any) -> tuple:
    """The mesh axes along which cotangent ``c`` varies but per-device value ``v`` does not."""
    cs, vs = getattr(c, "_spec", None), getattr(v, "_spec", None)
    if not isinstance(cs, ManualSpec) or not isinstance(vs, ManualSpec):
        return ()
    return tuple(a for a in cs.varying if a not in vs.varying)


class _Op:
    """A node op that runs no kernel (autodiff's own records): its name and its VJP."""

    def __init__(self, name: str, vjp: Callable) -> None:
        self.name, self.vjp = name, vjp

    def __repr__(self) -> str:
        return f"_Op({self.name})"


# a sharded gradient read back for a host primal: its cotangent is the host cotangent, as it is
_TO_HOST = _Op("gather to host", lambda g, node, out: (g,))


def backward_pass(outputs: Sequence[Tensor], cotangents: Sequence[Tensor],
                  wrt: Sequence[int] | None = None, labels: dict[int, str] | None = None,
                  ready: Callable[[int, Tensor], None] | None = None) -> dict[int, Tensor]:
    """Cotangents of the traced leaves the outputs depend on, by ``id`` of the leaf: the leaves whose ids are
    in ``wrt`` (``vjp``'s), or every LEAF node (``backward()``). A leaf of an inner differentiation made from a
    traced value is, to an outer pass, that value itself. Inside an enclosing differentiation the ops of this
    pass are recorded (so a gradient of a gradient differentiates them); otherwise they record nothing.
    Collectives are logged under the public op each VJP belongs to (``softmax``, not the ``max`` inside it),
    and the sums of cotangents under the value they are for (``grad of p['w1']`` for a leaf in ``labels``).
    ``ready(leaf id, cotangent)`` is called as each leaf's cotangent is complete, in the order the pass completes
    them (so a gradient is summed while the pass goes on, as DDP's hooks do, not held raw to the end)."""
    stop = None if wrt is None else set(wrt)
    key = by_node  # values are named by their node: a husk a node keeps stands for the value it was made from
    order = topological(outputs, stop, key)
    is_leaf = (lambda v: v._node.op == LEAF) if stop is None else (lambda v: key(v) in stop)
    needed: set[int] = set()  # the values that depend on a leaf: only their cotangents are worth computing
    for v in order:
        if is_leaf(v) or any(getattr(a, "_node", None) is not None and key(a) in needed for a in v._node.args):
            needed.add(key(v))
    # cotangents by value, grouped by the mesh axes along which they vary but the value does not (per-device
    # code: contributions that are still per-device summands); a plain value has one group, ()
    ct: dict[int, dict[tuple, Tensor]] = {}
    leaves: dict[int, Tensor] = {}

    def label(a) -> str:
        return (labels or {}).get(key(a)) or (a._node.name if a._node.op != LEAF else "grad of a traced tensor")

    def accumulate(a, c):
        extra = _unreduced(c, a)
        groups = ct.setdefault(key(a), {})
        if extra not in groups:
            groups[extra] = c
        else:
            with C.user_op(label(a)):
                groups[extra] = add(groups[extra], c)

    # a leaf's cotangent is complete once every op that uses it has run its VJP: counted, so it is finished then
    users: dict[int, int] = {}
    if ready is not None:
        for v in order:
            for a in v._node.args:
                if getattr(a, "_node", None) is not None and key(a) in needed and is_leaf(a):
                    users[key(a)] = users.get(key(a), 0) + 1
    finished: set[int] = set()
    regathered: dict = {}  # (source, layout) -> the source gathered again, once per backward pass

    def total(v):
        """``v``'s cotangent: its contributions summed (per-device summands over their axes: a psum)."""
        groups = ct.pop(key(v), None)
        if groups is None:
            return None
        g = None
        with C.user_op(label(v)):
            for extra, part in groups.items():
                part = settle(part, v) if extra else part
                g = part if g is None else add(g, part)
        return g

    def leaf_done(v) -> None:
        finished.add(key(v))
        g = total(v)
        if g is not None and not (ready is not None and ready(key(v), g)):
            leaves[key(v)] = g  # (a gradient the finisher took is not kept: its raw sum dies once finished)

    def used(node) -> None:
        for a in node.args:
            k = key(a) if getattr(a, "_node", None) is not None else None
            if k in users:
                users[k] -= 1
                if users[k] == 0:
                    leaf_done(a)

    with (contextlib.nullcontext() if outer_live() else paused()), C.phase("backward"):
        for o, c in zip(outputs, cotangents):
            if getattr(o, "_node", None) is not None and key(o) in needed:
                accumulate(o, c)
        for v in reversed(order):
            if key(v) not in needed or key(v) in finished:
                continue
            if is_leaf(v):
                leaf_done(v)
                continue
            node = v._node
            if node.op == SM_IN or getattr(node.op, "raw_cotangent", False):
                # these transpose each group as it is (into shard_map: partial sums over its axes; all_gather: a
                # psum_scatter of the summands along the gathered axes)
                groups = ct.pop(key(v), None)
                for g in (groups or {}).values():
                    fn = in_vjp if node.op == SM_IN else node.op.vjp
                    with C.user_op(node.user or ("shard_map" if node.op == SM_IN else node.op.name)):
                        parts = fn(g, node, v)
                    for arg, c in zip(node.args, parts):
                        if c is not None and getattr(arg, "_node", None) is not None and key(arg) in needed:
                            accumulate(arg, c)
                used(node)
                continue
            g = total(v)
            if g is None:
                used(node)
                continue
            if node.op == RELAYOUT:  # the transpose of a move: the cotangent laid out as the moved value was
                parts = (_transposed(g, node.args[0]) if node.prog is not None and node.prog.collectives else g,)
            elif node.op in (PLACE, LEAF):  # the same value (an inner pass's leaf; a host value placed)
                parts = (g,)
            elif node.op == SM_OUT:  # out of nb.shard_map
                with C.user_op(node.user or "shard_map"):
                    parts = out_vjp(g, node, v)
            else:
                if node.op.vjp is None:
                    raise ShardingError(f"grad: op {node.op.name} has no derivative")
                with C.user_op(node.name), C.in_scope(node.scope):
                    g = _summed_before_fan_out(g, node, needed)
                    if node.regather:
                        node = _regathered(node, regathered)
                    out = v if node.out is None else husk(v) if node.out is HUSK else node.out
                    parts = node.op.vjp(g, node, out)
            for arg, c in zip(node.args, parts):
                if c is not None and getattr(arg, "_node", None) is not None and key(arg) in needed:
                    accumulate(arg, c)
            used(node)
    return leaves


def _regathered(node: Node, done: dict) -> Node:
    """``node`` with each operand it kept as the value it was gathered from gathered again (once per pass)."""
    args = list(node.args)
    for i, src, layout in node.regather:
        k = (id(src), layout)
        got = done.get(k)
        if got is None:
            got = src.with_sharding(layout)  # (a step of the backward pass: its all_gather is logged there)
            got._node = args[i]._node  # the operand it stands for (its cotangent goes there)
            done[k] = got
        args[i] = got
    return node._replace(args=tuple(args), regather=())



def _transposed(g: Tensor, src: Any) -> Tensor:
    """The cotangent of ``with_sharding(src, target)``: ``g`` laid out as ``src`` was (its dims; the pending sums
    ``g`` carries that those dims do not use stay pending). So each move's transpose is the cheap one: an
    all_gather's is a reduce_scatter, a reduce_scatter's an all_gather (sequence parallelism's backward), an
    all_to_all's the reverse all_to_all. (A move that only cut blocks locally is left as its cotangent comes:
    sliced blocks, gathered only where a later op or the gradient's layout needs them.)"""
    spec, own = g.sharding, getattr(src, "_spec", None)
    if not isinstance(spec, ShardingSpec) or not isinstance(own, ShardingSpec) or spec.mesh != own.mesh:
        return g
    used = {r for refs in own.dim_refs for r in refs}
    keep = [a for a, r in zip(spec.partial_axes, spec.partial_refs) if not any(r.overlaps(u) for u in used)]
    target = ShardingSpec(own.mesh, [type(d)(d.axes) for d in own.dim_specs], own.replicated_axes, keep)
    if target.layout() == spec.layout():
        return g
    return g.with_sharding(target)


#: ops whose VJP hands every operand the cotangent itself (or its negation): the operands' cotangents are the
#: same pending sum, made once when summed (``Value._moved``), so it may stay pending
_PASS_THROUGH = frozenset({"add", "subtract", "concatenate", "where"})


def _summed_before_fan_out(g: Tensor, node: Any, needed: set) -> Tensor:
    """A cotangent still a pending sum, entering a VJP that makes it into the cotangents of two operands or more,
    is summed first, once: each derived cotangent would otherwise carry the sum pending and need its own (the
    backward of a norm's scale, as Megatron's plan has it: the activation gradient summed over tp once, the
    scale's gradient summed over dp only). The backward's own `pending.repeated_partials`.

    A pass-through op's operands share the cotangent itself, one pending sum made at most once, except an operand
    it broadcast (a norm's bias): that one's cotangent is ``g`` summed over the broadcast dims, a second value
    with a pending sum of its own. The sum is then made here when an operand that shares ``g`` would make it at
    its own VJP anyway (the norm's scale product fans it out next): one op earlier, it serves the bias too, as
    Megatron's does. Otherwise the bias's own small sum is the cheaper one. Likewise when the operands' cotangents
    together are smaller than ``g`` (a norm whose input needs none: its scale's and bias's are reductions of
    ``g``), each is summed on its own, two (D,) vectors rather than the activation."""
    spec = g.sharding
    if spec is None or isinstance(spec, ManualSpec) or not spec.partial_axes:
        return g
    takers = _takers(node, needed)
    if len(takers) < 2:
        return g
    if getattr(node.op, "name", "") in _PASS_THROUGH:
        shared = [a for a in takers if a.shape == g.shape]
        if len(shared) == len(takers) or not any(_fans_out(a._node, needed) for a in shared):
            return g
    elif sum(prod(a.shape) for a in takers) < prod(g.shape):
        return g
    return g.with_sharding(spec.mesh, spec.dim_specs, spec.replicated_axes)


def _takers(node: Any, needed: set) -> list:
    """The operands of ``node`` that a cotangent flows to."""
    return [a for a in node.args if isinstance(a, Tensor) and a._node is not None and a._node.diff and
            by_node(a) in needed]


def _fans_out(node: Any, needed: set) -> bool:
    """Whether ``node``'s VJP sums a pending cotangent before it runs (``_summed_before_fan_out``'s first rule)."""
    op = getattr(node.op, "name", None)
    return op is not None and op not in _PASS_THROUGH and getattr(node.op, "vjp", None) is not None and \
        len(_takers(node, needed)) >= 2


def _to_host(g: Tensor) -> Tensor:
    """A sharded gradient as a host tensor (a host read), still differentiable when it is being recorded."""
    out = Tensor(None, None, g.shape, g.dtype) if g.is_abstract else tensor(g.numpy())
    if g._node is not None and recording() and not tracing_whole():
        out._node = Node(_TO_HOST, (), (g,))
    return out


def _finish(g: Tensor | None, primal: Tensor, spec: Any = "primal") -> Tensor:
    """A gradient as its primal is laid out (or as ``spec``): same shape, dtype and dim specs, no pending sums."""
    spec = primal.sharding if spec == "primal" else spec
    with C.phase("backward"):
        if isinstance(spec, ManualSpec):  # a per-device value (differentiated inside nb.shard_map)
            g = manual_constant(0.0, primal) if g is None else as_manual(g, spec.mesh)
            return g if g.dtype == primal.dtype else g.astype(primal.dtype)
        if g is None:  # made as its blocks (abstract in an abstract run): no global array of zeros
            if not tracing_for_replay():
                return zeros_as(primal, spec)
            g = zeros(primal.shape, primal.dtype)  # a constant of the program nb.jit (nb.vmap) runs
            return g if spec is None else g.shard(spec.mesh, spec.dim_specs)
        if g.dtype != primal.dtype:
            g = g.astype(primal.dtype)
        if spec is None:
            return g if g.sharding is None else _to_host(g)
        if g.sharding is None:
            return g.shard(spec.mesh, spec.dim_specs)
        dims = [type(d)(d.axes) for d in spec.dim_specs]  # closed: exactly the primal's axes
        return g.with_sharding(spec.mesh, dims)


class _Finisher:
    """Gradients finished as the backward pass completes them: each laid out as its primal (or as ``specs``
    says), detached unless an enclosing differentiation needs them; the final sums and moves are logged as
    ``grad of <parameter path>``. With ``bucket_bytes``, gradients whose sum is one all_reduce wait in a bucket
    of at most that many bytes per device, summed together when it fills (DDP's buckets, in the order the pass
    completes them)."""

    def __init__(self, traced: Sequence[Tensor], primals: Sequence[Tensor], labels: dict[int, str] | None,
                 bucket_bytes: int | None = None, specs: Sequence[Any] | None = None) -> None:
        self.index = {by_node(t): i for i, t in enumerate(traced)}
        self.traced, self.primals, self.labels = traced, primals, labels or {}
        self.bucket_bytes, self.specs = bucket_bytes, specs
        self.out: list = [None] * len(traced)
        self.bucket: list = []  # (index, partial gradient, target)
        self.size = 0
        self.live = outer_live()

    def _label(self, i: int) -> str:
        return self.labels.get(by_node(self.traced[i]), "grad of a traced tensor")

    def __call__(self, leaf: int, g: Tensor | None) -> bool:
        """Finish (or bucket) the gradient of ``leaf``; whether it was taken."""
        i = self.index.get(leaf)
        if i is None or self.out[i] is not None:
            return False
        x = self.primals[i]
        spec = x.sharding if self.specs is None or self.specs[i] is None else self.specs[i]
        with (contextlib.nullcontext() if self.live else paused()), C.user_op(self._label(i)):
            target = _bucketable(g, x, spec) if self.bucket_bytes is not None else None
            if target is None:
                self.out[i] = _finish(g, x, spec)
                return True
            g = g if g.dtype == x.dtype else g.astype(x.dtype)
        nbytes = prod(chunks(target, g.shape)) * g.dtype.itemsize  # each device's block, as DDP's buffers
        key = (target.mesh, g.sharding.partial_axes)
        if self.bucket and (key != self._key or self.size + nbytes > self.bucket_bytes):
            self.flush()
        self.bucket.append((i, g, target))
        self._key, self.size = key, self.size + nbytes
        return True

    def flush(self) -> None:
        if not self.bucket:
            return
        bucket, self.bucket, self.size = self.bucket, [], 0
        names = ", ".join(self._label(i)[len("grad of "):] for i, _, _ in bucket)
        with (contextlib.nullcontext() if self.live else paused()), C.user_op(f"grad of {names} (one bucket)"), \
                C.phase("backward"):
            summed = relayout_bucket([g for _, g, _ in bucket], [t for _, _, t in bucket], Tensor)
        for (i, _, _), g in zip(bucket, summed):
            self.out[i] = g

    def done(self, got: dict[int, Tensor]) -> list[Tensor]:
        """Every gradient: the ones the pass never reached (no path from the output) are zeros."""
        self.flush()
        for i, t in enumerate(self.traced):
            if self.out[i] is None:
                self(by_node(t), got.get(by_node(t)))
        self.flush()
        return self.out if self.live else [_detach(g) for g in self.out]


def _bucketable(g: Tensor | None, primal: Tensor, spec: Any) -> Any:
    """The layout ``g`` is summed into when that is exactly one all_reduce (a data-parallel gradient), else None."""
    if g is None or spec is None or isinstance(spec, ManualSpec) or g.sharding is None or \
            not g.sharding.partial_axes:
        return None
    target = type(spec)(spec.mesh, [type(d)(d.axes) for d in spec.dim_specs])
    steps = plan(g.shape, primal.dtype.itemsize, g.sharding, target).collectives
    return target if len(steps) == 1 and steps[0].kind == "all_reduce" else None


def _ones_like(t: Tensor) -> Tensor:
    if isinstance(t.sharding, ManualSpec):
        return manual_constant(1.0, t)
    if t._data is None and not tracing_for_replay():  # an abstract run (not a trace nb.jit or nb.vmap runs
        # again, whose constants hold data): the seed is abstract too, or the whole backward pass would hold data
        one = abstract(t.shape, t.dtype)
    else:
        one = ones(t.shape, t.dtype)
    return one if t.sharding is None else one.shard(t.mesh, [() for _ in t.shape])


def vjp(f: Callable, *primals: Any, has_aux: bool = False):
    """``out, vjp_fn = nb.vjp(f, *primals)``: ``vjp_fn(cotangent)`` returns one gradient pytree per primal."""
    return _vjp(f, primals, has_aux, [arg_name(f, i) for i in range(len(primals))])


def arg_name(f: Callable, i: int) -> str:
    """The name of ``f``'s positional parameter ``i`` (``args[2]`` for a ``*args``), for the comm log."""
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        return f"arg{i}"
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
    its own leaf, under its parameter's name. ``who``: the call the user made, which errors name."""
    flat, trees, traced, labels = [], [], [], {}
    for i, p in enumerate(primals):
        leaves, tree = flatten(p)
        leaves = [_as_tensor(x, who) for x in leaves]
        flat.append(leaves)
        trees.append(tree)
        traced.append([_leaf(x, who) for x in leaves])
        if params:  # to a memory log: the values being differentiated are the parameters (the caller holds them)
            C.tag(leaves + traced[-1], "params")
        for t, path in zip(traced[-1], leaf_paths(p, names[i])):
            labels[by_node(t)] = f"grad of {path}"  # the comm log names a gradient's sums after its parameter
    with differentiating():
        res = f(*(unflatten(t, lv) for t, lv in zip(trees, traced)))
    if has_aux:
        if not (isinstance(res, tuple) and len(res) == 2):
            raise ShardingError(f"{who}: with has_aux=True, f must return (output, aux)")
        res, aux = res
        if not outer_live():  # returned as values: no record keeps f's activations alive
            aux_leaves, aux_tree = flatten(aux)
            aux = unflatten(aux_tree, [_detach(x) for x in aux_leaves])
    out_leaves, out_tree = flatten(res)
    for o in out_leaves:
        if not isinstance(o, Tensor):
            raise ShardingError(f"{who}: f must return tensors, got {type(o).__name__}")

    def vjp_fn(cotangent: Any):
        cts, ct_tree = flatten(cotangent)
        if len(cts) != len(out_leaves):
            raise ShardingError(f"vjp: the cotangent has {len(cts)} leaves but the output has {len(out_leaves)}")
        cts = [_as_tensor(c, "vjp") for c in cts]
        for o, c in zip(out_leaves, cts):
            if o.shape != c.shape:
                raise ShardingError(f"vjp: cotangent of shape {c.shape} for an output of shape {o.shape}")
        specs = None
        if grad_specs is not None:
            specs = [s for fl, tree, gs in zip(flat, trees, grad_specs) for s in _grad_specs(unflatten(tree, fl), gs)]
        ids = [by_node(t) for tr in traced for t in tr]
        if raw:
            got = backward_pass(out_leaves, cts, ids, labels, None)
            live = outer_live()
            grads = [_raw(got.get(i), x, live) for i, x in zip(ids, (x for fl in flat for x in fl))]
        else:
            finish = _Finisher([t for tr in traced for t in tr], [x for fl in flat for x in fl], labels,
                               bucket_bytes, specs)
            grads = finish.done(backward_pass(out_leaves, cts, ids, labels, finish))
        grads = [grads[sum(map(len, traced[:k])):sum(map(len, traced[:k + 1]))] for k in range(len(traced))]
        if params:
            C.tag([g for gs in grads for g in gs if isinstance(g, Tensor)], "grads")
        return tuple(unflatten(tree, gs) for tree, gs in zip(trees, grads))

    # inside an enclosing differentiation the result stays recorded: the outer pass differentiates through it
    out = unflatten(out_tree, out_leaves if outer_live() else [_detach(o) for o in out_leaves])
    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def _raw(g: Tensor | None, primal: Tensor, live: bool) -> Tensor | None:
    """A cotangent handed to an enclosing pass: in the primal's dtype (a local cast), its sums left pending."""
    if g is None:
        return None
    if g.dtype != primal.dtype:
        with C.phase("backward"):
            g = g.astype(primal.dtype)
    return g if live else _detach(g)


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

        res = _vjp(g, [args[n] for n in nums], has_aux, [arg_name(f, n % len(args)) for n in nums],
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
            seed = _ones_like(out)
        grads = fn(seed)
        grads = grads[0] if single else grads
        return ((out, res[2]), grads) if has_aux else (out, grads)

    return wrapped


def grad(f: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         bucket_bytes: int | None = None, grad_specs: Any = None) -> Callable:
    """``nb.grad(f)(*args)``: the gradient of scalar ``f`` with respect to ``args[argnums]`` (``bucket_bytes`` and
    ``grad_specs``: as ``value_and_grad``'s)."""
    vg = _value_and_grad(f, argnums, has_aux, bucket_bytes, grad_specs, "grad")

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
    all_gather made (``with_sharding``) is kept as the shard it was gathered from and gathered again in the
    backward pass (Megatron-LM's sequence parallelism: a norm's output kept 1/t as large, one all_gather more)."""
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
        diff = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and x._node is not None and x._node.diff]
        keep = Remat(_MATMULS if policy == "save_matmuls" else frozenset())
        # no node: nothing of fn's run is kept but what ``keep`` holds; the watch notes what fn closes over
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
        op = _Op(f"checkpoint({name})", _recompute_vjp(fn, tree, leaves, diff, outer, keep))
        inputs = tuple(leaves[i] for i in diff) + tuple(outer)
        res = []
        for k, o in enumerate(outs):
            s = serial(o)
            o = Tensor(o._data, o._spec, o._shape, o._dtype, o._sid)
            o._serial = s  # the same value fn made (its bytes counted once, where fn made it)
            o._node = Node(op, (k,), inputs, diff=True)
            res.append(o)
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
            # the closed-over tensors fn reads are the recompute's variables too: its nodes read their twins
            with swapped({id(w): v for w, v in zip(outer, variables[len(diff):])}):
                outs, _ = flatten(fn(*unflatten(tree, full)))
            return outs[k]

        again_keep = Remat(keep.ops)  # the recompute: matmul outputs handed back in order, gathered operands kept
        again_keep.saved, again_keep.gather = keep.saved, True
        if keep.ops:
            again_keep.replay = iter(keep.saved)
        with recorded(), remat(again_keep), C.phase("recompute"):
            _, back = _vjp(again, node.args, False, [f"recompute[{i}]" for i in range(len(node.args))], False,
                           raw=True)
        return back(g)

    return vjp_fn


# ---- the Nabla sharding README's spelling ----------------------------------------------------------------------------------


def trace(t: Tensor) -> Tensor:
    """``x = t.trace()``: a leaf whose gradient ``loss.backward()`` will store in ``x.grad``."""
    return _leaf(t, "trace")


def backward(out: Tensor, cotangent: Any = None) -> None:
    """``loss.backward()``: every traced leaf ``loss`` depends on gets (or adds to) its ``.grad``."""
    if out._node is None:
        raise ShardingError("backward: this tensor does not depend on any traced tensor (use x = t.trace())")
    if cotangent is None:
        if out.shape != ():
            raise ShardingError(f"backward: a tensor of shape {out.shape} needs a cotangent; only a scalar's is 1")
        with C.phase("backward"):
            cotangent = _ones_like(out)
    got = backward_pass([out], [_as_tensor(cotangent, "backward")])
    for v in topological([out]):
        if v._node.op == LEAF and by_node(v) in got:
            g, = _Finisher([v], [v], None).done(got)
            v.grad = g if v.grad is None else v.grad + g


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
