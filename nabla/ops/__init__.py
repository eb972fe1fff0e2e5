"""The numpy-like functions, one module per op family; every op is an entry of the registry (``registry``), from
which ``nb.<name>``, numpy's protocols on tensors, ONNX export and random programs are read. ``nabla.ops.<name>``
is an op's function (ops registered later too); ``elementwise`` and ``register`` add ops."""

from __future__ import annotations

from ..tensor import Tensor
from . import registry
from .core import ArrayLike, _align, _arg, _axes, apply, _is_diff, _mask, _named, _ndim, _shape
from .registry import REGISTRY, _unbroadcast, reduce_cotangent, as_onnx, by_numpy, by_onnx, elementwise, function, lookup, onnx_export, register, unregister
from .creation import _numeric_array, abstract, arange, full, ones, tensor, zeros
from .pointwise import (_ASTYPE, _BINARY, _RECIPROCAL, _UNARY, _WHERE, abs, add, astype, clip, cos, divide, equal, exp,
                        greater, greater_equal, less, less_equal, log, maximum, minimum, multiply, negative, not_equal,
                        power, relu, sigmoid, sin, sqrt, subtract, tanh, where)
from .shape import (_BROADCAST, _CONCAT, _EXPAND, _RESHAPE, _SQUEEZE, _TRANSPOSE, _pad_dim, _scatter_slice,
                    broadcast_to, concatenate, expand_dims, flip, pad, reshape, roll, split, squeeze, stack, swapaxes,
                    transpose)
from .gather import (_SCATTER, _SCATTER_ALONG, _TAKE, _TAKE_ALONG, argwhere, flatnonzero, nonzero, take,
                     take_along_axis)
from .indexing import _INDEX, _KEYS, _normalize_key, getitem
from .reduction import (_ARGMAX, _MAX, _MIN, _SOFTMAX, _SUM, _folded, _leading, _reduce_leading, all, any, argmax,
                        argmin, cumsum, max, mean, min, prod, softmax, std, sum, var)
from .contraction import _EINSUM, _MATMUL, _einsum_terms, einsum, matmul
from .masks import dropout, tril, triu
from . import lax_ops  # internal ops (bitwise, shifts, bitcast, threefry2x32, ...) that nb.import_jax runs
from .sorting import argsort, sort, top_k
from .nn import (_LOG_SOFTMAX, _LOGSUMEXP, _ONE_HOT, _STOP, cross_entropy, log_softmax, logsumexp, one_hot,
                 stop_gradient)
from .attention import _ATTENTION, _DBIAS, _DKV, _DQ, dot_product_attention
from .windowed import (_AVG_POOL, _CONV, _MAX_POOL, pad_spatial, spatial_pads, per_dim, avg_pool, batch_norm, conv,
                       global_avg_pool, layer_norm, max_pool, max_pool_scatter)

def __getattr__(name: str):
    """An op registered after import, by name (PEP 562)."""
    fn = registry.function(name)
    if fn is None:
        raise AttributeError(f"module 'nabla.ops' has no attribute {name!r}")
    return fn


from . import methods  # noqa: E402 - after every op family: it reads them

methods.attach(Tensor)  # t + u, t.sum(), t.T, Tensor.ones: set where the ops are (tensor.py sits below them)
