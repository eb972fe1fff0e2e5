"""The backward pass over the trace: each op's VJP (registered next to its rule and kernel) run with nabla ops, so
it goes through the same propagation and planner and its collectives show in the comm log as ``backward``; and
how a gradient is finished (summed once, in its primal's layout and dtype, bucketed as DDP does). The front-ends
(``vjp``, ``grad``, ``checkpoint``, ``t.backward()``) are ``autodiff``'s."""

from __future__ import annotations

import contextlib
from math import prod
from typing import Any, Callable, Sequence

import numpy as np

from .dtypes import is_inexact
from . import collectives as C
from .errors import ShardingError
from .lax import as_manual, in_vjp, manual_constant, out_vjp, settle
from .manual import ManualSpec
from .shard_map import SM_IN, SM_OUT
from .executor import relayout_bucket
from .spec import ShardingSpec
from .layout import chunks
from .tensor import Tensor
from .trace import (HUSK, LEAF, PLACE, RELAYOUT, Link, by_link, husk, link, link_of, outer_live, paused, record,
                    recording, tracing_for_replay, tracing_whole)
from .ops import getitem
from .ops import add
from .ops import tensor
from .ops.creation import zeros, zeros_as
from .reshard import plan
from .ops import ones
from .ops import abstract

# ---- the engine ----------------------------------------------------------------------------------------


def as_tensor(x: Any, what: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (np.ndarray, float, int, np.generic)):
        return tensor(x)
    raise ShardingError(f"{what}: expected a Tensor (or an array), got {type(x).__name__}")


def topological(outputs, stop=None, by_link: bool = False) -> list[tuple[Any, Link, tuple]]:
    """Every tracked value the outputs depend on, operands before the values made from them, each as (value, its
    link, its operands' names: None for one not linked). A value is named by its ``id``, or with ``by_link`` by
    its link's (a backward pass's names: a husk is the value it stands for); the operands of values whose name is
    in ``stop`` are not visited (a backward pass stops at its own leaves)."""
    order, seen = [], set()
    stack = []
    for v in outputs:
        n = link_of(v)
        if n is not None:
            stack.append((v, n))
    while stack:
        item = stack.pop()
        if len(item) == 3:  # its operands are done
            order.append(item)
            continue
        v, n = item
        k = id(n) if by_link else id(v)
        if k in seen:
            continue
        seen.add(k)
        names, kids = [], []
        for a in n.args:  # (each operand's link looked up once: a backward pass reads the names many times)
            na = link_of(a)
            if na is None:
                names.append(None)
                continue
            name = id(na) if by_link else id(a)
            names.append(name)
            kids.append((a, na, name))
        stack.append((v, n, tuple(names)))
        if stop is not None and k in stop:
            continue
        for a, na, name in kids:
            if name not in seen:
                stack.append((a, na))
    return order


def traced_leaf(t: Tensor, what: str) -> Tensor:
    """A traced twin of ``t``: the same blocks, recording every op that uses it."""
    if not is_inexact(t.dtype):
        raise ShardingError(f"{what}: differentiating with respect to a {t.dtype} tensor of shape {t.shape}; "
                            f"gradients need float or complex inputs (cast with .astype('float32'))")
    # a leaf made from a traced value remembers it (a whole-program trace computes it from there)
    # (each leaf its own link: a backward pass names values by their link); the same value as ``t`` (its serial):
    # steps that read the leaf read ``t``
    return record(t.twin(), LEAF, GRAD_LEAF,
                  () if link_of(t) is None else (t,), diff=True)


GRAD_LEAF = ("autodiff",)  # a leaf's params: a value being differentiated (not a twin nb.explain or ONNX export traces)


def _from_local_vjp(g, node, out):
    """Each block that the value was assembled from gets its block of the cotangent: the device holding it
    (a replica that was only checked against it gets none; every summand of a partial value gets it)."""
    spec, devices, holders = node.params
    return tuple(getitem(g, spec.shard_slices(out.shape, d)) if d in holders else None for d in devices)


def from_local_record(out: Tensor, blocks: dict, spec: Any, holders: set) -> Tensor:
    """``out``, made by ``nb.from_local`` of traced blocks (device -> block), linked to them on the tape so that
    gradients reach them (when ops are recorded)."""
    if not recording():
        return out
    devices = tuple(blocks)
    return record(out, _FROM_LOCAL, (spec, devices, frozenset(holders)), tuple(blocks[d] for d in devices))


def detach(t: Any) -> Any:
    """The value without its record (a whole-program trace, nb.jit's, keeps it: the value is computed there)."""
    if isinstance(t, Tensor) and link_of(t) is not None and not tracing_whole():
        return t.twin()
    return t


def _unreduced(c: Tensor, v: Any) -> tuple:
    """The mesh axes along which cotangent ``c`` varies but per-device value ``v`` does not."""
    cs, vs = getattr(c, "_spec", None), getattr(v, "_spec", None)
    if not isinstance(cs, ManualSpec) or not isinstance(vs, ManualSpec):
        return ()
    return tuple(a for a in cs.varying if a not in vs.varying)


class VjpOp:
    """The op of a link no kernel ran as (autodiff's own records): its name and its VJP."""

    def __init__(self, name: str, vjp: Callable) -> None:
        self.name, self.vjp = name, vjp

    def __repr__(self) -> str:
        return f"VjpOp({self.name})"


_FROM_LOCAL = VjpOp("from_local", _from_local_vjp)


# a sharded gradient read back for a host primal: its cotangent is the host cotangent, as it is
_TO_HOST = VjpOp("gather to host", lambda g, node, out: (g,))


def backward_pass(outputs: Sequence[Tensor], cotangents: Sequence[Tensor],
                  wrt: Sequence[int] | None = None, labels: dict[int, str] | None = None,
                  ready: Callable[[int, Tensor], None] | None = None) -> dict[int, Tensor]:
    """Cotangents of the traced leaves the outputs depend on, by ``id`` of the leaf: the leaves whose ids are
    in ``wrt`` (``vjp``'s), or every LEAF link (``backward()``). A leaf of an inner differentiation made from a
    traced value is, to an outer pass, that value itself. Inside an enclosing differentiation the ops of this
    pass are recorded (so a gradient of a gradient differentiates them); otherwise they record nothing.
    Collectives are logged under the public op each VJP belongs to (``softmax``, not the ``max`` inside it),
    and the sums of cotangents under the value they are for (``grad of p['w1']`` for a leaf in ``labels``).
    ``ready(leaf id, cotangent)`` is called as each leaf's cotangent is complete, in the order the pass completes
    them (so a gradient is summed while the pass goes on, as DDP's hooks do, not held raw to the end)."""
    stop = None if wrt is None else set(wrt)
    # values are named by their link (``by_link``): a husk a link keeps stands for the value it was made from; each
    # entry of ``order`` is (value, link, its operands' names), the names looked up once for the whole pass
    order = topological(outputs, stop, by_link=True)
    # the values that depend on a leaf: only their cotangents are worth computing (an operand not linked is named
    # None, never needed)
    leaf_names: set[int] = set()
    needed: set[int] = set()
    for _, node, names in order:
        k = id(node)
        if node.op == LEAF if stop is None else k in stop:
            leaf_names.add(k)
            needed.add(k)
        elif not needed.isdisjoint(names):
            needed.add(k)
    # cotangents by value, grouped by the mesh axes along which they vary but the value does not (per-device
    # code: contributions that are still per-device summands); a plain value has one group, ()
    ct: dict[int, dict[tuple, Tensor]] = {}
    leaves: dict[int, Tensor] = {}

    def label(a) -> str:
        return (labels or {}).get(by_link(a)) or \
            (link_of(a).name if link_of(a).op != LEAF else "grad of a traced tensor")

    def accumulate(k, a, c):
        extra = _unreduced(c, a)
        groups = ct.setdefault(k, {})
        if extra not in groups:
            groups[extra] = c
        else:
            with C.user_op(label(a)):
                groups[extra] = add(groups[extra], c)

    # a leaf's cotangent is complete once every op that uses it has run its VJP: counted, so it is finished then
    users: dict[int, int] = {}
    if ready is not None:
        for _, _, names in order:
            for k in names:
                if k in leaf_names:
                    users[k] = users.get(k, 0) + 1
    finished: set[int] = set()
    regathered: dict = {}  # (source, layout) -> the source gathered again, once per backward pass

    def total(k, v):
        """``v``'s cotangent: its contributions summed (per-device summands over their axes: a psum)."""
        groups = ct.pop(k, None)
        if groups is None:
            return None
        if len(groups) == 1 and () in groups:  # (one contribution, nothing to sum: most values)
            return groups[()]
        g = None
        with C.user_op(label(v)):
            for extra, part in groups.items():
                part = settle(part, v) if extra else part
                g = part if g is None else add(g, part)
        return g

    def leaf_done(k, v) -> None:
        finished.add(k)
        g = total(k, v)
        if g is not None and not (ready is not None and ready(k, g)):
            leaves[k] = g  # (a gradient the finisher took is not kept: its raw sum dies once finished)

    def used(node, names) -> None:
        for a, k in zip(node.args, names):
            if k in users:
                users[k] -= 1
                if users[k] == 0:
                    leaf_done(k, a)

    with (contextlib.nullcontext() if outer_live() else paused()), C.phase("backward"):
        for o, c in zip(outputs, cotangents):
            k = by_link(o)
            if k in needed:
                accumulate(k, o, c)
        for v, node, names in reversed(order):
            k = id(node)
            if k not in needed or k in finished:
                continue
            if k in leaf_names:
                leaf_done(k, v)
                continue
            op = node.op
            if op == SM_IN or getattr(op, "raw_cotangent", False):
                # these transpose each group as it is (into shard_map: partial sums over its axes; all_gather: a
                # psum_scatter of the summands along the gathered axes)
                groups = ct.pop(k, None)
                for g in (groups or {}).values():
                    fn = in_vjp if op == SM_IN else op.vjp
                    with C.user_op(node.user or ("shard_map" if op == SM_IN else op.name)):
                        parts = fn(g, node, v)
                    for arg, name, c in zip(node.args, names, parts):
                        if c is not None and name in needed:
                            accumulate(name, arg, c)
                used(node, names)
                continue
            g = total(k, v)
            if g is None:
                used(node, names)
                continue
            if op == RELAYOUT:  # the transpose of a move: the cotangent laid out as the moved value was
                parts = (_transposed(g, node.args[0]) if node.prog is not None and node.prog.collectives else g,)
            elif op in (PLACE, LEAF):  # the same value (an inner pass's leaf; a host value placed)
                parts = (g,)
            elif op == SM_OUT:  # out of nb.shard_map
                with C.user_op(node.user or "shard_map"):
                    parts = out_vjp(g, node, v)
            else:
                if op.vjp is None:
                    raise ShardingError(f"grad: op {op.name} has no derivative")
                with C.user_op(node.name), C.in_scope(node.scope):
                    g = _summed_before_fan_out(g, node, needed)
                    out = v if node.out is None else husk(v, node) if node.out is HUSK else node.out
                    if node.regather:
                        node = _regathered(node, regathered)
                    parts = op.vjp(g, node, out)
            for arg, name, c in zip(node.args, names, parts):
                if c is not None and name in needed:
                    accumulate(name, arg, c)
            used(node, names)
    return leaves


def _regathered(node: Link, done: dict) -> Link:
    """``node`` with each operand it kept as the value it was gathered from gathered again (once per pass)."""
    args = list(node.args)
    for i, src, layout in node.regather:
        k = (id(src), layout)
        got = done.get(k)
        if got is None:
            got = src.with_sharding(layout)  # (a step of the backward pass: its all_gather is logged there)
            # recording the operand it stands for (its cotangent goes there)
            got = link(got.twin(), link_of(args[i]))
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
        if len(shared) == len(takers) or not any(_fans_out(link_of(a), needed) for a in shared):
            return g
    elif sum(prod(a.shape) for a in takers) < prod(g.shape):
        return g
    return g.with_sharding(spec.mesh, spec.dim_specs, spec.replicated_axes)


def _takers(node: Any, needed: set) -> list:
    """The operands of ``node`` that a cotangent flows to."""
    return [a for a in node.args if isinstance(a, Tensor) and getattr(link_of(a), "diff", False) and
            by_link(a) in needed]


def _fans_out(node: Any, needed: set) -> bool:
    """Whether ``node``'s VJP sums a pending cotangent before it runs (``_summed_before_fan_out``'s first rule)."""
    op = getattr(node.op, "name", None)
    return op is not None and op not in _PASS_THROUGH and getattr(node.op, "vjp", None) is not None and \
        len(_takers(node, needed)) >= 2


def _to_host(g: Tensor) -> Tensor:
    """A sharded gradient as a host tensor (a host read), still differentiable when it is being recorded."""
    data = None if g.is_abstract else tensor(g.numpy())._data  # (nb.tensor: a read-only copy)
    out = Tensor(data, None, g.shape, g.dtype)
    return record(out, _TO_HOST, (), (g,)) if link_of(g) is not None and recording() and not tracing_whole() else out


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


class Finisher:
    """Gradients finished as the backward pass completes them: each laid out as its primal (or as ``specs``
    says), detached unless an enclosing differentiation needs them; the final sums and moves are logged as
    ``grad of <parameter path>``. With ``bucket_bytes``, gradients whose sum is one all_reduce wait in a bucket
    of at most that many bytes per device, summed together when it fills (DDP's buckets, in the order the pass
    completes them)."""

    def __init__(self, traced: Sequence[Tensor], primals: Sequence[Tensor], labels: dict[int, str] | None,
                 bucket_bytes: int | None = None, specs: Sequence[Any] | None = None) -> None:
        self.index = {by_link(t): i for i, t in enumerate(traced)}
        self.traced, self.primals, self.labels = traced, primals, labels or {}
        self.bucket_bytes, self.specs = bucket_bytes, specs
        self.out: list = [None] * len(traced)
        self.bucket: list = []  # (index, partial gradient, target)
        self.size = 0
        self.live = outer_live()

    def _label(self, i: int) -> str:
        return self.labels.get(by_link(self.traced[i]), "grad of a traced tensor")

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
        key = (target.mesh, g.sharding.partial_axes, g.dtype)  # (one buffer, one dtype: as DDP's buckets)
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
                self(by_link(t), got.get(by_link(t)))
        self.flush()
        return self.out if self.live else [detach(g) for g in self.out]


def _bucketable(g: Tensor | None, primal: Tensor, spec: Any) -> Any:
    """The layout ``g`` is summed into when that is exactly one all_reduce (a data-parallel gradient), else None."""
    if g is None or spec is None or isinstance(spec, ManualSpec) or g.sharding is None or \
            not g.sharding.partial_axes:
        return None
    target = type(spec)(spec.mesh, [type(d)(d.axes) for d in spec.dim_specs])
    steps = plan(g.shape, primal.dtype.itemsize, g.sharding, target).collectives
    return target if len(steps) == 1 and steps[0].kind == "all_reduce" else None


def ones_seed(t: Tensor) -> Tensor:
    if isinstance(t.sharding, ManualSpec):
        return manual_constant(1.0, t)
    if t._data is None and not tracing_for_replay():  # an abstract run (not a trace nb.jit or nb.vmap runs
        # again, whose constants hold data): the seed is abstract too, or the whole backward pass would hold data
        one = abstract(t.shape, t.dtype)
    else:
        one = ones(t.shape, t.dtype)
    return one if t.sharding is None else one.shard(t.mesh, [() for _ in t.shape])
