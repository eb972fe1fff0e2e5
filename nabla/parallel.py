"""Tensor parallelism by plan, with PyTorch DTensor's names: ``ColwiseParallel`` and ``RowwiseParallel`` say how a
linear layer's weights are sharded, ``parallelize(params, mesh, plan)`` places a dict of weights by a plan
``{name_pattern: style}``. The communication itself is not written here: propagation finds it (a Megatron MLP,
column-wise then row-wise, makes exactly one all_reduce)."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Mapping

import numpy as np

from .errors import ShardingError
from .mesh import DeviceMesh
from .tensor import Tensor
from . import ops


@dataclass(frozen=True)
class ParallelStyle:
    """How the weights of one layer are laid out over one mesh axis (``None``: ``"tp"``, or the only axis of a
    1-D mesh). ``layout`` is the weight's storage: ``"in_out"`` (``x @ w``, JAX and nabla) or ``"out_in"``
    (``x @ w.T``, PyTorch's ``nn.Linear.weight``)."""

    axis: str | None = None
    layout: str = "in_out"

    def __post_init__(self) -> None:
        if self.layout not in ("in_out", "out_in"):
            raise ShardingError(f"{type(self).__name__}: layout must be 'in_out' (x @ w) or 'out_in' (x @ w.T), "
                                f"got {self.layout!r}")

    def dims(self, name: str, rank: int, axis: str) -> list:
        raise NotImplementedError

    def _axis(self, mesh: DeviceMesh) -> str:
        if self.axis is not None:
            mesh.axis_index(self.axis)  # names the mesh's axes when it has no such axis
            return self.axis
        if mesh.ndim == 1:
            return mesh.axis_names[0]
        if "tp" in mesh.axis_names:
            return "tp"
        raise ShardingError(f"{type(self).__name__}: which mesh axis? mesh {mesh!r} has axes {list(mesh.axis_names)} "
                            f"and none is 'tp'; pass axis=...")

    def _out_in(self, rank: int) -> tuple[int, int]:
        """(output dim, input dim) of a weight of ``rank`` dims (the last two, as matmul reads them)."""
        if self.layout == "in_out":
            return rank - 1, rank - 2
        return rank - 2, rank - 1


class ColwiseParallel(ParallelStyle):
    """Column-wise: the weight's output dim (its columns, in ``x @ w``) is sharded over the axis, and so is the
    bias; the layer's output comes out sharded on its last dim, with no communication."""

    def dims(self, name: str, rank: int, axis: str) -> list:
        spec: list = [None] * rank
        if rank == 1:  # the bias: one entry per output feature
            spec[0] = axis
        elif rank >= 2:
            spec[self._out_in(rank)[0]] = axis
        return spec


class RowwiseParallel(ParallelStyle):
    """Row-wise: the weight's input dim is sharded over the axis; the bias stays replicated (it is added once
    to the sum). Fed a column-wise layer's sharded output, the product is a partial sum over the axis: one
    all_reduce (or reduce_scatter) when a later op needs the value."""

    def dims(self, name: str, rank: int, axis: str) -> list:
        spec: list = [None] * rank
        if rank >= 2:
            spec[self._out_in(rank)[1]] = axis
        return spec


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _rebuild(tree: Mapping, flat: dict[str, Any], prefix: str = "") -> dict:
    return {k: _rebuild(v, flat, f"{prefix}{k}.") if isinstance(v, Mapping) else flat[f"{prefix}{k}"]
            for k, v in tree.items()}


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` names the parameter (``"mlp.fc1.weight"``) or the layer holding it (``"mlp.fc1"``, as DTensor's
    plans name modules), with fnmatch wildcards."""
    if fnmatchcase(name, pattern):
        return True
    parts = name.split(".")
    return any(fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts)))


def parallelize(params: Mapping[str, Any], mesh: DeviceMesh, plan: Mapping[str, Any]) -> dict:
    """``params`` (a dict, possibly nested: names join with ``.``) placed on ``mesh`` by ``plan``: for each
    parameter the first pattern that matches it or its layer gives its style (``ColwiseParallel()``,
    ``RowwiseParallel()``, or a placement ``shard`` takes: a dim list, a ``ShardingSpec``, a ``PartitionSpec``).
    Parameters no pattern matches are replicated. Values may be tensors or arrays; returns the same structure.
    A pattern that matches nothing raises ``ShardingError`` (a typo would otherwise leave weights replicated)."""
    if not isinstance(mesh, DeviceMesh):
        raise ShardingError(f"parallelize(params, mesh, plan): mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(params, Mapping):
        raise ShardingError(f"parallelize: params must be a dict of weights, got {type(params).__name__}")
    flat = _flatten(params)
    used = dict.fromkeys(plan, False)
    out = {}
    for name, value in flat.items():
        t = value if isinstance(value, Tensor) else Tensor._host(np.asarray(value))
        style = None
        for pattern, s in plan.items():
            if _matches(name, pattern):
                style, used[pattern] = s, True
                break
        if style is None:
            dims: Any = [None] * t.ndim
        elif isinstance(style, ParallelStyle):
            dims = style.dims(name, t.ndim, style._axis(mesh))
        else:
            dims = style
        try:
            out[name] = t.shard(mesh, dims)
        except ShardingError as e:
            raise ShardingError(f"parallelize: parameter {name!r} of shape {t.shape}: {e}") from None
    unused = [p for p, hit in used.items() if not hit]
    if unused:
        raise ShardingError(f"parallelize: plan pattern {unused[0]!r} matches no parameter (names: {sorted(flat)})")
    return _rebuild(params, out)


def linear(x: Any, params: Mapping[str, Any], layout: str = "in_out") -> Tensor:
    """``x @ weight + bias`` (``x @ weight.T`` for the ``"out_in"`` layout); ``bias`` is optional."""
    w = params["weight"]
    y = ops.matmul(x, w if layout == "in_out" else ops.swapaxes(w, -1, -2))
    b = params.get("bias")
    return y if b is None else ops.add(y, b)


def init_linear(in_features: int, out_features: int, bias: bool = True, seed: int | None = 0,
                dtype: Any = "float32") -> dict[str, Tensor]:
    """``{"weight": (in, out), "bias": (out,)}`` with weights drawn as PyTorch's ``nn.Linear`` does
    (uniform in ``±1/sqrt(in)``), as host tensors ready for ``parallelize``."""
    rng = np.random.default_rng(seed)
    bound = 1.0 / np.sqrt(in_features)
    p = {"weight": Tensor._host(rng.uniform(-bound, bound, (in_features, out_features)).astype(dtype))}
    if bias:
        p["bias"] = Tensor._host(rng.uniform(-bound, bound, (out_features,)).astype(dtype))
    return p
