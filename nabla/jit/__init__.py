"""``nb.jit``: nabla plans, XLA runs. A function is traced once per input signature (on data-free twins of
its arguments, so planning costs no compute), and the trace (every op's program: reshard plans, local
steps, kernel) is replayed inside ``jax.shard_map`` over a jax mesh with one axis per mesh atom: kernels in
``jax.numpy`` on each device's block, each planned collective as its ``jax.lax`` twin. Nothing is
re-planned, so the compiled program moves what the comm log says. Needs jax (``nabla-spmd[jax]``)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Sequence

import numpy as np

from ..dtypes import is_inexact
from .. import backends
from .. import collectives as C
from .. import trace as _trace
from ..pytree import flatten, unflatten
from ..errors import ShardingError
from ..executor import record_step
from ..spec import ShardingSpec
from ..value import serial
from ..tensor import Tensor
from ..trace import LEAF_LINK, link, link_of, record, releasing_grads, tracked, tracing_whole, whole
from . import program as P
from .lower import _DEVICE_COPIES, CompiledProgram  # noqa: F401 - the device copies are read by tests
from ..scoped import setting
from ..sharding import NamedSharding, is_pspec, to_spec
from ..autodiff import vjp
from ..ops import tensor
from ..interop.arrays import from_jax
from ..plan.memory import MemoryLog


def jit(fn: Callable | None = None, in_shardings: Any = None, out_shardings: Any = None,
        static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = ()) -> "Jitted":
    """Compile ``fn`` (called with tensors, or pytrees of them) through shard_map and jax.jit.

    ``in_shardings`` / ``out_shardings``, as jax.jit's: a pytree prefix of the positional arguments (of the
    result), each entry a ``nb.NamedSharding``, a ``ShardingSpec``, a JAX ``PartitionSpec`` (on the mesh of
    the value it applies to, or the function's mesh) or None (left as it comes). Inputs are laid out so
    inside the program (a reshard, logged; a host value or array is placed, no communication), results
    leave the program so. Arguments that are not tensors or arrays (Python numbers, strings, tuples of
    them) are static already: the function is traced again for each new value. ``static_argnums`` /
    ``static_argnames`` are accepted as in jax.jit and checked (such an argument must be hashable, not a
    tensor or an array). Usable as a decorator, with or without arguments."""
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    if fn is None:
        return lambda f: Jitted(f, in_shardings, out_shardings, nums, names)
    return Jitted(fn, in_shardings, out_shardings, nums, names)


class Jitted:
    """``nb.jit(fn)``: call it like ``fn`` (positional and keyword arguments); ``.lower(*args, **kwargs)`` gives
    the compiled program and its comm log. Tensors and numpy arrays (and jax arrays) are the program's inputs;
    other arguments (Python numbers, strings, ...) are constants of the trace, which is made again for each
    new value (as jax.jit's static arguments)."""

    def __init__(self, fn: Callable, in_shardings: Any = None, out_shardings: Any = None,
                 static_argnums: tuple = (), static_argnames: tuple = ()) -> None:
        self.fn = fn
        self.in_shardings, self.out_shardings = in_shardings, out_shardings
        self.static_argnums, self.static_argnames = static_argnums, static_argnames
        self._cache: dict = {}
        functools.update_wrapper(self, fn, updated=())  # (not fn's __dict__: a jitted fn's would replace these)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if self.in_shardings is not None:
            args = _constrain(args, self.in_shardings, "in_shardings", _meshes_of((args, kwargs)), True)
        out = self.fn(*args, **kwargs)
        if self.out_shardings is not None:
            out = _constrain(out, self.out_shardings, "out_shardings", _meshes_of((args, kwargs, out)), False)
        return out

    def lower(self, *args: Any, **kwargs: Any) -> "Lowered":
        return self._lowered(*_flatten_call(args, kwargs))

    def _lowered(self, leaves: list, tree: Any) -> "Lowered":
        key = (tree, tuple(_signature(x) for x in leaves))
        lowered = self._cache.get(key)
        if lowered is None:
            lowered = self._cache[key] = Lowered(self._call, leaves, tree)
        return lowered

    def _check_static(self, args: tuple, kwargs: dict) -> None:
        named = [(f"argument {i}", args[i]) for i in self.static_argnums if -len(args) <= i < len(args)]
        named += [(f"argument {k!r}", kwargs[k]) for k in self.static_argnames if k in kwargs]
        for what, v in named:
            if isinstance(v, (Tensor, np.ndarray)) or type(v).__module__.startswith("jax"):
                raise ShardingError(f"jit: static {what} is a {type(v).__name__}; a static argument must be a "
                                    f"hashable constant (tensors and arrays are the program's inputs)")
            try:
                hash(v)
            except TypeError:
                raise ShardingError(f"jit: static {what} of type {type(v).__name__} is not hashable") from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.static_argnums or self.static_argnames:
            self._check_static(args, kwargs)
        leaves, tree = _flatten_call(args, kwargs)
        if _INLINE.get():  # a tool that reads the ops one by one (nb.explain, ONNX export): run them as they are
            return self._call(*unflatten(tree, leaves))
        if tracked(leaves):
            if tracing_whole():  # inside another trace (an outer nb.jit): the ops join that trace
                return self._call(*unflatten(tree, leaves))
            lowered = self._lowered(leaves, tree)
            return lowered._differentiable(leaves)  # under nb.grad and friends: compiled, with a compiled VJP
        return self._lowered(leaves, tree)._run(leaves)


_INLINE: contextvars.ContextVar[bool] = contextvars.ContextVar("nabla_jit_inline", default=False)


def inlined() -> Any:
    """Jitted functions called inside run their ops into the caller's trace instead of compiling (for tools
    that walk the trace op by op: ``nb.explain``, ONNX export)."""
    return setting(_INLINE, True)


class _JitCall:
    """The op of a compiled call's results in an autodiff trace: output ``params[0]`` of the program, its
    operands the call's tensor inputs. Its VJP is compiled too: ``nb.vjp`` of the same function, jitted."""

    def __init__(self, lowered: "Lowered", leaves: list) -> None:
        self.lowered = lowered
        fn = getattr(lowered._fn, "__self__", None)
        self.name = f"jit({getattr(getattr(fn, 'fn', None), '__name__', 'fn')})"
        self.consts = [None if isinstance(x, Tensor) else x for x in leaves]  # the trace's constants
        self.diff = tuple(i for i in lowered._inputs
                          if getattr(link_of(leaves[i]), "diff", False) and is_inexact(leaves[i].dtype))

    def vjp(self, g: Tensor, node: Any, out: Tensor) -> tuple:
        k = node.params[0]
        bwd = self.lowered._backward.get((k, self.diff))
        if bwd is None:
            bwd = self.lowered._backward[(k, self.diff)] = Jitted(self._backward_fn(k))
        tensors = list(node.args)
        grads = bwd(tensors, g)
        by_leaf = dict(zip(self.diff, grads))
        return tuple(by_leaf.get(i) for i in self.lowered._inputs)

    def _backward_fn(self, k: int) -> Callable:
        lowered, consts, diff, inputs = self.lowered, self.consts, self.diff, self.lowered._inputs

        def backward(tensors: list, g: Tensor) -> tuple:
            leaves = list(consts)
            for i, t in zip(inputs, tensors):
                leaves[i] = t

            def f(*variables):
                full = list(leaves)
                for i, v in zip(diff, variables):
                    full[i] = v
                return flatten(lowered._fn(*unflatten(lowered._tree, full)))[0][k]

            _, fn = vjp(f, *(leaves[i] for i in diff))
            return tuple(fn(g))

        backward.__name__ = f"d_{self.name}"
        return backward


def _is_sharding(x: Any) -> bool:
    return x is None or isinstance(x, (NamedSharding, ShardingSpec)) or is_pspec(x)


def _meshes_of(tree: Any) -> set:
    leaves, _ = flatten(tree)
    return {x.sharding.mesh for x in leaves if isinstance(x, Tensor) and x.sharding is not None}


def _constrain(tree: Any, shardings: Any, what: str, meshes: set, inputs: bool, path: str = "") -> Any:
    """``tree`` with each leaf laid out as the entry of the prefix ``shardings`` that covers it."""
    if _is_sharding(shardings):
        if shardings is None:
            return tree
        leaves, t = flatten(tree)
        return unflatten(t, [_lay_out(x, shardings, what, meshes, inputs, path) for x in leaves])
    if isinstance(shardings, (tuple, list)) and isinstance(tree, (tuple, list)):
        if len(shardings) != len(tree):
            raise ShardingError(f"jit: {what}{path} has {len(shardings)} entries but there are {len(tree)} "
                                f"{'arguments' if inputs and not path else 'values'} there")
        items = [_constrain(x, s, what, meshes, inputs, f"{path}[{i}]") for i, (x, s) in enumerate(zip(tree, shardings))]
        return type(tree)(items) if not hasattr(tree, "_fields") else type(tree)(*items)
    if isinstance(shardings, dict) and isinstance(tree, dict):
        if set(shardings) != set(tree):
            raise ShardingError(f"jit: {what}{path} has keys {sorted(shardings)} but the value has {sorted(tree)}")
        return {k: _constrain(v, shardings[k], what, meshes, inputs, f"{path}[{k!r}]") for k, v in tree.items()}
    raise ShardingError(f"jit: {what}{path} must be a NamedSharding, ShardingSpec, PartitionSpec or None, or a "
                        f"tuple/list/dict of them matching the {'arguments' if inputs else 'result'}; got "
                        f"{type(shardings).__name__} for a {type(tree).__name__}")


def _lay_out(x: Any, sharding: Any, what: str, meshes: set, inputs: bool, path: str) -> Any:
    if not isinstance(x, Tensor):
        if inputs:
            return x  # a constant of the trace
        raise ShardingError(f"jit: {what}{path} applies to a {type(x).__name__}, not a tensor")
    if isinstance(sharding, (NamedSharding, ShardingSpec)):
        spec = to_spec(sharding, None, x.ndim, op=f"jit {what}{path}")
    else:  # a PartitionSpec: on the value's mesh, or the function's one mesh
        mesh = x.sharding.mesh if x.sharding is not None else (next(iter(meshes)) if len(meshes) == 1 else None)
        if mesh is None:
            raise ShardingError(f"jit: {what}{path} is a PartitionSpec for a value on no mesh, and the function "
                                f"uses {len(meshes)} meshes; give a nb.NamedSharding(mesh, spec)")
        spec = to_spec(mesh, sharding, x.ndim, op=f"jit {what}{path}")
    if x.sharding is None:
        return x.shard(spec)
    return x.with_sharding(spec)


def _flatten_call(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """The leaves of a call (keyword arguments by name) with arrays as tensors, and the call's structure."""
    leaves, tree = flatten((tuple(args), dict(sorted(kwargs.items()))))
    return [_as_input(x) for x in leaves], tree


def _as_input(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):  # an input (as jax.jit traces numpy arrays), not a constant
        return tensor(x)
    if type(x).__module__.startswith(("jax", "jaxlib")) and hasattr(x, "sharding") and hasattr(x, "shape"):
        return from_jax(x)
    return x


def _signature(x: Any) -> Any:
    if isinstance(x, Tensor):
        return ("t", x.shape, x.dtype.str, x.sharding)
    try:
        hash(x)
    except TypeError:
        raise ShardingError(f"jit: an argument of type {type(x).__name__} is neither a tensor (or array) nor a "
                            f"hashable constant; pass tensors, numpy arrays, Python numbers or strings, or pytrees "
                            f"(dict, list, tuple) of them") from None
    return ("c", type(x), x)



class Lowered:
    """One trace of ``fn`` and its compiled program. ``steps``: the recorded steps of the trace (what eager nabla
    would run on these inputs); ``recorded``: their moves, a comm log; ``comm_log``: the moves of the compiled
    program, after its rewrites (``comm_log.removed`` lists each move a rewrite took out, with the reason);
    ``as_text()``: the compiled HLO, whose collectives are ``comm_log``'s; ``memory``: the liveness pass over
    the steps (``nb.memory_log``'s accounts: inputs from the start, outputs to the end). Calling it runs the program on jax
    devices. The jax program is traced from the inputs' shapes and layouts alone (no argument is kept) and
    compiled on first use."""

    def __init__(self, fn: Callable, leaves: list, tree: Any) -> None:
        backends.require_jax("nb.jit")
        backends.get("jax")  # jax arrays inside the trace are seen as jax's
        twins = []
        for x in leaves:
            if isinstance(x, Tensor):
                t = link(Tensor(None, x.sharding, x.shape, x.dtype), LEAF_LINK)
                serial(t)
                twins.append(t)
            else:
                twins.append(x)
        # a trace of its own: every op recorded (even when called from a backward pass, where recording is
        # paused), its steps in its own log only (an enclosing log sees them when the program runs)
        with _trace.recorded(), C.unlogged(), whole(), releasing_grads(), C.comm_log(keep_values=True) as log:
            out = fn(*unflatten(tree, twins))
        outs, self._out_tree = flatten(out)
        for o in outs:
            if not isinstance(o, Tensor):
                raise ShardingError(f"jit: the function must return tensors (or pytrees of them), got "
                                    f"{type(o).__name__}")
            serial(o)
            log.values.setdefault(o._serial, o)
        self._inputs = [i for i, x in enumerate(twins) if isinstance(x, Tensor)]
        tw = [twins[i] for i in self._inputs]
        self.steps = tuple(log.steps)
        self.recorded = log
        rw = P.rewrite(P.instructions(self.steps), {(t._serial, P.layout(t._spec)) for t in tw},
                       [(o._serial, P.layout(o._spec)) for o in outs], log.values)
        self._program = CompiledProgram(tw, outs, rw, log.values)
        with _x64():
            self._traced = self._program.jitted().trace(*self._program.avals())
        self.comm_log = P.comm_log(rw)
        self.memory = MemoryLog.of(self.steps, tw, outs)  # what the compiled program holds, step by step
        self._compiled = None
        self._fn, self._tree = fn, tree
        self._backward: dict = {}  # (output, differentiated inputs) -> the jitted VJP

    def compile(self):
        """The compiled XLA executable (compiled once, on first use)."""
        if self._compiled is None:
            with _x64():
                self._compiled = self._traced.lower().compile()
        return self._compiled

    def compiled(self, args: tuple, kwargs: dict | None = None) -> tuple:
        """(the executable, ``args`` as the jax arrays it takes): to time the compiled program alone."""
        leaves, _ = _flatten_call(args, kwargs or {})
        with _x64():
            return self.compile(), self._program.inputs([leaves[i] for i in self._inputs])

    def as_text(self, *args: Any) -> str:
        """The compiled HLO (one program per trace: any ``args`` of this signature give the same text)."""
        return self.compile().as_text()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(_flatten_call(args, kwargs)[0])

    def _differentiable(self, leaves: list) -> Any:
        """The compiled call's results, each linked on the tape to a step whose VJP runs a compiled backward pass."""
        out = self._run(leaves)
        outs, tree = flatten(out)
        op = _JitCall(self, leaves)
        args = tuple(leaves[i] for i in self._inputs)
        # each result recorded (the same value: its blocks and serial)
        return unflatten(tree, [record(o.twin(sums=True), op, (k,), args) for k, o in enumerate(outs)])

    def _run(self, leaves: list) -> Any:
        fn = self.compile()
        with _x64():
            arrays = fn(*self._program.inputs([leaves[i] for i in self._inputs]))
        outs = self._program.outputs(arrays)
        if C.logging():  # the program's moves, as it runs them: one step per result, the moves on the first
            ins = [leaves[i] for i in self._inputs]
            # (each in the phase and under the op it ran for in the traced program: a backward sum stays one)
            events = tuple(C.stamped(e, e.op)._replace(phase=e.phase) for e in self.comm_log.events)
            for k, o in enumerate(outs):
                record_step(P.CALL, (self._name(), k), ins, o, events if k == 0 else (), named=True)
        return unflatten(self._out_tree, outs)

    def _name(self) -> str:
        fn = getattr(self._fn, "__self__", None)
        return f"jit({getattr(getattr(fn, 'fn', None), '__name__', 'fn')})"


@contextlib.contextmanager
def _x64():
    """numpy's dtypes on jax: float64 and int64 stay 64-bit while tracing, compiling and running. The switch is
    jax's thread-local context (the global ``jax_enable_x64`` is never written), entered only when it is off."""
    import jax
    if jax.config.jax_enable_x64:
        yield
        return
    with jax.enable_x64(True):
        yield
