"""Tracing a JAX function for nabla: the arguments' pytree flattened (tensors and arrays are inputs, anything else is
static), ``jax.make_jaxpr`` on ``jax.ShapeDtypeStruct``s with JAX's abstract mesh set to the tensors' mesh, and the
compiled jaxpr cached per signature. Calling runs the cached program (``interpreter``) on the tensors."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple

import numpy as np

from .. import collectives as C
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..ops import astype, tensor
from ..tensor import Tensor
from ..trace import tracing_for_replay
from .interpreter import Compiled, Eval, Lit, compile_jaxpr, is_key


def import_jax(fn: Callable) -> "Imported":
    """``nb.import_jax(fn)``: a callable taking what ``fn`` takes, with nabla tensors (sharded, or ``nb.abstract``) and
    pytrees of them in place of arrays, and returning nabla tensors in ``fn``'s output structure.

    ``fn`` is traced once per signature (``jax.make_jaxpr``; the shapes, dtypes, pytree structure, static arguments
    and mesh: the arguments' shardings do not change a jaxpr, so they are not part of it) with JAX's abstract mesh
    set to the tensors' mesh, so ``jax.lax.with_sharding_constraint(x, P("dp", "tp"))`` and ``jax.shard_map``
    resolve there. Its jaxpr then runs equation by equation as nabla ops: propagation, the planner and the comm
    log see a JAX program as they see nabla code, and each op is labelled with the line of ``fn`` it came from.
    Arguments that are tensors, numpy arrays or jax arrays are inputs; any other leaf (a Python number, a
    function, a string) is static: a new value traces again. PRNG keys are passed as their raw ``uint32`` data
    (``jax.random.PRNGKey(0)`` or ``jax.random.key_data(key)``); ``jax.random`` then gives JAX's bits exactly."""
    if not callable(fn):
        raise ShardingError(f"import_jax: expected a function, got {type(fn).__name__}")
    return Imported(fn)


class Traced(NamedTuple):
    """One signature's program: the compiled jaxpr, its constants, the output structure (with the output leaves
    that are not arrays, e.g. an Equinox model's activation function, kept as they came), and the avals of the
    inputs."""

    prog: Compiled
    consts: tuple
    out_tree: Any
    out_static: tuple  # per output leaf: None (an array: the program's next output) or (the value,)
    in_avals: tuple


class Imported:
    """``nb.import_jax(fn)``: call it as ``fn``. ``.trace(*args, **kwargs)`` gives the signature's ``Traced`` program
    (``.prog.jaxpr`` is JAX's jaxpr) without running it."""

    def __init__(self, fn: Callable) -> None:
        # (names no wrapper shares: functools.update_wrapper copies this __dict__ into whatever wraps it, nb.jit's)
        self._jax_fn = fn
        self._traces: dict = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        jax = _jax()
        tr, dyn, mesh = self._traced(jax, args, kwargs)
        # without data, large constants are made abstract too; not in a trace nb.jit replays (it needs their values)
        abstract = any(x.is_abstract for x in dyn) and not tracing_for_replay()
        ev = Eval(abstract, mesh, C.current_scope())
        ins = [_typed(x, aval) for x, aval in zip(dyn, tr.in_avals)]
        outs = ev.run(tr.prog, tr.consts, ins)
        outs = [o.value if type(o) is Lit else o for o in outs]
        it = iter(o if isinstance(o, Tensor) else _out_value(o) for o in outs)
        leaves = [next(it) if s is None else s[0] for s in tr.out_static]
        return jax.tree_util.tree_unflatten(tr.out_tree, leaves)

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        return self._traced(_jax(), args, kwargs)[0]

    def _traced(self, jax: Any, args: tuple, kwargs: dict) -> tuple[Traced, list, DeviceMesh | None]:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        dyn, statics, mask = [], [], []
        for x in leaves:
            if isinstance(x, Tensor):
                dyn.append(x)
            elif isinstance(x, np.ndarray) or _is_jax_array(x):
                if is_key(x):
                    raise ShardingError("import_jax: a typed PRNG key array cannot be a tensor; pass its raw data "
                                        "(jax.random.key_data(key), or a jax.random.PRNGKey)")
                dyn.append(tensor(np.asarray(x)))
            else:
                statics.append(x)
                mask.append(False)
                continue
            mask.append(True)
        mesh = _mesh_of(dyn)
        key = (tree, tuple(mask), tuple((x.shape, x.dtype) for x in dyn), tuple(_static_key(s) for s in statics),
               mesh)
        tr = self._traces.get(key)
        if tr is None:
            tr = self._traces[key] = self._trace(jax, tree, mask, statics, dyn, mesh)
        return tr, dyn, mesh

    def _trace(self, jax: Any, tree: Any, mask: list, statics: list, dyn: list, mesh: DeviceMesh | None) -> Traced:
        fn = self._jax_fn
        result: list = []

        def flat(*values):
            it, st = iter(values), iter(statics)
            a, kw = jax.tree_util.tree_unflatten(tree, [next(it) if m else next(st) for m in mask])
            leaves, out_tree = jax.tree_util.tree_flatten(fn(*a, **kw))
            static = tuple(None if _array_like(jax, x) else (x,) for x in leaves)
            result.append((out_tree, static))
            return [x for x, s in zip(leaves, static) if s is None]

        structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in dyn]
        with _abstract_mesh(jax, mesh):
            closed = jax.make_jaxpr(flat)(*structs)
        prog = compile_jaxpr(closed.jaxpr, top=True)
        consts = tuple(_const(c) for c in closed.consts)
        out_tree, static = result[-1]
        return Traced(prog, consts, out_tree, static, tuple(v.aval for v in closed.jaxpr.invars))


def _jax() -> Any:
    try:
        import jax
    except ImportError:  # pragma: no cover - the extra is missing
        raise ShardingError("import_jax needs jax (pip install 'nabla-spmd[jax]')") from None
    return jax


def _is_jax_array(x: Any) -> bool:
    return type(x).__module__.startswith("jax") and hasattr(x, "shape") and hasattr(x, "dtype")


def _array_like(jax: Any, x: Any) -> bool:
    """An output leaf JAX makes an array of (arrays, tracers, numbers); anything else passes through as it is."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _static_key(x: Any) -> Any:
    """A static leaf as part of the cache key: itself when hashable, else its identity."""
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return (type(x), x)


def _mesh_of(dyn: list) -> DeviceMesh | None:
    mesh = None
    for i, x in enumerate(dyn):
        m = x.mesh
        if m is None:
            continue
        if mesh is None:
            mesh = m
        elif m != mesh:
            raise ShardingError(f"import_jax: argument leaf {i} is on mesh {m!r} and another on {mesh!r}; one program "
                                f"runs on one mesh")
    return mesh


@contextlib.contextmanager
def _abstract_mesh(jax: Any, mesh: DeviceMesh | None):
    """JAX's abstract mesh set to ``mesh`` while tracing (axes in Auto mode: shardings are what nabla propagates)."""
    if mesh is None:
        yield
        return
    from jax.sharding import AbstractMesh, AxisType
    am = AbstractMesh(tuple(mesh.shape), tuple(mesh.axis_names), axis_types=(AxisType.Auto,) * len(mesh.shape))
    with jax.sharding.use_abstract_mesh(am):
        yield


def _const(c: Any) -> Tensor:
    """A closed-over constant of the jaxpr as a host tensor."""
    return tensor(np.asarray(c))


def _typed(x: Tensor, aval: Any) -> Tensor:
    """An argument in the dtype JAX traced it with (a float64 array is float32 to JAX without x64)."""
    return x if x.dtype == aval.dtype else astype(x, aval.dtype)


def _out_value(o: Any) -> Any:
    """A result that is not a tensor: a literal or constant output as a host tensor; a PRNG key as its raw data."""
    data = getattr(o, "data", None)
    if isinstance(data, Tensor):
        return data
    return tensor(np.asarray(o))
