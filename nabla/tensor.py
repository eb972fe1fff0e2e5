"""Tensor: an immutable value that is a host array, blocks sharded over a mesh, or abstract (no data).
A sharded tensor holds only its stored blocks; arithmetic dispatches through ``executor``, and the
numpy-like functions live in ``ops`` (numpy's own functions on tensors: ``numpy_api``)."""

from __future__ import annotations

from math import prod
from typing import Any, Sequence

import numpy as np

from .errors import ShardingError
from .value import Value
from .mesh import DeviceMesh
from .spec import ShardingSpec
from . import storage
from .sharding import to_spec
from .executor import place, relayout
from .propagation import keep_open
from .trace import differentiated, link, link_of, tracing_whole
from .interop.jax import to_jax


class Tensor(Value):
    """An immutable value: a host array, blocks sharded over a mesh, or abstract (a shape and no data).
    Build with ``nb.tensor``, ``nb.ones``, ``Tensor.ones`` and friends; place with ``shard``."""

    __slots__ = ("_grad",)
    __array_priority__ = 1000  # so `ndarray + Tensor` defers to Tensor.__radd__

    # ---- construction --------------------------------------------------------------------------
    @staticmethod
    def _host(value: np.ndarray) -> "Tensor":
        value = np.asarray(value)
        if value.flags.writeable and value.base is None:
            value.flags.writeable = False
        elif value.flags.writeable:
            value = value.copy()
            value.flags.writeable = False
        return Tensor(value, None, tuple(value.shape), value.dtype)

    # ---- reading (shape, dtype, sharding, is_abstract and blocks are Value's) ---------------------------
    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return prod(self._shape)

    @property
    def mesh(self) -> DeviceMesh | None:
        return self._spec.mesh if self._spec is not None else None

    def _need_data(self, what: str) -> np.ndarray:
        if self._data is None:
            if tracing_whole():
                raise ShardingError(
                    f"{what}: inside nb.jit a tensor (here of shape {self._shape}) is traced without its values, so "
                    f"the function cannot read them (.numpy(), float(), bool(), a Python `if` on a value); use "
                    f"nb.where for a choice that depends on values, or read them from the jitted call's result")
            raise ShardingError(f"{what}: tensor of shape {self._shape} is abstract (nb.abstract) and holds no data")
        return self._data

    def numpy(self) -> np.ndarray:
        """The global value (a host read of every block, not a collective; partial sums are added)."""
        data = self._need_data("numpy")
        if self._spec is None:
            return np.array(data)
        return storage.assemble(data, self._spec, self._shape)

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    @property
    def shards(self) -> dict[int, np.ndarray]:
        """Device id -> that device's block (a read-only view; no copy). An unsharded tensor is device 0's."""
        data = self._need_data("shards")
        if self._spec is None:
            return {0: data}
        return {d: storage.block(data, self._spec, self._shape, d) for d in self._spec.mesh.devices}

    def __repr__(self) -> str:
        where = "" if self._spec is None else f", sharding={self._spec!r} on @{self._spec.mesh.name}"
        if self._data is None:
            return f"Tensor(abstract, shape={self._shape}, dtype={self._dtype}{where})"
        if self.size > 64:  # a summary, not a host read of a large value
            return f"Tensor(shape={self._shape}, dtype={self._dtype}{where})"
        body = np.array2string(self.numpy(), separator=", ", prefix="Tensor(")
        return f"Tensor({body}, dtype={self._dtype}{where})"

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def item(self) -> Any:
        """The value of a one-element tensor as a Python scalar (a host read)."""
        return self.numpy().item()

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __bool__(self) -> bool:
        return bool(self.numpy())

    def __float__(self) -> float:
        return float(self.numpy())

    def __int__(self) -> int:
        return int(self.numpy())

    # ---- placement ----------------------------------------------------------------------------------
    def shard(self, mesh: Any, dim_specs: Any = None, replicated_axes: Sequence[str] = (),
              partial_axes: Sequence[str] = ()) -> "Tensor":
        """Place this value on ``mesh`` as ``dim_specs``; a sharded value moves with collectives.

        ``dim_specs``: one entry per dim (``DimSpec``, ``None``, an axis, a tuple of axes), a ``ShardingSpec``,
        or a JAX ``PartitionSpec`` (padded with ``None``; ``P.UNCONSTRAINED`` is an open dim). ``t.shard(named)``
        takes an ``nb.NamedSharding``; ``t.shard(mesh)`` replicates. For a host value, ``partial_axes`` puts
        the whole value on the first device of each partial group and zeros elsewhere (as DTensor does).
        """
        spec = self._target(mesh, dim_specs, replicated_axes, partial_axes, "shard")
        if self._spec is not None:
            return self._with_spec(spec)
        return place(self, spec, Tensor)

    def with_sharding(self, mesh: Any, dim_specs: Any = None, replicated_axes: Sequence[str] = (),
                      partial_axes: Sequence[str] = ()) -> "Tensor":
        """The same value laid out as asked, moved with simulated collectives (planned, then carried out).

        Takes what ``shard`` takes. May keep or remove partial axes, never add them. Open dims keep the
        axes the value already has there (``P.UNCONSTRAINED``); open dims and priorities steer propagation.
        """
        return self._with_spec(self._target(mesh, dim_specs, replicated_axes, partial_axes, "with_sharding"))

    def _target(self, mesh: Any, dim_specs: Any, replicated_axes: Sequence[str], partial_axes: Sequence[str],
                op: str) -> ShardingSpec:
        if type(mesh) is DeviceMesh and type(dim_specs) is list and not replicated_axes and not partial_axes:
            spec = ShardingSpec(mesh, dim_specs)  # the common spelling, kept cheap
        else:
            spec = to_spec(mesh, dim_specs, len(self._shape), replicated_axes, partial_axes, op)
        spec.check_rank(self._shape, op)
        return spec

    def _with_spec(self, spec: ShardingSpec) -> "Tensor":

        spec = keep_open(self._spec, spec)
        if self._spec is None:
            if spec.partial_axes:
                raise ShardingError(f"with_sharding: target {spec!r} is partial over {list(spec.partial_axes)} "
                                    f"but the value is not; use .shard(...) to place a host value as partial")
            return place(self, spec, Tensor)
        return relayout(self, spec, Tensor)

    def redistribute(self, mesh: Any, dim_specs: Any = None, replicated_axes: Sequence[str] = (),
                     partial_axes: Sequence[str] = ()) -> "Tensor":
        """DTensor's spelling of ``with_sharding`` (the same value moved to the asked layout)."""
        return self._with_spec(self._target(mesh, dim_specs, replicated_axes, partial_axes, "redistribute"))

    def full_tensor(self) -> np.ndarray:
        """DTensor's ``full_tensor``: the global value on every device (gathered, and summed if partial, with
        collectives that show in the comm log), returned as a host array. ``.numpy()`` reads it without them."""
        if self._spec is None:
            return self._need_data("full_tensor")
        mesh = self._spec.mesh
        return self._with_spec(ShardingSpec(mesh, [None] * self.ndim)).to_local(mesh.devices[0])

    def to_local(self, device_id: int | None = None) -> np.ndarray:
        """Device ``device_id``'s block (DTensor's ``to_local``): a read-only host view, a partial value's
        summand where the tensor is partial. ``device_id`` may be left out on a one-device mesh or a host value."""
        if self._spec is None:
            return self._need_data("to_local")
        mesh = self._spec.mesh
        if device_id is None:
            if mesh.size != 1:
                raise ShardingError(f"to_local: which device? the tensor is on mesh {mesh!r} of {mesh.size} devices "
                                    f"{list(mesh.devices)}; call t.to_local(device_id)")
            device_id = mesh.devices[0]
        if not isinstance(device_id, (int, np.integer)) or device_id not in mesh._coords:
            raise ShardingError(f"to_local: device {device_id!r} is not in mesh {mesh!r} "
                                f"(devices {list(mesh.devices)})")
        data = self._need_data("to_local")
        if link_of(self) is not None:
            if differentiated(self):  # a host array: the gradient would silently stop here
                raise ShardingError(f"to_local: this tensor depends on a value being differentiated, and to_local "
                                    f"returns a host array that gradients cannot flow through; compute on the "
                                    f"tensor (or in nb.shard_map code) instead")
        return storage.block(data, self._spec, self._shape, device_id)

    # ---- numpy-like surface: the operators and methods that run ops (t + u, t.sum(), t.T, Tensor.ones) are set
    # by ``nabla.ops.methods``, numpy's protocols by ``nabla.numpy_api``, ``trace``/``backward`` by ``nabla.autodiff``
    __hash__ = object.__hash__  # (the ``__eq__`` set there is elementwise)

    @property
    def grad(self) -> "Tensor | None":
        """The gradient ``loss.backward()`` stored for this traced leaf (``t.trace()``), else None."""
        return getattr(self, "_grad", None)

    @grad.setter
    def grad(self, value: "Tensor | None") -> None:
        self._grad = value

    # ---- copies: the same value under another object, linked as it is (the tape is keyed by the object, so a copy
    # Python's default protocol makes would carry no link, and gradients through it would silently be zero)
    def __copy__(self) -> "Tensor":
        return link(self._twin(lambda x: x), link_of(self))

    def __deepcopy__(self, memo: dict) -> "Tensor":
        import copy
        t = memo[id(self)] = self._twin(lambda x: copy.deepcopy(x, memo))
        return link(t, link_of(self))

    def _twin(self, each: Any) -> "Tensor":
        t = type(self).__new__(type(self))
        for cls in type(self).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if name != "__weakref__" and hasattr(self, name):
                    setattr(t, name, each(getattr(self, name)))
        return t

    def to_jax(self) -> Any:
        return to_jax(self)
