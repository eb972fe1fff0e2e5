"""nabla: an eager SPMD tensor framework; numpy-like code on tensors sharded over a named device mesh."""

from . import random
from .array_backend import backend
from .collectives import CommEvent, CommLog, comm_log
from .errors import ShardingError
from .mesh import DeviceMesh
from .ops import (abs, abstract, add, arange, argmax, astype, broadcast_to, concatenate, cos, divide, einsum,
                  equal, exp, expand_dims, getitem, greater, greater_equal, less, less_equal, log, matmul, max,
                  maximum, mean, min, minimum, multiply, negative, not_equal, ones, power, relu, reshape, sigmoid,
                  sin, softmax, sqrt, squeeze, subtract, sum, swapaxes, tanh, tensor, transpose, where, zeros)
from .propagation import strategy
from .spec import DimSpec, ShardingSpec
from .tensor import Tensor

__version__ = "0.1.0"


def visualize_sharding(t: Tensor, **kw) -> str:
    """Draw which devices hold which block of a 1-D or 2-D tensor; prints and returns the drawing."""
    from .debug import visualize_sharding as _vis
    return _vis(t, **kw)


def from_jax(array) -> Tensor:
    from .interop.jax import from_jax as _from
    return _from(array)




__all__ = [n for n in dir() if not n.startswith("_")]
