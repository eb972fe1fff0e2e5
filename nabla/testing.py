"""Checks and hypothesis strategies for sharded programs, for nabla's tests and for users' own:
``assert_sharded_allclose`` (global value and every block), ``assert_comm`` (exact collective counts),
``assert_gradient_matches`` (a gradient on many layouts), ``elementwise_ops`` (the registered ops a sweep covers),
``numpy_unanswered`` (numpy functions no op runs), and the strategies ``meshes``, ``specs``, ``shapes``,
``sharded_arrays``, ``programs`` (need hypothesis)."""

from __future__ import annotations

import contextlib
from functools import lru_cache
from itertools import permutations, product
from math import prod
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import _programs
from ._programs import elementwise_ops  # noqa: F401 - public here
from .autodiff import grad
from .dtypes import is_inexact
from .collectives import CommLog, kinds
from .layout import chunks
from .mesh import DeviceMesh
from .spec import DimSpec, ShardingSpec
from .ops import registry, tensor
from .tensor import Tensor


def assert_sharded_allclose(t: Tensor, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """The global value equals ``expected`` and each device's block equals ``expected`` at its slice.

    For a partial tensor the blocks are summands, so they are checked through their sum instead.
    """
    expected = np.asarray(expected)
    assert t.shape == expected.shape, f"shape {t.shape} != expected {expected.shape}"
    got = t.numpy()
    exact = expected.dtype.kind in "iub" and got.dtype.kind in "iub"
    if exact:
        np.testing.assert_array_equal(got, expected, err_msg=f"global value of {t!r}")
    else:
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"global value of {t!r}")
    spec = t.sharding
    if spec is None:
        return
    spec.check_rank(t.shape, "assert_sharded_allclose")
    if t._data is not None:
        stored = t._data.shape[len(t._data.shape) - t.ndim:]
        assert stored == chunks(spec, t.shape), f"stored block shape {stored} != ceil-rule chunk {chunks(spec, t.shape)}"
    if spec.partial_axes:
        return
    for d, blk in t.shards.items():
        sl = spec.shard_slices(t.shape, d)
        msg = f"device {d} block of {t!r} at {sl}"
        if exact:
            np.testing.assert_array_equal(blk, expected[sl], err_msg=msg)
        else:
            np.testing.assert_allclose(blk, expected[sl], rtol=rtol, atol=atol, err_msg=msg)


def assert_matches_numpy(t: Tensor, expected: Any, rtol: float = 0.0, atol: float = 0.0,
                         signed_zeros: bool = True) -> None:
    """``t`` is numpy's ``expected`` exactly where exactness is defined: shape, dtype, NaN positions, infinities
    and their signs, the signs of zeros (each part of a complex number alike); finite values within ``rtol`` /
    ``atol`` (0: equal). Every device's block is the global value at its slice, checked the same way (a partial
    tensor's blocks are summands: its value is checked through their sum). ``signed_zeros=False`` skips the signs
    of zeros in the global value (numpy's complex matmul gives -0.0 or +0.0 by the shape of its operands)."""
    expected = np.asarray(expected)
    got = t.numpy()
    assert t.shape == expected.shape == got.shape, f"shape {t.shape} (read {got.shape}) != numpy's {expected.shape}"
    assert t.dtype == expected.dtype == got.dtype, f"dtype {t.dtype} (read {got.dtype}) != numpy's {expected.dtype}"
    _same_values(got, expected, rtol, atol, f"global value of {t!r}", signed_zeros)
    spec = t.sharding
    if spec is None or spec.partial_axes:
        return
    for d, blk in t.shards.items():
        sl = spec.shard_slices(t.shape, d)
        assert blk.dtype == expected.dtype, f"device {d} block dtype {blk.dtype} != {expected.dtype}"
        _same_values(np.asarray(blk), got[sl], 0.0, 0.0, f"device {d} block of {t!r} at {sl}")


def _same_values(got: np.ndarray, want: np.ndarray, rtol: float, atol: float, what: str,
                 signed_zeros: bool = True) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if not is_inexact(want.dtype):
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    cnan = np.zeros(want.shape, bool)
    if want.dtype.kind == "c":  # a complex NaN is NaN in either part; which part numpy's own kernels fill differs
        cnan = np.isnan(want)  # between its code paths (BLAS or not), so only NaN-ness is compared there
        if (np.isnan(got) != cnan).any():
            i = tuple(int(j[0]) for j in np.nonzero(np.isnan(got) != cnan)) if cnan.ndim else ()
            raise AssertionError(f"{what}: complex NaN positions differ, e.g. at {i}: {got[i]!r} vs {want[i]!r}")
    for part in ((np.real, np.imag) if want.dtype.kind == "c" else (lambda x: x,)):
        g, w = np.where(cnan, 0, part(got)), np.where(cnan, 0, part(want))
        bad = np.isnan(g) != np.isnan(w)
        bad |= np.isinf(w) != np.isinf(g)
        bad |= np.isinf(w) & (g != w)
        if signed_zeros:
            bad |= (w == 0) & (g == 0) & (np.signbit(g) != np.signbit(w))
        fin = np.isfinite(w) & np.isfinite(g)
        with np.errstate(all="ignore"):
            gf, wf = g.astype(np.float64), w.astype(np.float64)
            bad |= fin & ~(np.abs(gf - wf) <= atol + rtol * np.abs(wf))
        if bad.any():
            i = tuple(int(j[0]) for j in np.nonzero(bad)) if bad.ndim else ()
            raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements differ from numpy's, e.g. at "
                                 f"{i}: {got[i]!r} vs {want[i]!r}\n got {got.ravel()[:12]}\nwant {want.ravel()[:12]}")


def assert_comm(log: CommLog, **counts: int) -> None:
    """The log holds exactly these counts per collective kind; kinds not named must be zero."""
    for k in counts:
        if k not in kinds():
            raise AssertionError(f"assert_comm: unknown collective kind {k!r}; kinds are {kinds()}")
    want = {k: v for k, v in counts.items() if v}
    got = log.counts
    assert got == want, f"collectives {got} != expected {want}\n{log.summary()}"


@contextlib.contextmanager
def numpy_unanswered(*names: str) -> Iterator[None]:
    """Inside the block no registered op answers numpy's functions ``names`` (``np.<name>(tensor)`` raises, or an op
    the block registers answers it); the ops that did are registered back after. A test of a numpy function nabla
    does not run, or of an op it registers to answer one, then reserves no name nabla may add (``tan``, ``cbrt``:
    one ``elementwise(...)`` call each)."""
    held = [op for op in dict.fromkeys(registry.by_numpy(n) for n in names) if op is not None]
    for op in held:
        registry.unregister(op)
    try:
        yield
    finally:
        for op in held:
            registry.register(op)


def placements(mesh: DeviceMesh, rank: int, max_per_dim: int = 2) -> list[tuple[list, tuple[str, ...]]]:
    """Every assignment of ``mesh``'s axes to ``rank`` dims (each axis at most once, up to ``max_per_dim`` per
    dim, in every order), and each again held as partial sums over each axis it leaves free and over all of
    them: ``[(dim specs, partial axes), ...]``."""
    axes = list(mesh.axis_names)
    per_dim = [None] + [p if len(p) > 1 else p[0] for n in range(1, max_per_dim + 1) for p in permutations(axes, n)]
    out = []
    for combo in product(per_dim, repeat=rank):
        used = [a for c in combo if c for a in ((c,) if isinstance(c, str) else c)]
        if len(used) != len(set(used)):
            continue
        free = tuple(a for a in axes if a not in used)
        out.append((list(combo), ()))
        out += [(list(combo), (a,)) for a in free]
        if len(free) > 1:
            out.append((list(combo), free))
    return out


def assert_gradient_matches(fn: Any, x: np.ndarray, weights: Any, want: Any, mesh: DeviceMesh,
                            cases: Sequence | None = None, rtol: float = 1e-12, atol: float = 1e-12) -> None:
    """``nb.grad`` of ``sum(fn(t) * weights)`` is ``want``, with ``t`` the value ``x`` placed as each of ``cases``
    (``(dim specs, partial axes)`` pairs; default: every one of ``placements(mesh, x.ndim)``), and is laid out as
    its primal (the same dim specs, nothing pending). ``weights``, shaped like ``fn``'s output, give every output
    element its own cotangent."""
    for dims, partial in placements(mesh, x.ndim) if cases is None else cases:
        t = tensor(x).shard(mesh, dims, partial_axes=partial)
        g = grad(lambda a: (fn(a) * weights).sum())(t)
        what = f"gradient on {dims} partial over {partial}"
        assert g.sharding.partial_axes == (), f"{what} left pending: {g.sharding}"
        assert [d.axes for d in g.sharding.dim_specs] == [d.axes for d in t.sharding.dim_specs], \
            f"{what} laid out {g.sharding}"
        try:
            assert_sharded_allclose(g, want, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None


# ---- hypothesis strategies ---------------------------------------------------------------------------


def _st():
    import hypothesis.strategies as st
    return st


def examples(ci: int, thorough_share: int = 3) -> int:
    """How many examples a slow property runs: ``ci`` under a short profile (at most 100 examples), else a
    ``1/thorough_share`` of the loaded profile's count (10,000 under ``thorough``: 3,333). A plain
    ``@settings(max_examples=n)`` would pin ``n`` under every profile, long runs included."""
    from hypothesis import settings
    n = settings().max_examples
    return ci if n <= 100 else max(ci, n // thorough_share)


@lru_cache(maxsize=16)
def _composed(fn: Callable) -> Callable:
    """``st.composite(fn)``, made once: hypothesis reads ``fn``'s source each time it decorates, which, done per
    draw inside a strategy, cost a random-program search seconds."""
    return _st().composite(fn)


def _mesh(draw, max_axes: int, max_devices: int, custom_order: bool) -> DeviceMesh:
    st = _st()
    n = draw(st.integers(1, max_axes))
    sizes: list[int] = []
    for _ in range(n):
        budget = max_devices // prod(sizes) if sizes else max_devices
        sizes.append(draw(st.integers(1, max(1, min(4, budget)))))
    devices = list(range(prod(sizes)))
    if custom_order and draw(st.booleans()):
        devices = draw(st.permutations(devices))
    return DeviceMesh("m", tuple(sizes), ("x", "y", "z")[:n], devices)


def meshes(max_axes: int = 3, max_devices: int = 16, custom_order: bool = True):
    """Meshes of 1 to ``max_axes`` axes named x, y, z (sizes 1-4), sometimes with a shuffled device order."""
    return _composed(_mesh)(max_axes, max_devices, custom_order)


def _spec(draw, mesh: DeviceMesh, rank: int, partial: bool, open_dims: bool, sub_axes: bool) -> ShardingSpec:
    st = _st()
    pieces: list[str] = []
    for name, n in zip(mesh.axis_names, mesh.shape):
        if n == 4 and sub_axes and draw(st.booleans()):
            pieces += [f"{name}:(1)2", f"{name}:(2)2"]
        else:
            pieces.append(name)
    dims: list[list[str]] = [[] for _ in range(rank)]
    rep, par = [], []
    for p in draw(st.permutations(pieces)):
        where = draw(st.integers(-3 if partial else -2, rank - 1))
        if where >= 0:
            dims[where].append(p)
        elif where == -2:
            rep.append(p)
        elif where == -3:
            par.append(p)
    ds = [DimSpec(tuple(d), is_open=open_dims and draw(st.booleans())) for d in dims]
    return ShardingSpec(mesh, ds, rep, par)


def specs(mesh: DeviceMesh, shape: Sequence[int], partial: bool = True, open_dims: bool = True,
          sub_axes: bool = True):
    """Valid specs of ``mesh`` for a tensor of ``shape``: several axes per dim, sub-axes, replicated
    and (optionally) partial axes, open dims."""
    return _composed(_spec)(mesh, len(shape), partial, open_dims, sub_axes)


def shapes(max_rank: int = 4, max_dim: int = 9, min_rank: int = 0):
    st = _st()
    return st.lists(st.integers(0, max_dim), min_size=min_rank, max_size=max_rank).map(tuple)


def _sharded_array(draw, mesh: DeviceMesh | None, shape: tuple | None, partial: bool, dtype: str) -> tuple:
    m = mesh if mesh is not None else draw(meshes())
    shp = shape if shape is not None else draw(shapes())
    spec = draw(specs(m, shp, partial=partial))
    seed = draw(_st().integers(0, 2**16))
    value = np.random.default_rng(seed).standard_normal(shp).astype(dtype)
    t = Tensor._host(value).shard(m, spec.dim_specs, spec.replicated_axes, spec.partial_axes)
    return t, value


def sharded_arrays(mesh: DeviceMesh | None = None, shape: Sequence[int] | None = None, partial: bool = True,
                   dtype: str = "float32"):
    """``(tensor, value)`` pairs: a random value placed with a random spec on a random (or given) mesh."""
    return _composed(_sharded_array)(mesh, tuple(shape) if shape is not None else None, partial, dtype)


def special_values(dtype: Any, shape: Sequence[int], extreme: bool = True, nonfinite: bool = True):
    """Arrays of ``dtype`` and ``shape`` drawn from values that break careless code: 0, -0.0, NaN, +-inf (unless
    not ``nonfinite``), small ints, and with ``extreme`` the dtype's largest, smallest and tiniest values
    (complex: each part)."""
    dt = np.dtype(dtype)
    n = prod(shape)
    if dt.kind == "b":
        pool: list = [True, False]
    elif dt.kind in "iu":
        pool = [0, 1, 2, 3, 7] + ([-1, -5] if dt.kind == "i" else [])
        if extreme:
            pool += [int(np.iinfo(dt).max), int(np.iinfo(dt).min)] + ([int(np.iinfo(dt).min) + 1] if dt.kind == "i" else [])
    else:
        fi = np.finfo(dt)
        pool = [0.0, -0.0, 1.0, -2.5, 3.0, 0.5, -7.0] + ([np.inf, -np.inf, np.nan] if nonfinite else [])
        if extreme:
            pool += [float(fi.max), -float(fi.max), float(fi.tiny), -float(fi.smallest_subnormal)]

    return _composed(_special)(tuple(pool), dt, n, tuple(shape))


def _special(draw, pool: tuple, dt: np.dtype, n: int, shape: tuple) -> np.ndarray:
    st = _st()
    vals = draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n))
    if dt.kind == "c":
        im = draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n))
        a = np.array([complex(r, i) for r, i in zip(vals, im)], dtype=dt)  # keeps -0.0 imaginary parts
    else:
        with np.errstate(all="ignore"):
            a = np.array(vals, dtype=object).astype(dt) if dt.kind in "iu" else np.array(vals, dtype=dt)
    return a.reshape(shape)


def programs(mesh: DeviceMesh | None = None, max_ops: int = 5):
    """A hypothesis strategy of random op chains, each drawn as a ``Program``, so one property checks many
    programs against numpy.

    ``prog.run(nb)`` runs the chain on the sharded tensors and returns a ``Tensor``; ``prog.run(np)`` runs
    the same chain on their numpy values: compare the two. ``prog.inputs`` is ``[(tensor, value), ...]``
    (the chain's input, then the other operand its binary steps use); ``prog.steps`` is
    ``[(description, fn), ...]``; ``prog.mesh`` is the mesh (``mesh``, or a drawn one of up to 8 devices).
    Chains of 1 to ``max_ops`` steps draw from elementwise ops, matmul, reductions, transpose, reshape,
    slices, expand_dims, softmax and ``with_sharding``. A failing example prints as its mesh, input shardings
    and steps.

    >>> import numpy as np
    >>> from hypothesis import given
    >>> import nabla as nb
    >>> from nabla.testing import assert_sharded_allclose, programs
    >>> @given(programs(max_ops=3))
    ... def test_chains_equal_numpy(prog):
    ...     got = prog.run(nb)
    ...     with np.errstate(all="ignore"):  # numpy's overflow warnings
    ...         want = prog.run(np)
    ...     assert_sharded_allclose(got, np.asarray(want, got.dtype), rtol=1e-4, atol=1e-4)
    >>> test_chains_equal_numpy()
    """
    return _programs.programs(mesh, max_ops, meshes, shapes, specs)
