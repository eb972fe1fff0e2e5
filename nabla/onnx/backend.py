"""``Backend``: nabla as an ``onnx.backend.base.Backend``, so ``onnx.backend.test.BackendTest`` runs ONNX's
own node tests on it. Every input is sharded on a 2-device mesh where it can be, by one of two
placements: ``"batch"`` (the default) puts the mesh's axis ``"d"`` on dim 0, ``"spatial"`` on dim 2 of
inputs of rank 3 or more (the first spatial dim of ``N, C, *spatial``: conv, pool and norm inputs then
exchange halos) and on the last dim of others; a dim with fewer elements than devices stays whole
(uneven sizes follow the ceil rule). Results are read back with ``.numpy()``. ``backend_for(placement)``
is the ``Backend`` class of a placement (``Backend`` itself for ``"batch"``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend as _Backend
from onnx.backend.base import BackendRep as _BackendRep

import nabla as nb

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..tensor import Tensor
from .graph import Program, load, pick_config, run_kept
from .ops import holdable, value

MESH = DeviceMesh("onnx_backend", (2,), ("d",))


PLACEMENTS = ("batch", "spatial")


def placed_dim(ndim: int, placement: str = "batch") -> int | None:
    """The dim a placement shards on an input of rank ``ndim`` (None for a scalar)."""
    if placement not in PLACEMENTS:
        raise ShardingError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if ndim < 1:
        return None
    if placement == "batch":
        return 0
    return 2 if ndim >= 3 else ndim - 1


def shard_input(value: Any, mesh: DeviceMesh = MESH, placement: str = "batch") -> Tensor:
    """The backend's placement rule: the placement's dim (``placed_dim``) over the mesh's first axis when
    it has at least as many elements as that axis has devices; scalars, short and non-numeric values stay
    replicated."""
    arr = np.asarray(value)
    t = nb.tensor(arr)
    axis = mesh.axis_names[0]
    d = placed_dim(arr.ndim, placement)
    if d is not None and arr.shape[d] >= mesh.shape[0]:
        spec: list[Any] = [None] * arr.ndim
        spec[d] = axis
        return t.shard(mesh, spec)
    return t.shard(mesh, [None] * arr.ndim)


class BackendRep(_BackendRep):
    def __init__(self, model: onnx.ModelProto, mesh: DeviceMesh | None = None, shard: bool = True,
                 placement: str = "batch") -> None:
        self.model = model
        self.mesh = mesh if mesh is not None else MESH
        self.shard = shard
        placed_dim(1, placement)  # a known placement
        self.placement = placement
        self.kept: dict = {}  # the initializers placed and norms folded by the first run, for the next
        Program(model, pick_config(model, self.mesh)[0])  # validate before any input arrives

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        g = self.model.graph
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:  # in the order of the graph inputs, as ONNX's test runner gives them
            inputs = [inputs] if isinstance(inputs, (np.ndarray, Tensor)) else list(inputs)
            feeds = dict(zip([vi.name for vi in g.input], inputs))
        feeds = {k: self._place(k, v) for k, v in feeds.items()}
        outs = run_kept(self.model, feeds, self.mesh, self.kept)
        return tuple(value(outs[o.name]) for o in g.output)

    def _place(self, name: str, value: Any) -> Any:
        if isinstance(value, Tensor):
            return value
        arr = np.asarray(value)
        if not holdable(arr.dtype):
            return arr
        if not self.shard:
            return nb.tensor(arr).shard(self.mesh, [None] * arr.ndim)
        return shard_input(arr, self.mesh, self.placement)


class Backend(_Backend):
    """``prepare(model, device="CPU", mesh=None, shard=True, placement=None)``; ``mesh`` defaults to a
    2-device mesh, ``placement`` to the class's (``"batch"`` here; see ``backend_for``). The rep it returns is a
    session, as onnxruntime's: the weights its first run places and the batch norms it folds into convs are kept
    for the next runs (``nox.run`` reads them from the model every call)."""

    placement = "batch"

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        try:
            Program(load(model), None)
        except Exception:  # noqa: BLE001
            return False
        return True

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> BackendRep:
        model = load(model)
        super().prepare(model, device, **kwargs)
        return BackendRep(model, kwargs.get("mesh"), kwargs.get("shard", True),
                          kwargs.get("placement") or cls.placement)

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Sequence[Any], device: str = "CPU",
                 outputs_info: Sequence[tuple] | None = None, **kwargs: Any) -> tuple[np.ndarray, ...]:
        arrays = [np.asarray(x) for x in inputs]
        graph_inputs = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                        for n, a in zip(node.input, arrays) if n]
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(n) for n in node.output if n]
        graph = onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs)
        model = onnx.helper.make_model(graph)  # output types unknown: no onnx.checker pass here
        rep = BackendRep(model, kwargs.get("mesh"), kwargs.get("shard", True), kwargs.get("placement") or cls.placement)
        return rep.run([a for n, a in zip(node.input, arrays) if n])

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper().startswith("CPU")


_BY_PLACEMENT: dict[str, type[Backend]] = {"batch": Backend}


def backend_for(placement: str) -> type[Backend]:
    """The ``Backend`` class that shards inputs by ``placement`` (one class per placement, so ONNX's
    ``BackendTest`` can run its suite under each)."""
    placed_dim(1, placement)
    if placement not in _BY_PLACEMENT:
        _BY_PLACEMENT[placement] = type(f"{placement.capitalize()}Backend", (Backend,), {"placement": placement})
    return _BY_PLACEMENT[placement]
