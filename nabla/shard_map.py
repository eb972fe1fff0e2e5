"""Per-device code, as ``jax.shard_map``: ``fn`` sees each device's block as a tensor (a *manual* value:
every device's block is still stored in one array, so its ops stay one numpy call), calls ``nb.lax``
collectives explicitly, and its results are assembled by ``out_specs``. Manual values are recorded in the
trace like any other, so ``nb.jit`` compiles shard_map code too."""

from __future__ import annotations

import contextvars
from math import prod
from typing import Any, Callable, Sequence

from .errors import ShardingError
from .scoped import setting
from .mesh import DeviceMesh
from .spec import ShardingSpec
from .executor import record_step
from .manual import ManualSpec
from .tensor import Tensor
from .trace import tracked
from .sharding import is_pspec
from .layout import grid
from .backends import xp
from .ops import tensor

SM_IN, SM_OUT = "shard_map_in", "shard_map_out"
_mesh: contextvars.ContextVar = contextvars.ContextVar("nabla_shard_map_mesh", default=None)


def current_mesh() -> DeviceMesh:
    """The mesh of the shard_map whose function is running (what ``nb.lax.axis_index`` indexes)."""
    mesh = _mesh.get()
    if mesh is None:
        raise ShardingError("nb.lax.axis_index: called outside nb.shard_map")
    return mesh


def _axes_of(spec: ShardingSpec, what: str) -> list[str]:
    names = []
    for i, refs in enumerate(spec.dim_refs):
        for r in refs:
            if not r.is_full:
                raise ShardingError(f"shard_map: {what} {spec!r} uses sub-axis {str(r)!r} on dim {i}; shard_map "
                                    f"specs name whole mesh axes (as JAX's PartitionSpec)")
            names.append(r.name)
    return names


def _spec(mesh: DeviceMesh, s: Any, rank: int, what: str) -> ShardingSpec:
    if isinstance(s, ShardingSpec):
        dims = list(s.dim_specs)
    elif s is None:
        dims = [None] * rank
    else:
        try:
            dims = list(s)
        except TypeError:
            raise ShardingError(f"shard_map: {what} must be a list of dim specs (or a PartitionSpec), got {s!r}") \
                from None
    if len(dims) > rank:
        raise ShardingError(f"shard_map: {what} {dims} has more entries than the value's {rank} dims")
    dims += [None] * (rank - len(dims))  # a short spec is padded with None, as in JAX
    try:
        return ShardingSpec(mesh, [d if not hasattr(d, "axes") else tuple(d.axes) for d in dims])
    except ShardingError as e:
        raise ShardingError(f"shard_map: {what} {dims}: {e}") from None


def shard_map(fn: Callable, mesh: DeviceMesh, in_specs: Sequence[Any], out_specs: Any) -> Callable:
    """``nb.shard_map(fn, mesh, in_specs, out_specs)(*tensors)``: each input is laid out as its in_spec and
    ``fn`` runs on every device's block at once; ``out_specs`` say how the blocks it returns tile the results.
    Dims must divide evenly over their axes (as in JAX). One spec in ``in_specs`` serves every argument (JAX's
    prefix rule); a ``fn`` that returns a tuple or list needs one out_spec per output."""
    if not isinstance(mesh, DeviceMesh):
        raise ShardingError(f"shard_map: mesh must be a DeviceMesh, got {type(mesh).__name__}")

    def wrapped(*args: Tensor):
        specs = _per_item(in_specs, len(args), "in_specs", "argument", share=True)
        manual = []
        for i, (a, s) in enumerate(zip(args, specs)):
            t = a if isinstance(a, Tensor) else tensor(a)
            spec = _spec(mesh, s, t.ndim, f"in_specs[{i}]")
            _axes_of(spec, f"in_specs[{i}]")
            for d, n in enumerate(t.shape):
                k = spec.num_shards(d)
                if n % k:
                    raise ShardingError(f"shard_map: argument {i} dim {d} of size {n} does not split evenly over "
                                        f"{list(spec.dim_specs[d].axes)} ({k} shards)")
            placed = t.shard(mesh, spec.dim_specs) if t.sharding is None else t.with_sharding(mesh, spec.dim_specs)
            manual.append(_to_manual(placed, spec))
        with setting(_mesh, mesh):
            out = fn(*manual)
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        # one output takes out_specs as one spec first (a bare [("dp", "tp")] is a spec, not a list of one); as in
        # JAX (a pytree prefix), one PartitionSpec or ShardingSpec serves every output
        ospecs = [out_specs] if single and _one_spec(out_specs) else \
            _per_item(out_specs, len(outs), "out_specs", "output",
                      share=is_pspec(out_specs) or isinstance(out_specs, ShardingSpec) or out_specs is None)
        results = [_from_manual(o, mesh, s, i) for i, (o, s) in enumerate(zip(outs, ospecs))]
        return results[0] if single else type(out)(results)

    return wrapped


def _spec_like(s: Any) -> bool:
    """Whether ``s`` spells a whole value's layout (not one dim's entry)."""
    return s is None or isinstance(s, (list, tuple, ShardingSpec)) or is_pspec(s)


def _dim_like(e: Any) -> bool:
    return e is None or isinstance(e, str) or hasattr(e, "axes") or (
        isinstance(e, tuple) and all(isinstance(a, str) for a in e))


def _one_spec(s: Any) -> bool:
    """Whether ``s`` is one value's spec: a PartitionSpec, a ShardingSpec, None, or a bare list of dim entries."""
    return isinstance(s, ShardingSpec) or is_pspec(s) or s is None or (
        isinstance(s, (list, tuple)) and all(_dim_like(e) for e in s))


def _per_item(specs: Any, n: int, what: str, item: str, share: bool) -> list:
    """One spec per argument or output: ``specs`` lists one each; or, where ``share`` (in_specs, a prefix of the
    arguments as in JAX), one spec serves them all. Otherwise the error says how many of each there are."""
    listed = isinstance(specs, (list, tuple)) and not is_pspec(specs) and all(_spec_like(e) for e in specs)
    if listed and len(specs) == n:
        return list(specs)
    one = _one_spec(specs)
    if one and (share or n == 1):
        return [specs] * n
    if not one and not listed:
        raise ShardingError(f"shard_map: {what} {specs!r} is neither one spec nor a list of specs, one per {item}")
    k = 1 if one else len(specs)
    counted = f"fn {'returned' if item == 'output' else 'was called with'} {n} {item}{'s' * (n != 1)}"
    raise ShardingError(f"shard_map: {counted} but {what} holds {k} spec{'s' * (k != 1)} ({specs!r}): give one "
                        f"spec per {item}" + (", or one spec for all of them" if share else ""))


def _to_manual(t: Tensor, spec: ShardingSpec) -> Tensor:
    block = tuple(n // spec.num_shards(d) for d, n in enumerate(t.shape))
    m = ManualSpec(spec.mesh, _axes_of(spec, "in_spec"))
    data = None if t._data is None else t._data.reshape(m.grid() + block)
    out = Tensor(data, m, block, t.dtype)
    record_step(SM_IN, (spec,), (t,), out, tape=tracked((t,)))
    return out


def _from_manual(o: Any, mesh: DeviceMesh, s: Any, i: int) -> Tensor:
    if not isinstance(o, Tensor) or not isinstance(o.sharding, ManualSpec):
        raise ShardingError(f"shard_map: output {i} must be a per-device value computed inside fn, got "
                            f"{type(o).__name__}")
    spec = _spec(mesh, s, o.ndim, f"out_specs[{i}]")
    axes = _axes_of(spec, f"out_specs[{i}]")
    extra = [a for a in o.sharding.varying if a not in axes]
    if extra:
        raise ShardingError(f"shard_map: output {i} differs across mesh axes {extra} but out_specs[{i}] {spec!r} "
                            f"does not split it over them (reduce it, e.g. with nb.lax.psum, or name the axes)")
    shape = tuple(n * spec.num_shards(d) for d, n in enumerate(o.shape))
    g = grid(spec).shape
    data = None
    if o._data is not None:
        data = xp(o._data).broadcast_to(o._data, ManualSpec(mesh, axes).grid() + o.shape).reshape(g + o.shape)
    out = Tensor(data, spec, shape, o.dtype)
    record_step(SM_OUT, (spec,), (o,), out, tape=tracked((o,)))
    return out




def manual_block_bytes(t: Tensor) -> int:
    return prod(t.shape) * t.dtype.itemsize
