"""``nb.estimate`` and ``nb.flops``: run a function as written, abstractly (no data, no kernel),
and price its recorded steps on a described cluster (compute, communication on the cluster's links, memory per
device). The program is the user's own: nothing is re-described in a config file."""

from __future__ import annotations

from typing import Any, Callable

from .. import collectives as C
from ..pytree import flatten, unflatten
from ..scoped import few_collections
from ..errors import ShardingError
from ..step import block_elems
from ..tensor import Tensor
from .cluster import Cluster
from .fusion import REDUCE_OPS
from .memory import memory_log
from .report import Report, estimate_steps
from .schedule import overlap_modes
from .steps import MATMUL_OPS, PricedStep

def _abstract(args: Any) -> Any:
    """The same arguments with every tensor replaced by a data-free one of its shape, dtype and layout."""
    leaves, tree = flatten(args)
    return unflatten(tree, [Tensor(None, x.sharding, x.shape, x.dtype) if isinstance(x, Tensor) else x
                            for x in leaves])


def priced_step(step: Any) -> PricedStep:
    """A recorded step as the estimator reads it: its costs, and the dataflow fusion and the schedule need (the
    operands' values and bytes, the value it makes, the elements its kernel runs over: a reduction's operand,
    else its result; the value each collective moves; the dtype a matmul multiplies in). A view (a reshape or
    transpose that shares its operand's storage, ``Step.alias``) is an ``"alias"``: no kernel, as cuBLAS and
    XLA read a transposed or reshaped operand in place."""
    operands = [u for u in step.uses if u.value]
    reads = tuple([(u.value, _block(u.dst, u.shape) * u.dtype.itemsize) for u in operands])
    size = step.out_dtype.itemsize
    elems = out = _block(step.out_spec, step.out_shape)
    name = step.name
    if name in REDUCE_OPS and operands:
        elems = max(b // u.dtype.itemsize for u, (_, b) in zip(operands, reads))
    bytes_in = 0 if isinstance(step.op, str) else sum([b for _, b in reads])
    events = step.events
    moves = tuple([u.value for u in step.uses for _ in u.events + u.inside]) + (step.out,) * len(step.post) \
        if events else ()
    view = getattr(step, "alias", 0) or (getattr(step.op, "view", False) and step.prog is None)  # host: numpy's view
    kind = "alias" if view and not events and not isinstance(step.op, str) else ""
    in_dtype = None
    if name in MATMUL_OPS:
        floats = [u.dtype for u in operands if u.dtype.kind == "f" or u.dtype.name.startswith(("bfloat", "float"))]
        in_dtype = max(floats, key=lambda d: d.itemsize) if floats else None
    return PricedStep(name, step.user, step.phase, step.out_dtype, step.flops, bytes_in,
                      out * size, events, getattr(step, "layer", "") or None,
                      reads, step.out, elems, kind, in_dtype, moves)


_BLOCKS: dict[int, tuple[Any, dict]] = {}  # id(layout) -> (the layout, kept alive; shape -> elements)


def _block(spec: Any, shape: tuple[int, ...]) -> int:
    """Elements of one device's block (the largest), as ``nabla.step`` counts them; cached by the layout
    object's identity (a program's thousands of steps share a few hundred layouts, and comparing equal layouts
    costs more than counting), the layout held so its id is not reused."""
    got = _BLOCKS.get(id(spec))
    if got is None or got[0] is not spec:
        if len(_BLOCKS) > 4096:
            _BLOCKS.clear()
        got = _BLOCKS[id(spec)] = (spec, {})
    n = got[1].get(shape)
    if n is None:
        n = got[1][shape] = block_elems(spec, shape)
    return n


_priced = priced_step


def _mesh_of(steps: list, args: Any) -> Any:
    meshes = {getattr(s.out_spec, "mesh", None) for s in steps} | \
        {x.sharding.mesh for x in flatten(args)[0] if isinstance(x, Tensor) and x.sharding is not None}
    meshes.discard(None)
    if not meshes:
        raise ShardingError("estimate: no tensor of the function is on a mesh: place its arguments on one made with "
                            "cluster.mesh(...), e.g. x.shard(mesh, spec) or nb.abstract(shape, dtype).shard(mesh, "
                            "spec)")
    if len(meshes) != 1:
        raise ShardingError(f"estimate: the function must run on one mesh (made with cluster.mesh(...)); it uses "
                            f"{len(meshes)}: {sorted(map(repr, meshes))}")
    return meshes.pop()


def estimate(fn: Callable, cluster: Cluster, overlap: Any = "grads", model_flops: float | None = None,
             fusion: bool = True) -> Callable:
    """``nb.estimate(fn, cluster)(*args)``: run ``fn`` on data-free twins of its tensor arguments (their shapes,
    dtypes and shardings) and price what it recorded on ``cluster``: a ``Report`` (step time, exposed
    communication, TFLOP/s and MFU per device, memory per device against the device's HBM, a per-layer table, a
    Chrome trace). ``overlap``: "none", "grads" (gradient collectives overlap the backward compute that
    follows them, as DDP and FSDP do), "all", or a tuple of "grads", "params" (parameter gathers prefetched a
    layer ahead), "tp" (tensor-parallel collectives pipelined with their matmuls) and "p2p" (pipeline sends,
    for ``pipeline_estimate``): ``schedule.simulate`` says how each runs. ``model_flops`` (per device) is what MFU counts; by default every
    recorded FLOP that is not recomputation. ``fusion`` (default on): each chain of consecutive elementwise
    steps is priced as one kernel that reads its inputs and writes its outputs once, as XLA's fusion and
    Megatron-LM's fused kernels run them (``nabla/plan/fusion.py``); ``False`` prices every step alone."""
    if not isinstance(cluster, Cluster):
        raise ShardingError(f"estimate: cluster must be an nb.Cluster, got {type(cluster).__name__}")
    overlap_modes(overlap)  # validates
    if not isinstance(fusion, bool):
        raise ShardingError(f"estimate: fusion must be True or False, got {fusion!r}")

    def run(*args: Any, **kwargs: Any) -> Report:
        a, k = _abstract(args), _abstract(kwargs)
        with few_collections():  # a large step's records live until it is priced
            with C.comm_log() as log, memory_log() as mem:
                mem.hold(x for x in flatten((a, k))[0] if isinstance(x, Tensor))  # every argument, from the start
                fn(*a, **k)
            steps = list(log.steps)
            mesh = _mesh_of(steps, (args, kwargs))
            model = model_flops
            if model is None:
                model = sum(s.flops for s in steps if s.phase != "recompute")
            return estimate_steps([_priced(s) for s in steps], cluster, mesh, overlap, model, mem, fusion=fusion)

    return run


def flops(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """The FLOPs of ``fn(*args, **kwargs)`` summed over every device of the run (for an unsharded program, the
    model's FLOPs: a matmul is 2mnk), counted from the recorded steps of an abstract run (no data)."""
    with C.comm_log() as log:
        fn(*_abstract(args), **_abstract(kwargs))
    total = 0
    for s in log.steps:
        spec = s.out_spec
        devices = len(spec.mesh.devices) if getattr(spec, "mesh", None) is not None else 1
        total += s.flops * devices
    return total
