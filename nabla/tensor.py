"""Tensor: an immutable value that is a host array, blocks sharded over a mesh, or abstract (no data).
A sharded tensor holds only its stored blocks; arithmetic dispatches through ``executor``, and the
numpy-like functions live in ``ops`` (numpy's own functions on tensors: ``numpy_api``)."""

from __future__ import annotations

from math import prod
from typing import Any, Sequence

import numpy as np

from .dtypes import is_inexact
from .errors import ShardingError
from .value import Value
from .mesh import DeviceMesh
from .spec import ShardingSpec
from . import collectives as C
from . import services
from . import storage
from .layout import chunks, grid, grid_index
from .sharding import to_spec
from . import backends
from .layout import dim_position
from .executor import place
from .executor import place, relayout
from .propagation import keep_open
from .trace import tracing_whole
from .collectives import user_op
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

    @staticmethod
    def ones(shape: Sequence[int] | int, dtype: Any = "float32") -> "Tensor":
        return _ops().ones(shape, dtype)  # nb.ones validates the shape and dtype (ShardingError naming them)

    @staticmethod
    def zeros(shape: Sequence[int] | int, dtype: Any = "float32") -> "Tensor":
        return _ops().zeros(shape, dtype)

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

    # ---- differentiation (the Nabla sharding README's spelling; nb.grad and friends are the functional form) ----------------
    def trace(self) -> "Tensor":
        """A leaf to differentiate with respect to: after ``loss.backward()``, its ``.grad`` holds the gradient."""
        trace = services.get("autodiff").trace
        return trace(self)

    def backward(self, cotangent: Any = None) -> None:
        """Accumulate into ``.grad`` of every traced leaf this value depends on (a scalar's cotangent is 1)."""
        backward = services.get("autodiff").backward
        backward(self, cotangent)

    @property
    def grad(self) -> "Tensor | None":
        return getattr(self, "_grad", None)

    @grad.setter
    def grad(self, value: "Tensor | None") -> None:
        self._grad = value

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
        if self._node is not None:
            differentiated = services.get("autodiff").differentiated
            if differentiated(self):  # a host array: the gradient would silently stop here
                raise ShardingError(f"to_local: this tensor depends on a value being differentiated, and to_local "
                                    f"returns a host array that gradients cannot flow through; compute on the "
                                    f"tensor (or in nb.shard_map code) instead")
        return storage.block(data, self._spec, self._shape, device_id)

    # ---- numpy-like surface (implemented in ops) --------------------------------------------------
    def __add__(self, o): return _ops().add(self, o)
    def __radd__(self, o): return _ops().add(o, self)
    def __sub__(self, o): return _ops().subtract(self, o)
    def __rsub__(self, o): return _ops().subtract(o, self)
    def __mul__(self, o): return _ops().multiply(self, o)
    def __rmul__(self, o): return _ops().multiply(o, self)
    def __truediv__(self, o): return _ops().divide(self, o)
    def __rtruediv__(self, o): return _ops().divide(o, self)
    def __floordiv__(self, o): return _ops().floor_divide(self, o)
    def __rfloordiv__(self, o): return _ops().floor_divide(o, self)
    def __mod__(self, o): return _ops().remainder(self, o)
    def __rmod__(self, o): return _ops().remainder(o, self)
    def __pow__(self, o):
        # numpy's ** on a float or complex array: a Python 0.5 is sqrt, -1 reciprocal, 2 square (its
        # fast_scalar_power); np.power(-0.0, 0.5) is +0.0 in float16 where sqrt gives -0.0
        if is_inexact(self._dtype) and (type(o) is float and o == 0.5 or type(o) is int and o in (-1, 2)):
            ops = _ops()
            with user_op("power"):  # the comm log names what the user wrote
                if o == 2:  # numpy's square is x * x (a pending sum is made first: it is two factors of it)
                    return ops.multiply(self, self)
                return ops.sqrt(self) if o == 0.5 else ops.apply(ops._RECIPROCAL, (self,))
        if self._dtype.kind == "b" and type(o) is int and o == 2:  # numpy's square: int8
            ops = _ops()
            x = ops.astype(self, np.int8)
            return ops.multiply(x, x)
        return _ops().power(self, o)
    def __rpow__(self, o): return _ops().power(o, self)
    def __matmul__(self, o): return _ops().matmul(self, o)
    def __rmatmul__(self, o): return _ops().matmul(o, self)
    def __neg__(self): return _ops().negative(self)
    def __pos__(self): return self
    def __abs__(self): return _ops().abs(self)
    def __lt__(self, o): return _ops().less(self, o)
    def __le__(self, o): return _ops().less_equal(self, o)
    def __gt__(self, o): return _ops().greater(self, o)
    def __ge__(self, o): return _ops().greater_equal(self, o)
    def __eq__(self, o): return _ops().equal(self, o)  # type: ignore[override]
    def __ne__(self, o): return _ops().not_equal(self, o)  # type: ignore[override]
    __hash__ = object.__hash__

    def __getitem__(self, key): return _ops().getitem(self, key)

    def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor: return _ops().sum(self, axis, keepdims)
    def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        with C.user_op("mean"):
            return _ops().mean(self, axis, keepdims)
    def max(self, axis: Any = None, keepdims: bool = False) -> Tensor: return _ops().max(self, axis, keepdims)
    def min(self, axis: Any = None, keepdims: bool = False) -> Tensor: return _ops().min(self, axis, keepdims)
    def argmax(self, axis: int | None = None) -> Tensor:
        with C.user_op("argmax"):
            return _ops().argmax(self, axis)
    def argmin(self, axis: int | None = None) -> Tensor: return _ops().argmin(self, axis)
    def var(self, axis: Any = None, dtype: Any = None, ddof: int = 0, keepdims: bool = False) -> Tensor:
        return _ops().var(self, axis, dtype, ddof, keepdims)
    def std(self, axis: Any = None, dtype: Any = None, ddof: int = 0, keepdims: bool = False) -> Tensor:
        return _ops().std(self, axis, dtype, ddof, keepdims)
    def prod(self, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> Tensor:
        return _ops().prod(self, axis, dtype, keepdims)
    def any(self, axis: Any = None, keepdims: bool = False) -> Tensor: return _ops().any(self, axis, keepdims)
    def all(self, axis: Any = None, keepdims: bool = False) -> Tensor: return _ops().all(self, axis, keepdims)
    def cumsum(self, axis: int | None = None, dtype: Any = None) -> Tensor: return _ops().cumsum(self, axis, dtype)
    def sort(self, axis: int | None = -1) -> Tensor: return _ops().sort(self, axis)
    def argsort(self, axis: int | None = -1) -> Tensor: return _ops().argsort(self, axis)

    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        return _ops().reshape(self, shape)

    def transpose(self, *axes: Any) -> Tensor:
        if len(axes) == 1 and axes[0] is not None and not isinstance(axes[0], (int, np.integer)):
            axes = tuple(axes[0])
        return _ops().transpose(self, axes or None)

    @property
    def T(self) -> Tensor: return _ops().transpose(self, None)

    def astype(self, dtype: Any) -> Tensor: return _ops().astype(self, dtype)

    # ---- numpy's protocols: np.exp(t), np.sum(t), np.matmul(t, u) give sharded tensors -------------------
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        return _numpy_api().ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return _numpy_api().function(func, types, args, kwargs)

    def to_jax(self) -> Any:
        return to_jax(self)



def from_local(blocks: Any, mesh: Any, dim_specs: Any = None, replicated_axes: Sequence[str] = (),
               partial_axes: Sequence[str] = (), *, shape: Sequence[int] | None = None) -> Tensor:
    """A sharded tensor from each device's block (DTensor's ``from_local``): ``blocks`` maps device id -> array,
    or lists one array per device in mesh device order. ``dim_specs`` takes what ``shard`` takes. The global
    shape follows from the blocks (or is given as ``shape``); every block must have its ceil-rule shape, and
    devices holding the same block (replicas; not the summands of partial axes) must agree, else
    ``ShardingError`` naming the device."""

    m = mesh.mesh if hasattr(mesh, "spec") and not isinstance(mesh, DeviceMesh) else mesh
    if not isinstance(m, DeviceMesh):
        raise ShardingError(f"from_local(blocks, mesh, dim_specs): mesh must be a DeviceMesh or NamedSharding, got "
                            f"{type(mesh).__name__}")
    storage.check_data_mesh(m, "from_local")
    if isinstance(blocks, dict):
        unknown = [d for d in blocks if not isinstance(d, (int, np.integer)) or d not in m._coords]
        if unknown:
            raise ShardingError(f"from_local: device {unknown[0]!r} is not in mesh {m!r} (devices {list(m.devices)})")
        missing = [d for d in m.devices if d not in blocks]
        if missing:
            raise ShardingError(f"from_local: no block for device {missing[0]} of mesh {m!r}; every device needs one")
        by_dev = {d: blocks[d] for d in m.devices}
    elif isinstance(blocks, (list, tuple)):
        if len(blocks) != m.size:
            raise ShardingError(f"from_local: {len(blocks)} blocks for the {m.size} devices of mesh {m!r} (a list "
                                f"holds one block per device, in mesh device order {list(m.devices)})")
        by_dev = dict(zip(m.devices, blocks))
    else:
        raise ShardingError(f"from_local: blocks must be a dict device id -> array or a list in mesh device order, "
                            f"got {type(blocks).__name__}")
    arrays = {}
    for d, b in by_dev.items():
        a = b.numpy() if isinstance(b, Tensor) else np.asarray(b)
        if a.dtype.kind not in "biufc" and not a.dtype.name.startswith(("bfloat", "float8")):
            raise ShardingError(f"from_local: the block of device {d} has dtype {a.dtype}, not a numeric one")
        arrays[d] = a
    first = m.devices[0]
    rank, dtype = arrays[first].ndim, arrays[first].dtype
    for d, a in arrays.items():
        if a.ndim != rank:
            raise ShardingError(f"from_local: the block of device {d} has rank {a.ndim} (shape {a.shape}) but device "
                                f"{first}'s has rank {rank} (shape {arrays[first].shape})")
        if a.dtype != dtype:
            raise ShardingError(f"from_local: the block of device {d} has dtype {a.dtype} but device {first}'s has "
                                f"{dtype}; cast them alike (.astype)")
    spec = to_spec(mesh, dim_specs, rank, replicated_axes, partial_axes, "from_local")
    spec.check_rank(arrays[first].shape, "from_local", f"block of device {first}")
    if shape is None:  # a dim is the sum of its distinct shards' lengths, read off the devices holding them
        gshape = []
        for i in range(rank):
            by_pos: dict[int, tuple[int, int]] = {}
            for d, a in arrays.items():
                n, o = by_pos.setdefault(_position(spec, i, d), (a.shape[i], d))
                if n != a.shape[i]:
                    raise ShardingError(f"from_local: devices {o} and {d} hold the same shard of dim {i} under "
                                        f"{spec!r}, but their blocks have {n} and {a.shape[i]} elements there")
            gshape.append(sum(n for n, _ in by_pos.values()))
        shape = tuple(gshape)
    else:
        shape = tuple(int(n) for n in shape)
        spec.check_rank(shape, "from_local", "shape")
    for d, a in arrays.items():
        want = spec.shard_shape(shape, d)
        if a.shape != want:
            raise ShardingError(f"from_local: the block of device {d} has shape {a.shape}, but a {shape} tensor laid "
                                f"out {spec!r} gives device {d} a block of {want} (ceil rule: a dim of n over k "
                                f"shards gives each ceil(n / k) elements, the last ones fewer)")
    g = grid(spec)
    data = np.zeros(g.shape + chunks(spec, shape), dtype=dtype)
    holder: dict[tuple, int] = {}
    for d, a in arrays.items():
        idx = grid_index(spec, d)
        if idx in holder:
            o = holder[idx]
            if not np.array_equal(a, arrays[o], equal_nan=is_inexact(a.dtype)):
                raise ShardingError(f"from_local: devices {o} and {d} hold the same block of {spec!r} (replicas) but "
                                    f"their blocks differ; a replicated dim or axis needs equal blocks (make the "
                                    f"value partial over that axis if they are summands)")
            continue
        holder[idx] = d
        data[idx + tuple(slice(0, n) for n in a.shape)] = a
    data = backends.active().commit(data, spec)
    if isinstance(data, np.ndarray):
        data.flags.writeable = False
    out = Tensor(data, spec, shape, dtype)
    traced = {d: b for d, b in by_dev.items() if isinstance(b, Tensor) and b._node is not None}
    if traced:  # blocks computed from values being differentiated: gradients reach them
        record_from_local = services.get("autodiff").record_from_local
        record_from_local(out, traced, spec, set(holder.values()))
    return out


def device_put(x: Any, sharding: Any) -> Tensor:
    """JAX's ``device_put``: ``x`` (a tensor, an array, a scalar) laid out as ``sharding`` (an
    ``nb.NamedSharding``, or a ``ShardingSpec``); a sharded value moves with collectives."""
    t = x if isinstance(x, Tensor) else _ops().tensor(x)
    return t.shard(sharding)


def with_sharding_constraint(x: Any, shardings: Any) -> Any:
    """JAX's ``with_sharding_constraint``: ``x`` (a tensor, or a pytree of them) laid out as ``shardings`` (an
    ``nb.NamedSharding`` or ``ShardingSpec``, or a pytree of them matching ``x``); ``t.with_sharding`` on
    each leaf, so a sharded value moves with logged collectives and open dims keep what they have."""
    if isinstance(x, Tensor):
        return x.with_sharding(shardings)
    if isinstance(x, dict):
        if isinstance(shardings, dict):
            return {k: with_sharding_constraint(v, shardings[k]) for k, v in x.items()}
        return {k: with_sharding_constraint(v, shardings) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        per = shardings if isinstance(shardings, (list, tuple)) else [shardings] * len(x)
        if len(per) != len(x):
            raise ShardingError(f"with_sharding_constraint: {len(per)} shardings for {len(x)} values")
        return type(x)(with_sharding_constraint(v, s) for v, s in zip(x, per))
    raise ShardingError(f"with_sharding_constraint: expected a Tensor or a pytree of them, got {type(x).__name__}")


def _position(spec: ShardingSpec, dim: int, device: int) -> int:
    return dim_position(spec.dim_refs[dim], spec.mesh, spec.mesh.coords(device))


def _ops():
    """The ops (registered by ``nabla.ops``, which builds on this module)."""
    return services.get("ops")


def _numpy_api():
    """numpy's protocols on tensors (registered by ``nabla.numpy_api``)."""
    return services.get("numpy_api")
