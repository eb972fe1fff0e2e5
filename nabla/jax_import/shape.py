"""Shape primitives: reshape, broadcast_in_dim, transpose, squeeze, rev, concatenate, pad (interior and negative
padding too), slices (static, and dynamic ones whose start is a value read on the host), split and iota."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import ops as O
from ..errors import ShardingError
from ..tensor import Tensor
from .table import as_tensor, const, primitive


@primitive("reshape")
def _reshape(ev, e, x, *dyn):
    if dyn:
        raise ShardingError("reshape with dynamic shapes is not supported")
    dims = e.params.get("dimensions")
    x = as_tensor(x)
    if dims is not None:
        x = O.transpose(x, tuple(dims))
    shape = tuple(int(n) for n in e.params["new_sizes"])
    return x if x.shape == shape else O.reshape(x, shape)


@primitive("broadcast_in_dim")
def _broadcast_in_dim(ev, e, x, *dyn):
    if dyn:
        raise ShardingError("broadcast_in_dim with dynamic shapes is not supported")
    shape = tuple(int(n) for n in e.params["shape"])
    bdims = tuple(e.params["broadcast_dimensions"])
    if not isinstance(x, Tensor):  # a literal: a constant of the program
        return const(ev, np.broadcast_to(np.asarray(x), shape))
    if x.shape == shape:
        return x
    x = _summed_before_growing(x)
    new = tuple(d for d in range(len(shape)) if d not in bdims)
    if new:
        x = O.expand_dims(x, new)
    return x if x.shape == shape else O.broadcast_to(x, shape)


def _summed_before_growing(x: Tensor) -> Tensor:
    """A pending sum is made before a broadcast: the broadcast value holds the same sum in more bytes (a layer
    norm's backward broadcasts its per-row sums over the features: summing them there moves a row's worth per
    row, summing after moves the whole activation). nabla's own ops come with their VJPs; a JAX program spells the
    broadcast out, so the importer makes the sum where XLA does."""
    spec = x.sharding
    if spec is None or not getattr(spec, "partial_axes", ()):
        return x
    return x.with_sharding(spec.mesh, spec.dim_specs, spec.replicated_axes)


@primitive("transpose")
def _transpose(ev, e, x):
    perm = tuple(e.params["permutation"])
    return x if perm == tuple(range(len(perm))) else O.transpose(as_tensor(x), perm)


@primitive("squeeze")
def _squeeze(ev, e, x):
    dims = tuple(e.params["dimensions"])
    return O.squeeze(as_tensor(x), dims) if dims else x


@primitive("expand_dims")
def _expand_dims(ev, e, x):
    return O.expand_dims(as_tensor(x), tuple(e.params["dimensions"]))


@primitive("rev")
def _rev(ev, e, x):
    dims = tuple(e.params["dimensions"])
    return O.flip(as_tensor(x), dims) if dims else x


@primitive("concatenate")
def _concatenate(ev, e, *xs):
    return O.concatenate([as_tensor(x) for x in xs], axis=int(e.params["dimension"]))


@primitive("stack")
def _stack(ev, e, *xs):
    return O.stack([as_tensor(x) for x in xs], axis=int(e.params["axis"]))


def _fill(ev, v: Any) -> Any:
    """A padding value: a literal, or a scalar tensor read on the host (0 when the program runs without data)."""
    if isinstance(v, Tensor):
        return 0 if v.is_abstract else v.numpy().item()
    return np.asarray(v).item()


@primitive("pad")
def _pad(ev, e, x, value):
    """lax.pad: interior padding interleaves, negative padding cuts, positive padding pads."""
    x = as_tensor(x)
    fill = _fill(ev, value)
    config = [(int(lo), int(hi), int(mid)) for lo, hi, mid in e.params["padding_config"]]
    for d, (_, _, mid) in enumerate(config):
        if mid:
            x = _interleave(x, d, mid, fill)
    cut = tuple(slice(max(-lo, 0), x.shape[d] - max(-hi, 0)) for d, (lo, hi, _) in enumerate(config))
    if any(s.start or s.stop != x.shape[d] for d, s in enumerate(cut)):
        x = x[cut]
    widths = [(max(lo, 0), max(hi, 0)) for lo, hi, _ in config]
    return O.pad(x, widths, constant_values=fill) if any(lo or hi for lo, hi in widths) else x


def _interleave(x: Tensor, d: int, k: int, fill: Any) -> Tensor:
    """``k`` fill elements between neighbours along dim ``d``: each element with ``k`` after it, the last ``k`` cut."""
    n = x.shape[d]
    if n == 0:
        return x
    y = O.expand_dims(x, d + 1)
    widths = [(0, 0)] * y.ndim
    widths[d + 1] = (0, k)
    y = O.pad(y, widths, constant_values=fill)
    y = O.reshape(y, x.shape[:d] + (n * (k + 1),) + x.shape[d + 1:])
    return y[(slice(None),) * d + (slice(0, n * (k + 1) - k),)]


@primitive("slice")
def _slice(ev, e, x):
    starts, limits = e.params["start_indices"], e.params["limit_indices"]
    strides = e.params["strides"] or (1,) * len(starts)
    x = as_tensor(x)
    key = tuple(slice(int(a), int(b), int(s)) for a, b, s in zip(starts, limits, strides))
    if all(k.start == 0 and k.stop == n and k.step == 1 for k, n in zip(key, x.shape)):
        return x
    return x[key]


def _starts(ev, idx: Sequence[Any], shape: Sequence[int], sizes: Sequence[int], what: str) -> list[int]:
    """Dynamic start indices read on the host and clamped into range, as lax clamps them."""
    out = []
    for d, (i, n, s) in enumerate(zip(idx, shape, sizes)):
        if isinstance(i, Tensor) and i.is_abstract:
            raise ShardingError(f"{what}: the start index of dim {d} is a value the program computes, and it runs "
                                f"without data (nb.abstract), so where the slice lies is unknown")
        v = int(i.numpy()) if isinstance(i, Tensor) else int(i)
        out.append(min(max(v, 0), n - s))
    return out


@primitive("dynamic_slice")
def _dynamic_slice(ev, e, x, *idx):
    x = as_tensor(x)
    sizes = tuple(int(s) for s in e.params["slice_sizes"])
    starts = _starts(ev, idx[:x.ndim], x.shape, sizes, "dynamic_slice")
    key = tuple(slice(a, a + s) for a, s in zip(starts, sizes))
    return x if sizes == x.shape else x[key]


@primitive("dynamic_update_slice")
def _dynamic_update_slice(ev, e, x, upd, *idx):
    x, upd = as_tensor(x), as_tensor(upd)
    starts = _starts(ev, idx, x.shape, upd.shape, "dynamic_update_slice")
    return _update(x, upd, starts, 0)


def _update(x: Tensor, u: Tensor, starts: list[int], d: int) -> Tensor:
    """``x`` with ``u`` written at ``starts``: the dims where ``u`` is shorter are cut around it and joined again."""
    if d == x.ndim:
        return u
    if u.shape[d] == x.shape[d]:
        return _update(x, u, starts, d + 1)
    s, n = starts[d], u.shape[d]
    pre = (slice(None),) * d
    parts = [x[pre + (slice(0, s),)]] if s else []
    parts.append(_update(x[pre + (slice(s, s + n),)], u, starts, d + 1))
    if s + n < x.shape[d]:
        parts.append(x[pre + (slice(s + n, x.shape[d]),)])
    return parts[0] if len(parts) == 1 else O.concatenate(parts, axis=d)


@primitive("split")
def _split(ev, e, x):
    x = as_tensor(x)
    axis = int(e.params["axis"])
    out, at = [], 0
    for s in e.params["sizes"]:
        s = int(s)
        out.append(x[(slice(None),) * axis + (slice(at, at + s),)])
        at += s
    return out


@primitive("iota")
def _iota(ev, e, *dyn):
    if dyn:
        raise ShardingError("iota with dynamic shapes is not supported")
    shape = tuple(int(n) for n in e.params["shape"])
    d = int(e.params["dimension"])
    dt = np.dtype(e.params["dtype"])
    line = np.arange(shape[d], dtype=dt).reshape((1,) * d + (shape[d],) + (1,) * (len(shape) - d - 1))
    return const(ev, np.ascontiguousarray(np.broadcast_to(line, shape)))


@primitive("unstack")
def _unstack(ev, e, x):
    x = as_tensor(x)
    axis = int(e.params["axis"])
    return [x[(slice(None),) * axis + (i,)] for i in range(x.shape[axis])]


@primitive("empty", "empty2")
def _empty(ev, e):
    """An uninitialized buffer (a branch's unused residual): zeros."""
    aval = e.out_avals[0]
    return const(ev, np.zeros(aval.shape, aval.dtype))
