"""Tensor: an immutable value that is a host array, blocks sharded over a mesh, or abstract (no data).
A sharded tensor holds only its stored blocks; arithmetic dispatches through ``executor``, and the
numpy-like functions live in ``ops``."""

from __future__ import annotations

from math import prod
from typing import Any, Sequence

import numpy as np

from .errors import ShardingError
from .executor import Value
from .mesh import DeviceMesh
from .spec import ShardingSpec
from . import collectives as C
from . import storage


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
        from .ops import ones
        return ones(shape, dtype)  # nb.ones validates the shape and dtype (ShardingError naming them)

    @staticmethod
    def zeros(shape: Sequence[int] | int, dtype: Any = "float32") -> "Tensor":
        from .ops import zeros
        return zeros(shape, dtype)

    # ---- reading ---------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return prod(self._shape)

    @property
    def sharding(self) -> ShardingSpec | None:
        return self._spec

    @property
    def mesh(self) -> DeviceMesh | None:
        return self._spec.mesh if self._spec is not None else None

    @property
    def is_abstract(self) -> bool:
        return self._data is None

    def _need_data(self, what: str) -> np.ndarray:
        if self._data is None:
            from .trace import tracing_whole
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
        from .autodiff import trace
        return trace(self)

    def backward(self, cotangent: Any = None) -> None:
        """Accumulate into ``.grad`` of every traced leaf this value depends on (a scalar's cotangent is 1)."""
        from .autodiff import backward
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
        from .executor import place
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
            from .sharding import to_spec
            spec = to_spec(mesh, dim_specs, len(self._shape), replicated_axes, partial_axes, op)
        spec.check_rank(self._shape, op)
        return spec

    def _with_spec(self, spec: ShardingSpec) -> "Tensor":
        from .executor import place, relayout
        from .propagation import keep_open

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
            from .autodiff import differentiated
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
    def __pow__(self, o):
        # numpy's ** on a float or complex array: a Python 0.5 is sqrt, -1 reciprocal, 2 square (its
        # fast_scalar_power); np.power(-0.0, 0.5) is +0.0 in float16 where sqrt gives -0.0
        if self._dtype.kind in "fc" and (type(o) is float and o == 0.5 or type(o) is int and o in (-1, 2)):
            ops = _ops()
            from .collectives import user_op
            with user_op("power"):  # the comm log names what the user wrote
                if o == 2:  # numpy's square is x * x (a pending sum is made first: it is two factors of it)
                    return ops.multiply(self, self)
                return ops.sqrt(self) if o == 0.5 else ops._call(ops._RECIPROCAL, (self,))
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
        return _numpy_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return _numpy_function(func, types, args, kwargs)

    def to_jax(self) -> Any:
        from .interop.jax import to_jax
        return to_jax(self)



def from_local(blocks: Any, mesh: Any, dim_specs: Any = None, replicated_axes: Sequence[str] = (),
               partial_axes: Sequence[str] = (), *, shape: Sequence[int] | None = None) -> Tensor:
    """A sharded tensor from each device's block (DTensor's ``from_local``): ``blocks`` maps device id -> array,
    or lists one array per device in mesh device order. ``dim_specs`` takes what ``shard`` takes. The global
    shape follows from the blocks (or is given as ``shape``); every block must have its ceil-rule shape, and
    devices holding the same block (replicas; not the summands of partial axes) must agree, else
    ``ShardingError`` naming the device."""
    from .layout import chunks, grid, grid_index
    from .sharding import to_spec
    from . import backends

    m = mesh.mesh if hasattr(mesh, "spec") and not isinstance(mesh, DeviceMesh) else mesh
    if not isinstance(m, DeviceMesh):
        raise ShardingError(f"from_local(blocks, mesh, dim_specs): mesh must be a DeviceMesh or NamedSharding, got "
                            f"{type(mesh).__name__}")
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
            if not np.array_equal(a, arrays[o], equal_nan=a.dtype.kind in "fc"):
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
        from .autodiff import record_from_local
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
    from .layout import dim_position
    return dim_position(spec.dim_refs[dim], spec.mesh, spec.mesh.coords(device))


_OPS = []


def _ops():
    """The ops module, imported on first use (it imports this module)."""
    if not _OPS:
        from . import ops
        _OPS.append(ops)
    return _OPS[0]


# ---- numpy's protocols ----------------------------------------------------------------------------------
# numpy functions and ufuncs on tensors run nabla's sharded ops. Anything without a sharded version raises
# a ShardingError rather than silently reading the global value to the host: a hidden host fallback would
# hide the communication it stands for. ``np.asarray(t)`` (``__array__``) stays the explicit host read.

_UFUNCS = {  # numpy ufunc name -> nabla op name
    "add": "add", "subtract": "subtract", "multiply": "multiply", "divide": "divide", "power": "power",
    "maximum": "maximum", "minimum": "minimum", "less": "less", "less_equal": "less_equal",
    "greater": "greater", "greater_equal": "greater_equal", "equal": "equal", "not_equal": "not_equal",
    "negative": "negative", "exp": "exp", "log": "log", "tanh": "tanh", "sin": "sin", "cos": "cos",
    "sqrt": "sqrt", "absolute": "abs", "matmul": "matmul",
}
_REDUCE = {"add": "sum", "maximum": "max", "minimum": "min"}  # ufunc.reduce
_UFUNC_DEFAULTS = {"out": None, "where": True, "casting": "same_kind", "order": "K", "dtype": None, "subok": True}


def _host_hint(what: str, why: str = "") -> ShardingError:
    return ShardingError(f"{what} is not supported on nabla tensors{' (' + why + ')' if why else ''}: nabla has no "
                         f"sharded version of it and does not read the value to the host behind your back (that "
                         f"would hide communication); call it on t.numpy(), the global value as a host numpy array")


def _foreign(values: Any) -> bool:
    """An operand of a type that has its own numpy protocol (neither a Tensor nor an ndarray): let it answer."""
    return any(not isinstance(v, (Tensor, np.ndarray)) and hasattr(type(v), "__array_ufunc__") and
               type(v).__array_ufunc__ is not None for v in values)


def _numpy_ufunc(ufunc: Any, method: str, inputs: tuple, kwargs: dict) -> Any:
    name = getattr(ufunc, "__name__", str(ufunc))
    if _foreign(inputs):
        return NotImplemented
    out = kwargs.get("out")
    if out is not None and any(o is not None for o in (out if isinstance(out, tuple) else (out,))):
        raise ShardingError(f"np.{name}(..., out=...): tensors are immutable; use the returned tensor")
    ops = _ops()
    if method == "__call__":
        bad = [k for k, v in kwargs.items() if k not in _UFUNC_DEFAULTS or (k != "out" and not (
               v is _UFUNC_DEFAULTS[k] or (isinstance(v, (str, bool)) and v == _UFUNC_DEFAULTS[k])))]
        if bad:
            raise _host_hint(f"np.{name}", f"argument {bad[0]}={kwargs[bad[0]]!r} is not supported on tensors")
        if name == "positive":
            return inputs[0] if isinstance(inputs[0], Tensor) else ops.tensor(inputs[0])
        if name == "square":
            return ops.multiply(inputs[0], inputs[0])
        if name not in _UFUNCS:
            raise _host_hint(f"np.{name}")
        with C.user_op(_UFUNCS[name]):
            return getattr(ops, _UFUNCS[name])(*inputs)
    if method == "reduce" and name in _REDUCE:
        kw = dict(kwargs)
        axis = kw.pop("axis", 0)
        keepdims = kw.pop("keepdims", False)
        dtype = kw.pop("dtype", None)
        kw.pop("out", None)
        bad = [k for k, v in kw.items() if not (k == "where" and v is True)]
        if bad:
            raise _host_hint(f"np.{name}.reduce", f"argument {bad[0]!r} is not supported on tensors")
        x = inputs[0] if dtype is None else ops.astype(inputs[0], dtype)
        return getattr(ops, _REDUCE[name])(x, axis, keepdims)
    raise _host_hint(f"np.{name}.{method}")


def _np_default(v: Any, default: Any = None) -> Any:
    return default if v is np._NoValue else v


def _reject(func: str, **given: Any) -> None:
    """Raise for the first numpy argument given that nabla cannot honour (out=, where=, order=...)."""
    for k, v in given.items():
        if v is np._NoValue or v is None or (k == "where" and v is True):
            continue
        if k == "out":
            raise ShardingError(f"np.{func}(..., out=...): tensors are immutable; use the returned tensor")
        raise _host_hint(f"np.{func}", f"argument {k}={v!r} is not supported on tensors")


def _np_sum(a, axis=None, dtype=None, out=None, keepdims=False, initial=np._NoValue, where=np._NoValue):
    _reject("sum", out=out, where=where)
    ops = _ops()
    r = ops.sum(a if dtype is None else ops.astype(a, dtype), axis, bool(_np_default(keepdims, False)))
    return r if initial is np._NoValue else ops.add(r, initial)


def _np_mean(a, axis=None, dtype=None, out=None, keepdims=False, *, where=np._NoValue):
    _reject("mean", out=out, where=where)
    ops = _ops()
    with C.user_op("mean"):
        return ops.mean(a if dtype is None else ops.astype(a, dtype), axis, bool(_np_default(keepdims, False)))


def _chooser(name: str):
    def f(a, axis=None, out=None, keepdims=False, initial=np._NoValue, where=np._NoValue):
        _reject(name, out=out, where=where)
        ops = _ops()
        r = getattr(ops, name)(a, axis, bool(_np_default(keepdims, False)))
        if initial is not np._NoValue:
            r = (ops.maximum if name == "max" else ops.minimum)(r, initial)
        return r
    return f


def _np_argmax(a, axis=None, out=None, *, keepdims=False):
    _reject("argmax", out=out)
    ops = _ops()
    with C.user_op("argmax"):
        r = ops.argmax(a, axis)
        if _np_default(keepdims, False):
            nd = ops._ndim(a)
            r = ops.reshape(r, (1,) * nd) if axis is None else ops.expand_dims(r, int(axis) % nd)
    return r


def _np_reshape(a, /, shape=None, order="C", *, newshape=None, copy=None):
    if order not in ("C", "A"):
        raise _host_hint("np.reshape", f"order={order!r}: nabla reshapes in C order only")
    shape = newshape if shape is None else shape
    return _ops().reshape(a, shape)


def _np_concatenate(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    _reject("concatenate", out=out)
    ops = _ops()
    arrays = list(arrays)
    if axis is None:
        arrays, axis = [ops.reshape(x, (-1,)) for x in arrays], 0
    if dtype is not None:
        arrays = [ops.astype(x, dtype) for x in arrays]
    return ops.concatenate(arrays, axis)


def _np_stack(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    _reject("stack", out=out)
    ops = _ops()
    arrays = list(arrays)
    if not arrays:
        raise ShardingError("np.stack: needs at least one array")
    nd = ops._ndim(arrays[0]) + 1
    ax = int(axis) % nd if -nd <= axis < nd else axis
    return _np_concatenate([ops.expand_dims(x, ax) for x in arrays], ax, dtype=dtype)


def _np_where(condition, x=np._NoValue, y=np._NoValue):
    if x is np._NoValue or y is np._NoValue:
        raise _host_hint("np.where(condition)", "the indices of nonzero elements have a data-dependent shape")
    return _ops().where(condition, x, y)


def _np_einsum(subscripts, *operands, out=None, dtype=None, order="K", casting="safe", optimize=False):
    _reject("einsum", out=out, dtype=dtype)
    if not isinstance(subscripts, str):
        raise _host_hint("np.einsum", "the interleaved (operand, sublist) form is not supported; pass a "
                                      "subscripts string")
    return _ops().einsum(subscripts, *operands)


def _np_dot(a, b, out=None):
    _reject("dot", out=out)
    ops = _ops()
    ra, rb = ops._ndim(a), ops._ndim(b)
    if ra == 0 or rb == 0:
        return ops.multiply(a, b)
    if ra <= 2 and rb <= 2:
        with C.user_op("matmul"):
            return ops.matmul(a, b)
    raise _host_hint("np.dot", f"on ranks {ra} and {rb} (dot's N-d rule differs from matmul's); use np.matmul "
                               f"or np.einsum")


def _np_clip(a, a_min=np._NoValue, a_max=np._NoValue, out=None, *, min=np._NoValue, max=np._NoValue, **kw):
    _reject("clip", out=out, **kw)
    ops = _ops()
    lo, hi = _np_default(a_min, _np_default(min)), _np_default(a_max, _np_default(max))
    r = a
    if lo is not None:
        r = ops.maximum(r, lo)
    if hi is not None:
        r = ops.minimum(r, hi)
    return r if isinstance(r, Tensor) else ops.tensor(r)


def _np_moveaxis(a, source, destination):
    ops = _ops()
    nd = ops._ndim(a)
    src = [int(s) % nd for s in np.atleast_1d(source)]
    dst = [int(d) % nd for d in np.atleast_1d(destination)]
    if len(src) != len(dst):
        raise ShardingError(f"np.moveaxis: source {source} and destination {destination} differ in length")
    order = [n for n in range(nd) if n not in src]
    for d, s_ in sorted(zip(dst, src)):
        order.insert(d, s_)
    return ops.transpose(a, order)


def _np_like(name: str, fill: Any):
    def f(a, dtype=None, order="K", subok=True, shape=None, *, device=None):
        _reject(name, shape=shape, device=device)
        return _like(a, fill, dtype)
    return f


def _np_full_like(a, fill_value, dtype=None, order="K", subok=True, shape=None, *, device=None):
    _reject("full_like", shape=shape, device=device)
    return _like(a, fill_value, dtype)


def _like(a: Any, value: Any, dtype: Any) -> "Tensor":
    """A constant with ``a``'s shape and layout (no partial axes): each device fills its own block."""
    host = Tensor._host(np.full(a.shape, value, dtype=a.dtype if dtype is None else dtype))
    spec = a.sharding
    if spec is None:
        return host
    return host.shard(spec.mesh, spec.dim_specs, spec.replicated_axes)


def _np_size(a, axis=None):
    return a.size if axis is None else a.shape[axis]


def _np_result_type(*arrays_and_dtypes):
    return np.result_type(*(x.dtype if isinstance(x, Tensor) else x for x in arrays_and_dtypes))


def _numpy_table() -> dict:
    ops = _ops()
    table = {
        np.sum: _np_sum, np.mean: _np_mean, np.max: _chooser("max"), np.amax: _chooser("max"),
        np.min: _chooser("min"), np.amin: _chooser("min"), np.argmax: _np_argmax,
        np.transpose: lambda a, axes=None: ops.transpose(a, axes),
        np.reshape: _np_reshape, np.ravel: lambda a, order="C": _np_reshape(a, (-1,), order),
        np.concatenate: _np_concatenate, np.stack: _np_stack, np.where: _np_where, np.einsum: _np_einsum,
        np.squeeze: lambda a, axis=None: ops.squeeze(a, axis),
        np.expand_dims: lambda a, axis: ops.expand_dims(a, axis),
        np.swapaxes: lambda a, axis1, axis2: ops.swapaxes(a, axis1, axis2),
        np.moveaxis: _np_moveaxis,
        np.broadcast_to: lambda array, shape, subok=False: ops.broadcast_to(array, shape),
        np.dot: _np_dot, np.clip: _np_clip,
        np.zeros_like: _np_like("zeros_like", 0), np.ones_like: _np_like("ones_like", 1), np.full_like: _np_full_like,
        np.copy: lambda a, order="K", subok=False: a,  # tensors are immutable: a copy is the same value
        np.shape: lambda a: a.shape, np.ndim: lambda a: a.ndim, np.size: _np_size,
        np.result_type: _np_result_type,
    }
    if hasattr(np, "astype"):
        table[np.astype] = lambda x, dtype, /, *, copy=True, device=None: ops.astype(x, dtype)
    return table


_NUMPY_TABLE: dict = {}


def _numpy_function(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    if not all(issubclass(t, (Tensor, np.ndarray)) for t in types):
        return NotImplemented
    if not _NUMPY_TABLE:
        _NUMPY_TABLE.update(_numpy_table())
    handler = _NUMPY_TABLE.get(func)
    if handler is None:
        raise _host_hint(f"np.{getattr(func, '__name__', func)}")
    return handler(*args, **kwargs)
