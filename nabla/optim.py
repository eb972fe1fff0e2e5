"""Optimizers in optax's functional style: ``state = opt.init(params)``; ``params, state = opt.update(grads,
state, params)``, the new state and parameters written over the old ones in a memory log's accounts (as
PyTorch's optimizers update in place, and JAX's with donated buffers). An update is elementwise: laid out like the parameters it is local (no communication). State
may be laid out otherwise (``init(params, specs=...)``): ZeRO's stages are then layouts, not modes, and the
update moves gradients into the state's layout and new parameters back to theirs, every move in the log."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import collectives as C
from .pytree import _outline, flatten, unflatten
from .sharding import specs_like
from .tensor import Tensor
from .errors import ShardingError
from .ops.creation import zeros_as
from .ops import tensor
from .ops import sqrt
from .args import dtype_arg


def _to(x: Tensor, spec: Any, dtype: Any) -> Tensor:
    """``x`` in ``dtype`` laid out as ``spec`` (a pending sum is made into it: a reduce_scatter where it shards)."""
    if x.dtype != dtype:
        x = x.astype(dtype)
    if spec is None or x.sharding == spec:
        return x
    return x.with_sharding(spec.mesh, spec.dim_specs, spec.replicated_axes)


def _like(x, p):
    """``x`` exactly as ``p`` is laid out and typed (updates are elementwise: nothing moves), so a compiled
    step sees the same signature every time."""
    if x.dtype != p.dtype:
        x = x.astype(p.dtype)
    return x if p.sharding is None or x.sharding == p.sharding else x.with_sharding(
        p.mesh, p.sharding.dim_specs, p.sharding.replicated_axes)


def _check(grads, params, what, state=None, kind=None):
    if state is not None and not isinstance(state, kind):
        raise ShardingError(f"{what}: the state is of type {type(state).__name__}, not the {kind.__name__} that "
                            f"{what.split('.')[0]}.init(params) returns (a state from another optimizer?)")
    gl, gt = flatten(grads)
    pl, pt = flatten(params)
    if gt != pt:  # dicts built in another order: matched by key, as the state is
        try:
            gl, gt = flatten(_as_params(grads, params, what, "gradients"))
        except ShardingError:
            pass
    if gt != pt:
        g, p = _outline(grads), _outline(params)
        raise ShardingError(f"{what}: grads and params have different structures: grads {g[:300]}, "
                            f"params {p[:300]}")
    for g, p in zip(gl, pl):
        if g.shape != p.shape:
            raise ShardingError(f"{what}: a gradient of shape {g.shape} for a parameter of shape {p.shape}")
    return gl, pl, pt


def _as_params(tree: Any, params: Any, what: str, name: str, path: str = "params") -> Any:
    """Optimizer state shaped like the parameters, in the parameters' order: dict entries matched by key, as JAX's
    pytrees match them (whatever order each dict was built in), so a moment never updates another parameter; any
    other difference is an error naming where (a state made by ``init`` of other parameters)."""
    if isinstance(params, dict):
        if not isinstance(tree, dict) or set(tree) != set(params):
            have = f"keys {_keys(tree)}" if isinstance(tree, dict) else f"a {type(tree).__name__}"
            raise ShardingError(f"{what}: the state's {name} at {path} has {have} where the parameters have keys "
                                f"{_keys(params)} (a state from init(...) of other parameters?)")
        return {k: _as_params(tree[k], v, what, name, f"{path}[{k!r}]") for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        if not isinstance(tree, (list, tuple)) or len(tree) != len(params):
            raise ShardingError(f"{what}: the state's {name} at {path} is {_outline(tree)[:200]} where the parameters "
                                f"have {len(params)} entries (a state from init(...) of other parameters?)")
        items = [_as_params(t, p, what, name, f"{path}[{i}]") for i, (t, p) in enumerate(zip(tree, params))]
        return type(params)(*items) if hasattr(params, "_fields") else type(params)(items)
    if params is not None and getattr(tree, "shape", None) != getattr(params, "shape", None):
        raise ShardingError(f"{what}: the state's {name} at {path} has shape {getattr(tree, 'shape', None)} for a "
                            f"parameter of shape {getattr(params, 'shape', None)} (a state from init(...) of other "
                            f"parameters?)")
    return tree


def _keys(d: dict) -> str:
    return ", ".join(sorted(map(repr, d)))


class SGDState(NamedTuple):
    momentum: Any  # a pytree like params, or None without momentum


class SGD:
    """``p <- p - lr * v`` with ``v <- momentum * v + g`` (plain gradient descent when momentum is 0)."""

    def __init__(self, lr: float, momentum: float = 0.0) -> None:
        self.lr, self.momentum = float(lr), float(momentum)

    def init(self, params: Any, specs: Any = None) -> SGDState:
        if not self.momentum:
            return SGDState(None)
        leaves, tree = flatten(params)
        layouts = specs_like(params, specs, "SGD.init")
        return _state(SGDState(unflatten(tree, [zeros_as(p, s) for p, s in zip(leaves, layouts)])))

    def update(self, grads: Any, state: SGDState, params: Any) -> tuple[Any, SGDState]:
        gl, pl, tree = _check(grads, params, "SGD.update", state, SGDState)
        _given(gl, state, pl)
        if self.momentum:
            state = SGDState(_as_params(state.momentum, params, "SGD.update", "momentum"))
            vl, _ = flatten(state.momentum)
            vl = [_like(v * self.momentum + _to(g, v.sharding, v.dtype), v) for v, g in zip(vl, gl)]
            new = [_like(_to(p, v.sharding, p.dtype) - v * self.lr, p) for p, v in zip(pl, vl)]
            C.replaces(new + vl, pl + flatten(state.momentum)[0])
            return _params(unflatten(tree, new)), _state(SGDState(unflatten(tree, vl)))
        new = [_like(p - g * self.lr, p) for p, g in zip(pl, gl)]
        C.replaces(new, pl)
        return _params(unflatten(tree, new)), state


class AdamState(NamedTuple):
    count: Any  # a 0-d int tensor, so a compiled step does not change with it
    mu: Any
    nu: Any
    master: Any = None  # a float32 (``master_dtype``) copy of the parameters, or None


class Adam:
    """Adam (Kingma and Ba), bias-corrected, as optax.adam: ``p <- p - lr * m_hat / (sqrt(v_hat) + eps)``.

    ``master_dtype="float32"``: mixed precision as users write it: bfloat16 parameters and gradients, a float32
    master copy of the parameters and float32 moments; each update runs on the master copy and the new
    parameters are it, rounded to the parameters' dtype (16 bytes of model state per parameter: ZeRO's count).
    ``init(params, specs=...)`` lays the state (master copy and moments) out as ``specs`` instead of as the
    parameters: with the state sharded over the data-parallel axis and replicated parameters, that is ZeRO stage
    1 (each update sums the gradients into the state's layout, a reduce_scatter, and all_gathers the new
    parameters); with gradients already reduce_scattered into that layout (``with_sharding``), stage 2; with the
    parameters sharded too, stage 3 (FSDP)."""

    def __init__(self, lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                 master_dtype: Any = None) -> None:
        self.lr, self.b1, self.b2, self.eps = float(lr), float(b1), float(b2), float(eps)
        if master_dtype is not None:
            master_dtype = dtype_arg(master_dtype, "Adam", kinds="f")
        self.master_dtype = master_dtype

    def init(self, params: Any, specs: Any = None) -> AdamState:
        leaves, tree = flatten(params)
        layouts = specs_like(params, specs, "Adam.init")
        dt = [self.master_dtype or p.dtype for p in leaves]
        mu = [zeros_as(p, s, d) for p, s, d in zip(leaves, layouts, dt)]
        nu = [zeros_as(p, s, d) for p, s, d in zip(leaves, layouts, dt)]
        master = None
        if self.master_dtype is not None:
            master = unflatten(tree, [_to(p, s, d) for p, s, d in zip(leaves, layouts, dt)])
        return _state(AdamState(tensor(np.int32(0)), unflatten(tree, mu), unflatten(tree, nu), master))

    def update(self, grads: Any, state: AdamState, params: Any) -> tuple[Any, AdamState]:
        gl, pl, tree = _check(grads, params, "Adam.update", state, AdamState)
        state = state._replace(mu=_as_params(state.mu, params, "Adam.update", "mu"),
                               nu=_as_params(state.nu, params, "Adam.update", "nu"),
                               master=None if state.master is None else
                               _as_params(state.master, params, "Adam.update", "master copy"))
        _given(gl, state, pl)
        ml, _ = flatten(state.mu)
        vl, _ = flatten(state.nu)
        xl = flatten(state.master)[0] if state.master is not None else [_to(p, m.sharding, m.dtype)
                                                                         for p, m in zip(pl, ml)]
        gl = [_to(g, m.sharding, m.dtype) for g, m in zip(gl, ml)]  # into the state's layout and dtype
        t = state.count + 1
        ml = [_like(m * self.b1 + g * (1 - self.b1), m) for m, g in zip(ml, gl)]
        vl = [_like(v * self.b2 + (g * g) * (1 - self.b2), v) for v, g in zip(vl, gl)]
        tf = t.astype(np.float64)
        c1, c2 = 1 - self.b1 ** tf, 1 - self.b2 ** tf
        xl = [_like(x - (m / c1.astype(m.dtype)) / (sqrt(v / c2.astype(v.dtype)) + self.eps) * self.lr, x)
              for x, m, v in zip(xl, ml, vl)]
        new = [_to(x, p.sharding, p.dtype) for x, p in zip(xl, pl)]  # back to the parameters' layout and dtype
        old = flatten(state.mu)[0] + flatten(state.nu)[0] + (flatten(state.master)[0] if state.master is not None
                                                             else [])
        C.replaces(new + ml + vl + (xl if state.master is not None else []), pl + old)  # in place, as torch's
        master = unflatten(tree, xl) if state.master is not None else None
        return _params(unflatten(tree, new)), _state(AdamState(t, unflatten(tree, ml), unflatten(tree, vl), master))


def _given(grads: list, state: Any, params: list) -> None:
    """What an update reads, so told to an open memory log (made outside it, they are known from here on)."""
    C.tag([g for g in grads if isinstance(g, Tensor)], "grads")
    C.tag([p for p in params if isinstance(p, Tensor)], "params")
    _state(state)


def _state(state: Any) -> Any:
    """Optimizer state, so told to an open memory log."""
    C.tag([x for x in flatten(tuple(state))[0] if isinstance(x, Tensor)], "optimizer")
    return state


def _params(params: Any) -> Any:
    C.tag([x for x in flatten(params)[0] if isinstance(x, Tensor)], "params")
    return params
