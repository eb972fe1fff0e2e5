"""``nb.jit``: nabla plans, XLA runs. A function is traced once per input signature (on data-free twins of
its arguments, so planning costs no compute), and the trace (every op's program: reshard plans, local
steps, kernel) is replayed inside ``jax.shard_map`` over a jax mesh with one axis per mesh atom: kernels in
``jax.numpy`` on each device's block, each planned collective as its ``jax.lax`` twin. Nothing is
re-planned, so the compiled program moves what the comm log says. Needs jax (``nabla-spmd[jax]``)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from math import prod
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import backends, reshard, storage
from . import collectives as C
from . import trace as _trace
from .autodiff import flatten, unflatten
from .errors import ShardingError
from .executor import Local, Value
from .layout import chunk, chunks, grid, merge_cuts, spec_cuts
from .mesh import AxisRef, DeviceMesh
from .spec import ShardingSpec
from .tensor import Tensor
from .shard_map import SM_IN, SM_OUT, ManualSpec
from .trace import LEAF, LEAF_NODE, PLACE, RELAYOUT, Node, topological, tracked, tracing_whole, whole


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
        functools.update_wrapper(self, fn)

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
        if tracked(leaves):
            if tracing_whole() or _INLINE.get():
                # inside another trace (an outer nb.jit, nb.explain, ONNX export): the ops join that trace
                return self._call(*unflatten(tree, leaves))
            lowered = self._lowered(leaves, tree)
            return lowered._differentiable(leaves)  # under nb.grad and friends: compiled, with a compiled VJP
        return self._lowered(leaves, tree)._run(leaves)


_INLINE: contextvars.ContextVar[bool] = contextvars.ContextVar("nabla_jit_inline", default=False)


@contextlib.contextmanager
def inlined() -> Iterator[None]:
    """Jitted functions called inside run their ops into the caller's trace instead of compiling (for tools
    that walk the trace op by op: ``nb.explain``, ONNX export)."""
    token = _INLINE.set(True)
    try:
        yield
    finally:
        _INLINE.reset(token)


class _JitCall:
    """The op of a compiled call's results in an autodiff trace: output ``params[0]`` of the program, its
    operands the call's tensor inputs. Its VJP is compiled too: ``nb.vjp`` of the same function, jitted."""

    def __init__(self, lowered: "Lowered", leaves: list) -> None:
        self.lowered = lowered
        fn = getattr(lowered._fn, "__self__", None)
        self.name = f"jit({getattr(getattr(fn, 'fn', None), '__name__', 'fn')})"
        self.consts = [None if isinstance(x, Tensor) else x for x in leaves]  # the trace's constants
        self.diff = tuple(i for i in lowered._inputs if leaves[i]._node is not None and leaves[i].dtype.kind in "fc")

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
        from .autodiff import vjp
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
    from .sharding import NamedSharding, _is_pspec
    return x is None or isinstance(x, (NamedSharding, ShardingSpec)) or _is_pspec(x)


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
    from .sharding import NamedSharding, to_spec
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
        from .ops import tensor
        return tensor(x)
    if type(x).__module__.startswith(("jax", "jaxlib")) and hasattr(x, "sharding") and hasattr(x, "shape"):
        from .interop.jax import from_jax
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
    """One trace of ``fn`` and its compiled program: ``comm_log`` (nabla's planned collectives), ``as_text()``
    (the compiled HLO), and calling it runs the program on jax devices. The jax program is traced here, from
    the inputs' shapes and layouts alone (no argument is kept), and compiled on first use."""

    def __init__(self, fn: Callable, leaves: list, tree: Any) -> None:
        backends.require_jax("nb.jit")
        backends.get("jax")  # jax arrays inside the trace are seen as jax's
        twins = []
        for x in leaves:
            if isinstance(x, Tensor):
                t = Tensor(None, x.sharding, x.shape, x.dtype)
                t._node = LEAF_NODE
                twins.append(t)
            else:
                twins.append(x)
        # a trace of its own: every op recorded (even when called from a backward pass, where recording is
        # paused), its collectives in its own log only (an enclosing log sees them when the program runs)
        rec, logs = _trace._recording.set(True), C._logs.set(())
        try:
            with whole(), C.comm_log() as log:
                out = fn(*unflatten(tree, twins))
        finally:
            C._logs.reset(logs)
            _trace._recording.reset(rec)
        outs, self._out_tree = flatten(out)
        for o in outs:
            if not isinstance(o, Tensor):
                raise ShardingError(f"jit: the function must return tensors (or pytrees of them), got "
                                    f"{type(o).__name__}")
        self._inputs = [i for i, x in enumerate(twins) if isinstance(x, Tensor)]
        self._program = _Program(twins, outs)
        with _x64():
            self._traced = self._program.jitted().trace(*self._program.avals())
        self.comm_log = _emitted(log, self._program.body.skipped)
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
        """The compiled call's results, each recording a node whose VJP runs a compiled backward pass."""
        out = self._run(leaves)
        outs, tree = flatten(out)
        op = _JitCall(self, leaves)
        args = tuple(leaves[i] for i in self._inputs)
        for k, o in enumerate(outs):
            o._node = Node(op, (k,), args)
        return out

    def _run(self, leaves: list) -> Any:
        if C.logging():  # the program's collectives, as it runs them
            for e in self.comm_log.events:
                C.record(e, e.op)
        fn = self.compile()
        with _x64():
            outs = fn(*self._program.inputs([leaves[i] for i in self._inputs]))
        return unflatten(self._out_tree, self._program.outputs(outs))


def _emitted(log: C.CommLog, skipped: list) -> C.CommLog:
    """The trace's comm log without the events of moves the program does not make again: for each, the
    latest logged event of the same kind, axes, bytes and group (a later use repeating an earlier move)."""
    out = C.CommLog()
    events = list(log.events)
    for e in skipped:
        for i in range(len(events) - 1, -1, -1):
            f = events[i]
            if f is not None and (f.kind, f.axes, f.bytes, f.group) == (e.kind, e.axes, e.bytes, e.group):
                events[i] = None
                break
        else:
            raise ShardingError(f"internal: jit skipped a repeated {e!r} the trace did not log")
    out.events = [e for e in events if e is not None]
    return out


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


# ---- the per-device program ---------------------------------------------------------------------------


class _Program:
    """The trace turned into one function of every device's blocks, run under shard_map."""

    def __init__(self, twins: list, outs: list) -> None:
        self.twins = [t for t in twins if isinstance(t, Tensor)]
        self.outs = outs
        self.order = topological(outs)
        self.consts: list[tuple[Any, Any]] = []  # (value, spec it is placed with): extra inputs
        self._targets = self._const_arrays = None  # their jax shardings, the constants on their devices
        self._const_index: dict = {}
        mesh = self._mesh()
        self.mesh = mesh
        specs = [t.sharding for t in self.twins + self.outs if t.sharding is not None]
        for v in self.order:
            node = v._node
            specs.append(v.sharding)
            if node.op in (RELAYOUT, PLACE, SM_IN, SM_OUT):
                specs.append(node.params[0])
            elif node.op != LEAF and node.prog is not None and node.prog != "manual":
                prog = node.prog
                specs += [p.target for p in prog.preps if p.target is not None] + [prog.kspec, prog.result]
        cuts = merge_cuts(*(spec_cuts(s) for s in specs if isinstance(s, ShardingSpec)))
        if cuts is None:
            raise ShardingError("jit: the sub-axes this function uses do not nest into one jax mesh")
        self.cuts = cuts
        atoms = []
        for name, n, c in zip(mesh.axis_names, mesh.shape, cuts):
            pts = sorted(set(c) | {1, n})
            atoms += [AxisRef(name, a, b // a, n) for a, b in zip(pts, pts[1:])]
        self.atoms = tuple(atoms)
        from .backends.jax import atom_mesh, atom_name
        self.jmesh = atom_mesh(mesh, self.atoms)
        self.names = tuple(atom_name(a) for a in self.atoms)
        self.free, self.folded = _fold(self)  # values that read no input data: computed now, constant inputs
        self.body = _Body(self)  # finds the constants, which become inputs after the arguments

    def _mesh(self) -> DeviceMesh:
        meshes = {t.sharding.mesh for t in self.twins + self.outs if t.sharding is not None}
        for v in self.order:
            if v.sharding is not None:
                meshes.add(v.sharding.mesh)
        if not meshes:  # only host values: the program runs on one device (jax.devices()[0])
            return DeviceMesh("host", (1,), ("host",))
        if len(meshes) != 1:
            raise ShardingError(f"jit: the function uses {len(meshes)} meshes ({', '.join(map(repr, meshes))}); a "
                                f"compiled program runs on one mesh: move values between meshes outside nb.jit")
        return meshes.pop()

    # -- layout of blocks as jax arrays --
    def pspec(self, spec: ShardingSpec | None, rank: int):
        from jax.sharding import PartitionSpec
        if spec is None:  # a host value: every device holds all of it
            return PartitionSpec(*([None] * (len(self.atoms) + rank)))
        g = grid(spec, self.cuts)
        return PartitionSpec(*[n if s > 1 else None for n, s in zip(self.names, g.shape)], *([None] * rank))

    def global_array(self, v: Value, spec: ShardingSpec | None):
        """A tensor's stored blocks as the jax global array shard_map splits over the atoms."""
        if spec is None:
            data = np.asarray(v._data)
            return data.reshape((1,) * len(self.atoms) + data.shape)
        data = v._data
        if data is None:
            raise ShardingError("jit: an abstract tensor (nb.abstract) cannot be run; call .lower(...) to plan only")
        shape = grid(spec, self.cuts).shape + data.shape[len(grid(spec).shape):]
        return data if data.shape == shape else data.reshape(shape)

    def const(self, value: Any, spec: ShardingSpec | None) -> int:
        key = (id(value), spec)
        if key not in self._const_index:
            self._const_index[key] = len(self.consts)
            self.consts.append((value, spec))
        return self._const_index[key]

    def inputs(self, leaves: list) -> list:
        """The jax global arrays of the arguments' blocks, then the constants'. A numpy-backed tensor's device
        copy is made once and reused while its (immutable) blocks live; blocks already on their devices (a
        previous call's results, data loaded per process) are used as they are."""
        import jax
        from jax.sharding import NamedSharding
        if self._targets is None:
            self._targets = [NamedSharding(self.jmesh, self.pspec(t.sharding, t.ndim)) for t in self.twins]
        arrays = []
        for t, x, target in zip(self.twins, leaves, self._targets):
            if not isinstance(x, Tensor) or (x._spec is not t._spec and x._spec != t._spec) or x._shape != t._shape:
                raise ShardingError(f"jit: expected a tensor of shape {t.shape} laid out {t.sharding!r}")
            data = x._data
            if data is None:
                raise ShardingError("jit: an abstract tensor (nb.abstract) cannot be run; call .lower(...) to plan "
                                    "only")
            if isinstance(data, jax.Array):
                arr = self.global_array(x, x.sharding)
                if arr.sharding is target or arr.sharding.is_equivalent_to(target, arr.ndim):
                    arrays.append(arr)  # already on its devices
                else:
                    arrays.append(jax.device_put(arr, target))
                continue
            arrays.append(_device_copy(data, lambda x=x: self.global_array(x, x.sharding), target))
        if self._const_arrays is None:
            self._const_arrays = [jax.device_put(self.global_array(value, spec), NamedSharding(
                self.jmesh, self.pspec(spec, len(value._shape)))) for value, spec in self.consts]
        return arrays + self._const_arrays

    def avals(self) -> list:
        """The jax global arrays ``inputs`` gives, as shapes, dtypes and shardings (to trace without data)."""
        import jax
        from jax.sharding import NamedSharding
        out = []
        for spec, shape, dtype in [(t.sharding, t.shape, t.dtype) for t in self.twins] + \
                                  [(spec, v._shape, v._dtype) for v, spec in self.consts]:
            g = (1,) * len(self.atoms) if spec is None else grid(spec, self.cuts).shape
            block = tuple(shape) if spec is None else chunks(spec, shape)
            out.append(jax.ShapeDtypeStruct(g + block, dtype,
                                            sharding=NamedSharding(self.jmesh, self.pspec(spec, len(shape)))))
        return out

    def outputs(self, arrays) -> list:
        out = []
        for o, a in zip(self.outs, arrays):
            if o.sharding is None:
                out.append(Tensor(np.asarray(a).reshape(o.shape), None, o.shape, o.dtype))
                continue
            shape = grid(o.sharding).shape + a.shape[len(self.atoms):]
            out.append(Tensor(a if a.shape == shape else a.reshape(shape), o.sharding, o.shape, o.dtype))
        return out

    def jitted(self):
        import jax
        in_specs = tuple([self.pspec(t.sharding, t.ndim) for t in self.twins] +
                         [self.pspec(spec, len(v._shape)) for v, spec in self.consts])
        out_specs = tuple(self.pspec(o.sharding, o.ndim) for o in self.outs)
        fn = jax.shard_map(self.body, mesh=self.jmesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)
        return jax.jit(fn)


_DEVICE_COPIES: dict[int, tuple] = {}  # id of numpy blocks -> (weak reference to them, jax sharding, jax array)


def _device_copy(data: Any, make: Callable[[], Any], target: Any) -> Any:
    """``make()`` (a global array of ``data``) on its devices as ``target``, reusing the copy made for the same
    read-only blocks before (they cannot change: tensors are immutable); the copy is dropped with them."""
    import jax
    key = id(data)
    hit = _DEVICE_COPIES.get(key)
    if hit is not None and hit[0]() is data and (hit[1] is target or hit[1] == target):
        return hit[2]
    arr = jax.device_put(make(), target)
    if isinstance(data, np.ndarray) and not data.flags.writeable:
        ref = weakref.ref(data, lambda _, key=key: _DEVICE_COPIES.pop(key, None))
        _DEVICE_COPIES[key] = (ref, target, arr)
    return arr


class _Device:
    """What a lowering needs about the device it runs on: coordinates along any (sub-)axis, its mesh position,
    and ppermute between mesh positions."""

    def __init__(self, prog: _Program) -> None:
        import jax
        self.lax = jax.lax
        self.xp = jax.numpy
        self.prog = prog
        self.mesh = prog.mesh

    def axis_names(self, refs) -> tuple[str, ...]:
        """The jax mesh axes (atoms) that make up ``refs``, major to minor."""
        out = []
        for r in refs:
            for a, n in zip(self.prog.atoms, self.prog.names):
                if a.name == r.name and r.pre <= a.pre and a.pre * a.size <= r.pre * r.size:
                    out.append(n)
        return tuple(out)

    def linear(self, refs):
        """This device's position along ``refs`` (mixed radix, major first)."""
        names = self.axis_names(refs)
        return self.lax.axis_index(names) if names else 0

    def position(self):
        return self.lax.axis_index(self.prog.names) if self.prog.names else 0

    def pairs(self, fn: Callable[[int], int | None], refs) -> list[tuple[int, int]]:
        """(source, target) mesh positions: each device sends to the one whose position along ``refs`` is
        ``fn`` of its own, all else equal (targets outside the axis are dropped)."""
        mesh = self.mesh
        k = prod(r.size for r in refs)
        out = []
        for u, d in enumerate(mesh.devices):
            coords = list(mesh.coords(d))
            q = 0
            for r in refs:
                q = q * r.size + r.coord(coords[mesh.axis_index(r.name)])
            t = fn(q)
            if t is None or not 0 <= t < k:
                continue
            new = list(coords)
            rest = t
            for r in reversed(refs):
                digit = rest % r.size
                rest //= r.size
                i = mesh.axis_index(r.name)
                new[i] += (digit - r.coord(new[i])) * r.minor
            out.append((u, mesh.devices.index(mesh.device_at(new))))
        return out

    def ppermute(self, x, pairs):
        """Device ``u`` sends ``x`` to ``v`` for each pair; a device no one sends to receives zeros."""
        if not self.prog.names:
            return x
        return self.lax.ppermute(x, self.prog.names, perm=pairs)


def _fit(xp, x, axis: int, n: int):
    c = x.shape[axis]
    if c == n:
        return x
    if c > n:
        return x[(slice(None),) * axis + (slice(0, n),)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - c)
    return xp.pad(x, pad)


class _Body:
    """The function every device runs: the trace replayed on its blocks."""

    def __init__(self, prog: _Program) -> None:
        self.prog = prog
        # walk once without jax to find the constants (they become inputs)
        for v in prog.order:
            node = v._node
            if node.op in (LEAF, RELAYOUT, SM_IN, SM_OUT):
                continue
            if node.prog == "manual":
                for a in node.args:
                    if isinstance(a, Value) and a._node is None:
                        if isinstance(a._spec, ManualSpec):
                            raise ShardingError("jit: a per-device constant inside shard_map code (make it inside "
                                                "the function from its inputs)")
                        prog.const(a, a._spec)
                continue
            if node.op == PLACE:
                if node.args[0]._node is None:
                    prog.const(node.args[0], None)
                continue
            for a, p in zip(node.args, node.prog.preps if node.prog is not None else ()):
                if isinstance(a, Value) and a._node is None:
                    if p.kind == "host":
                        prog.const(a, None)
                    elif p.kind == "sharded":
                        prog.const(a, a._spec)
            if node.prog is None:
                for a in node.args:
                    if isinstance(a, Value) and a._node is None:
                        prog.const(a, a._spec)
        for o in prog.outs:
            if o._node is None and not any(o is t for t in prog.twins):
                prog.const(o, o._spec)

    def __call__(self, *arrays):
        prog = self.prog
        dev = _Device(prog)
        xp = dev.xp
        G = len(prog.atoms)
        strip = lambda a: a.reshape(a.shape[G:])  # noqa: E731 - each device's block without its grid
        env: dict[int, Any] = {}
        empty = lambda a: xp.zeros(a.shape[G:], a.dtype) if 0 in a.shape else strip(a)  # noqa: E731
        for t, a in zip(prog.twins, arrays):  # a block with no elements holds nothing: not read (XLA would
            env[id(t)] = empty(a)  # fold it to a constant, and an unread manual-computation input fails)
        consts = [empty(a) for a in arrays[len(prog.twins):]]
        live = _live(prog)
        self.skipped = []  # events the trace logged for work the program does not do again
        mover = _Mover(dev, self.skipped)
        made: dict = {}  # (op, params, operands, layout) -> the value first made so (its canonical id)

        def value_of(a):
            if id(a) in env:
                return env[id(a)]
            return consts[prog._const_index[(id(a), a._spec if a._spec is not None else None)]]

        def host_of(a):
            if id(a) in env:
                return env[id(a)]
            return consts[prog._const_index[(id(a), None)]]

        def same_as(v, key) -> bool:
            """Whether an equal value (the same op of the same operands, in the same layout) was made already:
            then ``v`` is that value (XLA would merge the two computations, their collectives included)."""
            first = made.setdefault(key, v)
            if first is v:
                return False
            mover.alias(v, first)
            env[id(v)] = env[id(first)]
            return True

        for v in prog.order:
            node = v._node
            if id(v) in prog.free or id(v) not in live:
                # computed before (a constant input), or read by nothing: what eager moved for it is skipped
                if node.op == RELAYOUT:
                    mover.move(node.args[0], value_of, node.args[0]._spec, node.params[0], node.prog, dry=True)
                elif node.op not in (LEAF, PLACE) and node.prog is not None:
                    _lower_operands(node, value_of, host_of, mover, dev, dry=True)
                    if node.prog.post is not None:
                        self.skipped += node.prog.post.events
                if id(v) in prog.folded:
                    val = prog.folded[id(v)]
                    env[id(v)] = consts[prog._const_index[(id(val), val._spec)]]
                continue
            if node.op == LEAF:
                if node.args:  # a differentiation variable made from a traced value: the same blocks
                    env[id(v)] = value_of(node.args[0])
                    mover.alias(v, node.args[0])
                continue
            if node.op == RELAYOUT:
                a = node.args[0]
                x = mover.move(a, value_of, a._spec, node.params[0], node.prog)
                if not same_as(v, (RELAYOUT, mover.cid(a), node.params[0].layout())):
                    env[id(v)] = x
                continue
            if node.op == PLACE:
                env[id(v)] = _place_local(host_of(node.args[0]), node.params[0], dev)
                continue
            if node.op in (SM_IN, SM_OUT):  # a global value seen per device, and back: the same blocks
                x = value_of(node.args[0])
                env[id(v)] = x.reshape(v.shape) if node.op == SM_IN else x.reshape(tuple(
                    n // node.params[0].num_shards(d) for d, n in enumerate(v.shape)))
                continue
            if node.prog == "manual":  # per-device code: the op on this device's block, or a lax collective
                ins = [value_of(a) if isinstance(a, Value) else a for a in node.args]
                if hasattr(node.op, "lower"):
                    env[id(v)] = node.op.lower(ins[0] if ins else None, dev)
                else:
                    env[id(v)] = xp.asarray(node.op.kernel(ins, Local(0, v.shape, node.params)))
                continue
            if node.prog is None:  # an op on host values only: the same on every device
                arrays_ = [host_of(a) if isinstance(a, Value) else a for a in node.args]
                env[id(v)] = xp.asarray(node.op.kernel(arrays_, Local(0, v.shape, node.params)))
                continue
            key = _op_key(node, mover)
            if key is not None and key in made:
                _lower_operands(node, value_of, host_of, mover, dev, dry=True)  # what eager moved for it
                if node.prog.post is not None:
                    self.skipped += node.prog.post.events
                same_as(v, key)
                continue
            env[id(v)] = _lower_op(v, node, value_of, host_of, mover, dev)
            if key is not None:
                made[key] = v
        outs = []
        for o in prog.outs:
            x = env[id(o)] if id(o) in env else value_of(o)
            outs.append(x.reshape((1,) * G + tuple(x.shape)))
        return tuple(outs)


def _fold(prog) -> tuple[set[int], dict[int, Any]]:
    """Values that depend on no input data (made only from tensors without elements, and constants) are
    computed here, eagerly, and enter the program as constants: XLA would fold them, collectives included,
    and the comm log could not say which. Returns id of each such value -> its value, for those the rest
    of the program (or the output) reads; they are registered as constants. Returns the ids of every such
    value, and that map."""
    from . import executor
    free: dict[int, Any] = {}
    for v in prog.order:
        node = v._node
        if node.op in (SM_IN, SM_OUT) or node.prog == "manual":
            continue
        empty = 0 in v.shape
        if node.op == LEAF and not node.args:
            if empty:
                free[id(v)] = _zeros_as(v)
            continue
        args = [a for a in node.args if isinstance(a, Value)]
        if not empty and not all(id(a) in free or (a._node is None and 0 in a._shape) for a in args):
            continue
        if empty:
            free[id(v)] = _zeros_as(v)
            continue
        real = [free.get(id(a), _zeros_as(a) if isinstance(a, Value) and a._node is None else a) for a in node.args]
        token = C._logs.set(())  # computed, not communicated: nothing is logged
        try:
            if node.op == LEAF:
                out = real[0]
            elif node.op == RELAYOUT:
                out = executor.relayout(real[0], node.params[0])
            elif node.op == PLACE:
                out = executor.place(real[0], node.params[0])
            else:
                out = executor.run(node.op, real, node.params)
        finally:
            C._logs.reset(token)
        if out._spec != v._spec or out._shape != v._shape:
            continue
        free[id(v)] = out
    if not free:
        return set(), {}
    read = {id(o) for o in prog.outs}
    for v in prog.order:
        if id(v) not in free:
            read.update(id(a) for a in v._node.args if isinstance(a, Value))
    folded = {i: free[i] for i in free if i in read}
    for val in folded.values():
        prog.const(val, val._spec)
    return set(free), folded


def _zeros_as(v) -> Value:
    """A value of ``v``'s shape, dtype and layout holding zeros (what a tensor without elements holds)."""
    data = np.zeros(v._shape, v._dtype)
    if v._spec is None:
        return Value(data, None, v._shape, v._dtype)
    return Value(storage._place(data, v._spec), v._spec, v._shape, v._dtype)


def _live(prog) -> set[int]:
    """The values the outputs read at run time (a value computed before, a constant input, reads nothing)."""
    live = {id(o) for o in prog.outs}
    for v in reversed(prog.order):
        if id(v) in live and id(v) not in prog.free:
            live.update(id(a) for a in v._node.args if isinstance(a, Value))
    return live


def _op_key(node, mover) -> tuple | None:
    """What makes an op's result: the op, its params, its operands (by canonical value, or the scalar) and
    the layout it is made in. None when it cannot be compared (unhashable params)."""
    args = []
    for a in node.args:
        if isinstance(a, Value):
            args.append(("v", mover.cid(a)))
        elif isinstance(a, (bool, int, float, complex, np.generic)):
            args.append(("c", type(a), a))
        else:
            return None
    key = (node.op, node.params, tuple(args), node.prog.result.layout())
    try:
        hash(key)
    except TypeError:
        return None
    return key


class _Mover:
    """Moves of traced values, each made once per (value, layout): a value is immutable, so a second use that
    needs it in the same layout takes the first move's blocks (XLA would merge the two identical collectives
    anyway; making it once here keeps the comm log equal to what is emitted). ``skipped`` collects the events
    the trace logged for moves not made again: eager nabla moves a value again at each use, except a pending
    sum, which it makes once per value."""

    def __init__(self, dev, skipped: list) -> None:
        self.dev = dev
        self.skipped = skipped
        self.memo: dict = {}
        self.canon: dict[int, int] = {}  # id of a value -> id of the equal value first made
        self.summed: set = set()  # (id of a value, layout): a pending sum eager made (and logged) once

    def cid(self, a) -> int:
        return self.canon.get(id(a), id(a))

    def alias(self, v, first) -> None:
        self.canon[id(v)] = self.cid(first)

    def move(self, a, value_of, src: ShardingSpec, dst: ShardingSpec, plan: reshard.Plan | None = None,
             op: str = "sum", dry: bool = False):
        """``a`` (laid out ``src``: its own spec, or a layout it was already moved to) as laid out ``dst``.
        ``dry``: the use belongs to a value made already; nothing is emitted (what eager logged is skipped)."""
        layout = dst.layout()
        key = (self.cid(a), layout)
        logged = True
        if src.partial_axes:  # eager sums a value once per target layout
            logged = (id(a), layout) not in self.summed
            self.summed.add((id(a), layout))
        if dry or key in self.memo:
            if logged:
                if plan is None:
                    plan = reshard.plan(a._shape, a._dtype.itemsize, src, dst)
                self.skipped += plan.events
            return None if dry else self.memo[key]
        if plan is None:
            plan = reshard.plan(a._shape, a._dtype.itemsize, src, dst)
        x = value_of(a) if src.layout() == a._spec.layout() else self.memo[(self.cid(a), src.layout())]
        x = _lower_plan(x, plan, a._shape, self.dev, op, dst, self.skipped)
        self.memo[key] = x
        return x

    def prepared(self, a, key: tuple, make: Callable, events: tuple, dry: bool = False):
        """An operand after what its use does to it (masks, factor steps), made once per value and use kind."""
        key = (self.cid(a),) + key
        if dry or key in self.memo:
            self.skipped += events
            return None if dry else self.memo[key]
        x = self.memo[key] = make()
        return x


def _lower_operands(node, value_of, host_of, mover, dev, dry: bool = False) -> list:
    """Each operand's block as the op's kernel takes it: moved as planned (each move made once), masked
    where it joins a partial sum, then through its factor kinds' local steps. ``dry``: only account for the
    moves (the op's value was made already)."""
    xp = dev.xp
    prog = node.prog
    settled = node.settled or (None,) * len(node.args)
    arrays = []
    for a, p, s in zip(node.args, prog.preps, settled):
        if p.kind == "scalar" and not p.mask_axes:
            arrays.append(a)
            continue
        if p.kind == "scalar":
            arrays.append(None if dry else
                          _prepare_local(xp.asarray(a, dtype=prog.dtype).reshape(()), p, node.op, dev))
            continue
        if p.kind == "host":
            x = None if dry else _place_local(host_of(a), p.target, dev)
        elif s is not None:  # a partial operand an earlier use summed: from that sum (made once)
            mover.move(a, value_of, a._spec, s, dry=dry)
            x = mover.move(a, value_of, s, p.target, p.plan, dry=dry)
        else:
            x = mover.move(a, value_of, a._spec, p.target, p.plan, dry=dry)
        if p.mask_axes or p.local:
            x = mover.prepared(a, ("prep", p.kind, p.target.layout(), p.mask_axes, p.local),
                               lambda x=x, p=p: _prepare_local(x, p, node.op, dev),
                               tuple(e for step in p.local for e in step.events), dry)
        arrays.append(x)
    return arrays


def _lower_op(v, node, value_of, host_of, mover, dev):
    xp = dev.xp
    prog = node.prog
    op = node.op
    arrays = _lower_operands(node, value_of, host_of, mover, dev)
    aux = tuple(_aux_local(a, prog, dev) for a in prog.local.aux)
    out = op.kernel(arrays, Local(0, prog.local.out_chunk, prog.local.params, True, aux))
    out = xp.asarray(out)
    if out.dtype != prog.dtype:
        out = out.astype(prog.dtype)
    if tuple(out.shape) != prog.local.out_chunk:
        out = xp.broadcast_to(out, prog.local.out_chunk)
    if prog.post is not None:
        out = _lower_plan(out, prog.post, prog.result_shape, dev, op.reduction, prog.result, mover.skipped)
    return out


def _prepare_local(x, p, op, dev):
    """What an operand's use does to its block before the kernel: a value added to a partial sum counts once
    per group (on coordinate 0 only), then the factor kinds' local steps."""
    xp = dev.xp
    if p.mask_axes:
        first = xp.asarray(True)
        for name in p.mask_axes:
            first = first & (dev.linear([dev.mesh.axis_ref(name)]) == 0)
        x = xp.where(first, x, xp.zeros((), dtype=x.dtype))
    for step in p.local:
        if step.lower is None:
            raise ShardingError(f"jit: a local step of {op.name} has no lowering")
        x = step.lower(x, dev)
    return x


def _aux_local(a, prog, dev):
    """This device's part of a per-layout constant shaped (*grid of the op's atoms, ...)."""
    if not isinstance(a, np.ndarray):
        return a
    cut_grid = grid(prog.kspec, _cuts_of(prog))
    G = len(cut_grid.shape)
    if a.ndim < G:
        return dev.xp.asarray(a)
    idx = tuple(dev.linear([atom]) if a.shape[j] > 1 else 0 for j, atom in enumerate(cut_grid.atoms))
    return dev.xp.asarray(a)[idx]


def _cuts_of(prog):
    specs = [p.target for p in prog.preps if p.target is not None] + [prog.kspec]
    return merge_cuts(*(spec_cuts(s) for s in specs))


def _place_local(full, spec: ShardingSpec, dev):
    """A host value's block on this device (every device holds the whole value: cut, no communication)."""
    xp = dev.xp
    x = xp.asarray(full)
    for d, (refs, n) in enumerate(zip(spec.dim_refs, x.shape)):
        k = prod(r.size for r in refs)
        if k == 1:
            continue
        c = chunk(n, k)
        x = _fit(xp, x, d, k * c)
        x = dev.lax.dynamic_slice_in_dim(x, dev.linear(refs) * c, c, axis=d)
    if spec.partial_axes:  # the whole value on coordinate 0 of each partial group, zeros elsewhere
        first = xp.asarray(True)
        for r in spec.partial_refs:
            first = first & (dev.linear([r]) == 0)
        x = xp.where(first, x, xp.zeros((), dtype=x.dtype))
    return x


class _StepContext:
    """What a collective's lowering (``Collective.lower``) sees: jax, this device, the step's mesh atoms."""

    def __init__(self, dev, refs, shape: tuple[int, ...], reduce_op: str) -> None:
        self.lax, self.xp, self.dev = dev.lax, dev.xp, dev
        self.refs = refs
        self.names = dev.axis_names(refs)
        self.k = prod(r.size for r in refs)
        self.shape = shape
        self.reduce_op = reduce_op

    def index(self):
        """This device's position along the step's atoms (mixed radix, major first)."""
        return self.dev.linear(self.refs)

    def fit(self, x, axis: int, n: int):
        return _fit(self.xp, x, axis, n)

    def exchange(self, x, src: ShardingSpec, dst: ShardingSpec):
        return _lower_exchange(x, src, dst, self.shape, self.dev)


def _lower_plan(x, plan: reshard.Plan, shape: tuple[int, ...], dev, reduce_op: str, dst: ShardingSpec,
                skipped: list):
    """A reshard plan as jax.lax collectives on one device's block: each step through its registry entry's
    ``lower`` (its jax.lax twin). A tensor with no elements moves nothing: every device's block of ``dst`` is
    empty (its logged events, all of 0 bytes, go to ``skipped``)."""
    if plan.segments and 0 in tuple(shape):
        skipped += plan.events
        return dev.xp.zeros(chunks(dst, tuple(shape)), dtype=x.dtype)
    for seg in plan.segments:
        for s in seg.steps:
            if s.fused:
                continue
            c = C.REGISTRY.get(s.kind)
            if c is None or c.lower is None:
                raise ShardingError(f"jit: the collective {s.kind!r} has no jax.lax lowering, so a plan using it "
                                    f"cannot be compiled; give its registry entry one "
                                    f"(Collective(..., lower=fn), fn(block, step, ctx) -> block)")
            x = c.lower(x, s, _StepContext(dev, [seg.atoms[a] for a in s.atoms], tuple(shape), reduce_op))
    return x


def _lower_exchange(x, src: ShardingSpec, dst: ShardingSpec, shape, dev):
    """Every device keeps what it holds of its target block and receives the rest, one ppermute a round."""
    xp, lax = dev.xp, dev.lax
    rounds = reshard.exchange_detail(tuple(shape), src, dst)
    sb, tb = reshard._boxes(src, tuple(shape)), reshard._boxes(dst, tuple(shape))
    mesh = src.mesh
    n = len(mesh.devices)
    cs, ct = chunks(src, shape), chunks(dst, shape)
    # block origins (unclipped ceil-rule starts) per mesh position
    s_origin = np.array([[_origin(src, shape, p, j) for j in range(len(shape))] for p in range(n)],
                        dtype=np.int64).reshape(n, len(shape))
    t_origin = np.array([[_origin(dst, shape, p, j) for j in range(len(shape))] for p in range(n)],
                        dtype=np.int64).reshape(n, len(shape))
    me = dev.position()
    out = xp.zeros(ct, dtype=x.dtype)

    def write(out, piece, recv_off, size):
        slab = piece.shape
        big = xp.pad(out, [(0, s) for s in slab])
        region = lax.dynamic_slice(big, tuple(recv_off), slab)
        mask = xp.asarray(True)
        for j, s in enumerate(slab):
            iota = xp.arange(s).reshape((-1,) + (1,) * (len(slab) - j - 1))
            mask = mask & (iota < size[j])
        big = lax.dynamic_update_slice(big, xp.where(mask, piece, region), tuple(recv_off))
        return big[tuple(slice(0, c) for c in ct)]

    # what this device already holds of its target block
    lo = np.maximum(sb[..., 0], tb[..., 0])
    hi = np.minimum(sb[..., 1], tb[..., 1])
    size = np.maximum(hi - lo, 0)
    has = (size > 0).all(axis=1)
    size = np.where(has[:, None], size, 0)
    send_off = np.where(has[:, None], lo - s_origin, 0)
    recv_off = np.where(has[:, None], lo - t_origin, 0)
    slab = tuple(int(v) for v in size.max(axis=0)) if n else ()
    if all(slab):
        src_block = xp.pad(x, [(0, s) for s in slab])
        piece = lax.dynamic_slice(src_block, tuple(xp.asarray(send_off)[me]), slab)
        out = write(out, piece, xp.asarray(recv_off)[me], xp.asarray(size)[me])
    for r in rounds:
        if not all(r.slab):
            continue
        send = np.zeros((n, len(shape)), dtype=np.int64)
        recv = np.zeros((n, len(shape)), dtype=np.int64)
        sizes = np.zeros((n, len(shape)), dtype=np.int64)
        pairs = []
        for u, v, box in r.pieces:
            start = np.array([b[0] for b in box])
            send[u] = start - s_origin[u]
            recv[v] = start - t_origin[v]
            sizes[v] = [b[1] - b[0] for b in box]
            pairs.append((u, v))
        src_block = xp.pad(x, [(0, s) for s in r.slab])
        piece = lax.dynamic_slice(src_block, tuple(xp.asarray(send)[me]), r.slab)
        got = lax.ppermute(piece, dev.prog.names, perm=pairs)
        out = write(out, got, xp.asarray(recv)[me], xp.asarray(sizes)[me])
    return out


def _origin(spec: ShardingSpec, shape, p: int, j: int) -> int:
    """Global index of local row 0 of dim ``j`` on the device at mesh position ``p`` (the ceil rule, unclipped)."""
    from .layout import dim_position
    mesh = spec.mesh
    coords = mesh.coords(mesh.devices[p])
    return dim_position(spec.dim_refs[j], mesh, coords) * chunk(shape[j], spec.num_shards(j))
