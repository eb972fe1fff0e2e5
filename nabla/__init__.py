"""nabla: an eager SPMD tensor framework; numpy-like code on tensors sharded over a named device mesh."""

import builtins as _builtins

from . import distributed, lax, numpy_api, optim, random  # (numpy_api: numpy's protocols on tensors)
from .shard_map import shard_map
from .distributed import from_process_local
from .autodiff import checkpoint, grad, value_and_grad, vjp
from .batching import vmap
from .backends import backend
from .collectives import CommEvent, CommLog, comm_log
from .cost import AxisCost, CostModel, cost_model
from .errors import ShardingError
from .jit import jit  # (jax is imported when a function is first traced, not here)
from .mesh import DeviceMesh
from .ops import (abstract, arange, ones, tensor, zeros,  # making tensors
                  batch_norm, clip, cross_entropy, dot_product_attention, global_avg_pool, layer_norm, mean, split, stack, std, swapaxes,
                  var,  # built from registered ops
                  argwhere, flatnonzero, nonzero)  # refused: their shape depends on data (use nb.where)
from .ops import registry as _registry
from .propagation import strategy
from .spec import DimSpec, ShardingSpec
from .tensor import Tensor
from .placement import device_put, from_local, with_sharding_constraint
from .sharding import NamedSharding
from .debug import explain, visualize_sharding
from . import parallel
from .collectives import named_scope
from .plan import Cluster, Hardware, pipeline_estimate
from .plan.estimate import estimate, flops
from .plan.memory import memory_log
from .plan.autoshard import autoshard  # (scipy is imported when a plan is solved, not here)
from .jax_import import import_jax  # (jax is imported when a function is first traced, not here)
from .interop.arrays import from_jax as _from

__version__ = "0.1.0"


def from_jax(array, mesh: DeviceMesh | None = None) -> Tensor:
    """A jax.Array back as a tensor with its NamedSharding (onto ``mesh`` when given; by default onto the nabla
    mesh it came from, when it went to jax with ``t.to_jax()``)."""
    return _from(array, mesh)


def __getattr__(name: str):
    """An op registered after ``import nabla`` (``nb.ops.elementwise``, ``nb.ops.register``): its function (PEP 562)."""
    fn = _registry.function(name)
    if fn is None:
        raise AttributeError(f"module 'nabla' has no attribute {name!r}")
    return fn


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_registry.names()))


# every registered op's function: nb.add, nb.matmul, ... (ops registered later: __getattr__)
globals().update({n: _registry.function(n) for n in _registry.names()})

# ``from nabla import *`` gives the public API only, and leaves Python's sum, max, min and abs alone
# (use nb.sum, nb.max, nb.min, nb.abs).
__all__ = [
    "DeviceMesh", "DimSpec", "ShardingSpec", "Tensor", "ShardingError", "CommEvent", "CommLog", "CostModel",
    "AxisCost", "comm_log", "cost_model", "strategy", "backend", "random", "optim", "visualize_sharding",
    "from_jax", "from_local", "device_put", "with_sharding_constraint", "NamedSharding", "parallel", "explain", "grad", "value_and_grad",
    "vjp", "vmap", "jit", "distributed", "from_process_local", "shard_map", "lax",
    "tensor", "ones", "zeros", "arange", "abstract", "mean", "split", "stack", "std", "swapaxes", "var", "global_avg_pool", "batch_norm", "layer_norm",
    "clip", "checkpoint", "Hardware", "Cluster", "estimate", "pipeline_estimate", "flops", "memory_log", "named_scope", "autoshard",
    "cross_entropy", "nonzero", "argwhere", "flatnonzero", "import_jax",
] + [n for n in _registry.names() if not hasattr(_builtins, n)]
