"""``jax.random`` on nabla: a PRNG key array is its raw ``uint32`` data (``Key``, a tensor with the key's trailing
dims); ``random_bits``, ``random_split``, ``random_fold_in`` and ``random_seed`` run the key implementation's own
functions (traced once per shape with ``jax.make_jaxpr`` and run here), so the bits are JAX's exactly, under the
``jax_threefry_partitionable`` setting in force; their ``threefry2x32`` hash is nabla's registered op. Shape
primitives on key arrays act on the data with the key dims kept last."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import ops as O
from ..errors import ShardingError
from ..ops import lax_ops as X
from ..tensor import Tensor
from .interpreter import compile_jaxpr
from .table import as_tensor, const, keyed, primitive


class Key(NamedTuple):
    """A PRNG key array: ``data`` (uint32, the key array's shape then the implementation's key shape) and its
    implementation (JAX's ``PRNGImpl``)."""

    data: Tensor
    impl: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape[:self.data.ndim - len(self.impl.key_shape)]


def _impl_of(aval: Any) -> Any:
    return aval.dtype._impl


@primitive("random_wrap")
def _wrap(ev, e, data):
    return Key(as_tensor(data), e.params["impl"])


@keyed("random_unwrap")
def _unwrap(ev, e, key):
    return key.data


@keyed("random_clone", "copy", "copy_p", "optimization_barrier")
def _same(ev, e, *keys):
    return list(keys) if e.multi else keys[0]


def _traced(e: Any, name: str, fn, shapes: tuple, dtypes: tuple):
    """The key implementation's function ``fn`` as a compiled program on raw key data, vmapped over the key array's
    dims (traced once per equation)."""
    prog = e.subs.get(name)
    if prog is None:
        import jax  # (a jaxpr exists: jax is installed)
        closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)])
        prog = e.subs[name] = (compile_jaxpr(closed.jaxpr, e.site), tuple(as_tensor(np.asarray(c))
                                                                            for c in closed.consts))
    return prog


def _vmapped(fn, n: int):
    import jax
    for _ in range(n):
        fn = jax.vmap(fn)
    return fn


def _run_impl(ev, e, name: str, fn, args: list) -> Any:
    key_dims = len(args[0].impl.key_shape) if isinstance(args[0], Key) else 0
    vals = [a.data if isinstance(a, Key) else as_tensor(a) for a in args]
    batch = vals[0].ndim - key_dims
    prog, consts = _traced(e, name, _vmapped(fn, batch), tuple(v.shape for v in vals), tuple(v.dtype for v in vals))
    return ev.run(prog, consts, vals)[0]


@keyed("random_bits")
def _bits(ev, e, key):
    impl, bw, shape = key.impl, int(e.params["bit_width"]), tuple(e.params["shape"])
    return _run_impl(ev, e, "bits", lambda k: impl.random_bits(k, bw, shape), [key])


@keyed("random_split")
def _split(ev, e, key):
    impl, shape = key.impl, tuple(e.params["shape"])
    return Key(_run_impl(ev, e, "split", lambda k: impl.split(k, shape), [key]), impl)


@keyed("random_fold_in")
def _fold_in(ev, e, key, msgs):
    impl = key.impl
    msgs = as_tensor(msgs)
    if msgs.shape != key.shape:
        msgs = O.broadcast_to(msgs, key.shape)
    return Key(_run_impl(ev, e, "fold_in", lambda k, m: impl.fold_in(k, m), [key, msgs]), impl)


@primitive("random_seed")
def _seed(ev, e, seeds):
    impl = e.params["impl"]
    seeds = as_tensor(seeds)
    return Key(_run_impl(ev, e, "seed", lambda s: impl.seed(s), [seeds]), impl)


@primitive("threefry2x32")
def _threefry(ev, e, k1, k2, x1, x2):
    both = X.threefry2x32(k1, k2, x1, x2)
    return [both[..., 0], both[..., 1]]


@primitive("iota_2x32_shape")
def _iota_2x32(ev, e):
    """The high and low words of each element's row-major position (a 64-bit counter in two uint32s)."""
    shape = tuple(int(n) for n in e.params["shape"])
    pos = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.uint64).reshape(shape)
    return [const(ev, (pos >> np.uint64(32)).astype(np.uint32)), const(ev, (pos & np.uint64(0xFFFFFFFF)).astype(np.uint32))]


# ---- shape primitives on key arrays: the data with the key dims kept last ---------------------------------------


def _kd(key: Key) -> int:
    return len(key.impl.key_shape)


def _rewrap(key: Key, data: Tensor) -> Key:
    return Key(data, key.impl)


@keyed("slice")
def _k_slice(ev, e, key):
    starts, limits = e.params["start_indices"], e.params["limit_indices"]
    strides = e.params["strides"] or (1,) * len(starts)
    idx = tuple(slice(int(a), int(b), int(s)) for a, b, s in zip(starts, limits, strides))
    return _rewrap(key, key.data[idx])


@keyed("squeeze")
def _k_squeeze(ev, e, key):
    dims = tuple(e.params["dimensions"])
    return _rewrap(key, O.squeeze(key.data, dims)) if dims else key


@keyed("reshape")
def _k_reshape(ev, e, key):
    shape = tuple(int(n) for n in e.params["new_sizes"]) + tuple(key.impl.key_shape)
    return _rewrap(key, O.reshape(key.data, shape))


@keyed("broadcast_in_dim")
def _k_broadcast(ev, e, key):
    shape = tuple(int(n) for n in e.params["shape"])
    bdims = tuple(e.params["broadcast_dimensions"])
    data = key.data
    new = tuple(d for d in range(len(shape)) if d not in bdims)
    if new:
        data = O.expand_dims(data, new)
    full = shape + tuple(key.impl.key_shape)
    return _rewrap(key, data if data.shape == full else O.broadcast_to(data, full))


@keyed("concatenate")
def _k_concat(ev, e, *keys):
    return _rewrap(keys[0], O.concatenate([k.data for k in keys], axis=int(e.params["dimension"])))


@keyed("transpose")
def _k_transpose(ev, e, key):
    perm = tuple(e.params["permutation"])
    n = len(perm)
    return _rewrap(key, O.transpose(key.data, perm + tuple(range(n, n + _kd(key)))))


@keyed("select_n")
def _k_select(ev, e, which, *keys):
    which = as_tensor(which)
    w = O.expand_dims(which, tuple(range(which.ndim, which.ndim + _kd(keys[0])))) if which.ndim else which
    if which.dtype == np.bool_ and len(keys) == 2:
        return _rewrap(keys[0], O.where(w, keys[1].data, keys[0].data))
    out = keys[0].data
    for i, k in enumerate(keys[1:], 1):
        out = O.where(O.equal(w, i), k.data, out)
    return _rewrap(keys[0], out)


@keyed("dynamic_slice")
def _k_dynamic_slice(ev, e, key, *idx):
    sizes = tuple(int(s) for s in e.params["slice_sizes"])
    starts = []
    for d, (i, n, s) in enumerate(zip(idx, key.shape, sizes)):
        if isinstance(i, Tensor) and i.is_abstract:
            raise ShardingError("dynamic_slice of keys at a start the program computes, without data")
        v = int(i.numpy()) if isinstance(i, Tensor) else int(i)
        starts.append(min(max(v, 0), n - s))
    return _rewrap(key, key.data[tuple(slice(a, a + s) for a, s in zip(starts, sizes))])


def index0(x: Any, i: int) -> Any:
    """``x[i]`` along the first dim (a key array's data too)."""
    return _rewrap(x, x.data[i]) if isinstance(x, Key) else x[i]


def stack0(xs: list) -> Any:
    """The values stacked on a new first dim (key arrays: their data)."""
    if isinstance(xs[0], Key):
        return _rewrap(xs[0], O.stack([k.data for k in xs], axis=0))
    return O.stack([as_tensor(x) for x in xs], axis=0)
