"""The jax backend: blocks live on real jax devices (8 forced host CPU devices in a child process),
kernels run there, moves between layouts are device transfers, and every result equals numpy."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import nabla as nb
from nabla import backends as B

pytest.importorskip("jax")

CHILD = textwrap.dedent("""
    import numpy as np, nabla as nb
    from nabla import DeviceMesh
    from nabla.testing import assert_sharded_allclose, assert_comm

    mesh = DeviceMesh("m", (2, 4), ("dp", "tp"), devices=[7, 6, 5, 4, 3, 2, 1, 0])
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 12)).astype(np.float32)
    with nb.backend("jax"):
        X = nb.tensor(x).shard(mesh, ["dp", None])
        W1, W2 = nb.tensor(w).shard(mesh, [None, "tp"]), nb.tensor(w.T).shard(mesh, ["tp", None])
        with nb.comm_log() as log:
            out = (nb.relu(X @ W1) @ W2).with_sharding(mesh, ["dp", None])
        assert_comm(log, all_reduce=1)
        assert_sharded_allclose(out, np.maximum(x @ w, 0) @ w.T, rtol=1e-4, atol=1e-4)
        data = out._data
        assert type(data).__module__.startswith("jax"), type(data)
        for shard in data.addressable_shards:  # each jax device holds exactly its own block
            np.testing.assert_allclose(np.asarray(shard.data).reshape(out.shards[shard.device.id].shape),
                                       out.shards[shard.device.id], rtol=1e-6)

        v = rng.standard_normal((5, 7))  # float64, uneven over every axis
        cases = [("sum0", lambda t: t.sum(0), v.sum(0)), ("T", lambda t: t.T, v.T),
                 ("max1", lambda t: t.max(1), v.max(1)), ("argmax1", lambda t: t.argmax(1), v.argmax(1)),
                 ("softmax1", lambda t: nb.softmax(t, 1), np.exp(v) / np.exp(v).sum(1, keepdims=True)),
                 ("reshape", lambda t: t.reshape(35), v.reshape(35)), ("slice", lambda t: t[1:4, ::2], v[1:4, ::2]),
                 ("mean", lambda t: t.mean(), v.mean()), ("concat", lambda t: nb.concatenate([t, t], 0),
                                                          np.concatenate([v, v], 0)),
                 ("matmul", lambda t: t @ v.T, v @ v.T), ("add_host", lambda t: t + 1.5, v + 1.5),
                 ("reshard", lambda t: t.with_sharding(mesh, [None, ("tp", "dp")]), v)]
        for spec in (["dp", "tp"], [("dp", "tp"), None], [None, "tp"], [None, None]):
            t = nb.tensor(v).shard(mesh, spec)
            for name, f, want in cases:
                got = f(t)
                assert got.dtype == np.asarray(want).dtype, (name, got.dtype)
                assert_sharded_allclose(got, want, rtol=1e-6, atol=1e-6)
        p = nb.tensor(v).shard(mesh, [None, None], partial_axes=["tp"])
        assert_sharded_allclose((p + 1.0).with_sharding(mesh, ["tp", None]), v + 1.0, rtol=1e-6, atol=1e-6)
    print("ok")
""")


def _run_on_8_devices(code: str) -> None:
    """Run ``code`` in a child process whose jax has 8 host CPU devices; it prints "ok" last."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_programs_on_real_jax_devices():
    _run_on_8_devices(CHILD)


def test_namespace_follows_the_arrays():
    assert B.xp(np.ones(2)) is np
    assert B.of(np.ones(2)) is B.NUMPY and B.active() is B.NUMPY


def test_unknown_backend_is_a_sharding_error():
    with pytest.raises(nb.ShardingError, match="unknown backend 'tpu'"):
        with nb.backend("tpu"):
            pass


SUB_AXES = textwrap.dedent("""
    import jax, numpy as np, nabla as nb
    from nabla import DeviceMesh
    from nabla.testing import assert_sharded_allclose
    assert not jax.config.jax_enable_x64
    mesh = DeviceMesh("m", (8,), ("x",))
    v = np.arange(64.0).reshape(8, 8)
    with nb.backend("jax"):
        assert jax.config.jax_enable_x64
        t = nb.tensor(v).shard(mesh, ["x:(1)2", "x:(2)4"])     # sub-axes: jax mesh axes of 2 and 4
        assert {s.device.id for s in t._data.addressable_shards} == set(range(8))
        u = (t * 2).with_sharding(mesh, ["x:(2)4", "x:(1)2"])
        assert_sharded_allclose(u, v * 2, rtol=0, atol=0)
        for shard in u._data.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data).reshape(u.shards[shard.device.id].shape),
                                          u.shards[shard.device.id])
    assert not jax.config.jax_enable_x64, "jax_enable_x64 must be restored after the block"
    print("ok")
""")


def test_sub_axes_on_jax_devices_and_x64_restored():
    _run_on_8_devices(SUB_AXES)


#: what both child scripts below start with: a reversed 2x4 mesh, and the per-device view of a set of layouts
#: (their common cuts, the jax mesh atoms and names, how many grid axes, a PartitionSpec for each layout)
DEVICE_GRID = textwrap.dedent("""
    import jax, numpy as np
    from jax.sharding import PartitionSpec
    from nabla import DeviceMesh
    from nabla.backends import NUMPY
    from nabla.backends.jax import atom_mesh, atom_name
    from nabla.backends.jax_local import JaxLocalBackend, mesh_atoms
    from nabla.layout import grid, merge_cuts, spec_cuts

    mesh = DeviceMesh("m", (2, 4), ("dp", "tp"), devices=[7, 6, 5, 4, 3, 2, 1, 0])

    def device_grid(specs):
        cuts = merge_cuts(*(spec_cuts(s) for s in specs))
        atoms = mesh_atoms(mesh, cuts)
        names = tuple(atom_name(a) for a in atoms)
        G = len(atoms)
        def pspec(spec, rank):
            g = (1,) * G if spec is None else grid(spec, cuts).shape
            return PartitionSpec(*[n if s > 1 else None for n, s in zip(names, g)], *([None] * rank))
        return cuts, atoms, names, G, pspec
""")

INTERFACE = DEVICE_GRID + textwrap.dedent("""
    from nabla import ShardingSpec, reshard, storage

    S = lambda dims, partial=(): ShardingSpec(mesh, dims, partial_axes=list(partial))

    def per_device(fn, x, src, dst, specs):
        # fn(backend, block) on every device's block under shard_map: src's blocks (None: the whole host value on
        # every device) in, dst's out, as one array on the specs' common grid
        cuts, atoms, names, G, pspec = device_grid(specs)
        if src is None:
            x = x.reshape((1,) * G + x.shape)
        else:
            x = x.reshape(grid(src, cuts).shape + x.shape[len(grid(src).shape):])
        rank = x.ndim - G
        def body(a):
            out = fn(JaxLocalBackend(mesh, atoms, names), a.reshape(a.shape[G:]))
            return out.reshape((1,) * G + out.shape)
        f = jax.shard_map(body, mesh=atom_mesh(mesh, atoms), in_specs=(pspec(src, rank),),
                          out_specs=pspec(dst, rank), check_vma=False)
        return np.asarray(jax.jit(f)(x)), cuts

    def same(a, b):  # equal, signs of zeros included
        np.testing.assert_array_equal(a, b)
        assert (np.signbit(a) == np.signbit(b)).all()

    rng = np.random.default_rng(0)
    v = rng.standard_normal((5, 7)).astype(np.float32)
    v[0, 0] = -0.0
    specs = [S(["dp", "tp"]), S([("dp", "tp"), None]), S([None, "tp"]), S(["tp", None], ["dp"]),
             S(["tp:(1)2", "tp:(2)2"]), S([None, None], ["tp"])]
    for spec in specs:  # place: each device cuts its block of the host value
        got, cuts = per_device(lambda be, b: be.place(b, spec), v, None, spec, [spec])
        want = NUMPY.place(v, spec)
        same(got, want.reshape(grid(spec, cuts).shape + want.shape[len(grid(spec).shape):]))
    for spec, axes, zero in [(S(["dp", None]), ("tp",), None), (S([None, "tp:(1)2"], ["dp"]), ("tp:(2)2",), None),
                             (S([None, None]), ("dp", "tp"), 0.0), (S(["tp:(1)2", None]), ("tp:(2)2", "dp"), None)]:
        wider = S(spec.dim_specs, tuple(spec.partial_axes) + axes)
        blocks = NUMPY.place(v, spec)  # add once: the value stays on coordinate 0 of the new partial axes
        got, cuts = per_device(lambda be, b: be.add_once(b, spec, axes, zero), blocks, spec, wider, [spec, wider])
        want = NUMPY.add_once(blocks, spec, axes, zero)
        same(got, want.reshape(grid(wider, cuts).shape + want.shape[len(grid(wider, cuts).shape):]))
    for src, dst in [(S(["dp", "tp"]), S(["tp", "dp"])), (S(["dp", None], ["tp"]), S(["dp", "tp"])),
                     (S([("dp", "tp"), None]), S([None, None])), (S([None, "tp"], ["dp"]), S([None, None]))]:
        plan = reshard.plan(v.shape, v.itemsize, src, dst)  # move: the plan's collectives, each way
        blocks = NUMPY.place(v, src)
        got, _ = per_device(lambda be, b: be.move(b, plan, v.shape), blocks, src, dst, [src, dst])
        want = NUMPY.move(blocks, plan, v.shape)
        np.testing.assert_allclose(storage.assemble(got.reshape(want.shape), dst, v.shape),
                                   storage.assemble(want, dst, v.shape), rtol=1e-6)
        np.testing.assert_allclose(storage.assemble(want, dst, v.shape), v, rtol=1e-6)
    print("ok")
""")


def test_grid_and_per_device_backends_place_add_once_and_move_alike():
    _run_on_8_devices(INTERFACE)


KERNEL = DEVICE_GRID + textwrap.dedent("""
    import nabla as nb
    from nabla import backends, storage
    from nabla.executor import ready
    from nabla.program import Program
    from nabla.value import serial

    backends.get("jax")  # (kernels take jax.numpy for arrays a known backend owns, as under nb.jit)

    def operand(be, x, u, p, prog):  # an operand's blocks as the kernel takes them (what the interpreters do)
        if p.kind == "scalar" and not p.mask_axes:
            return u.const
        if p.kind == "sharded":
            x = be.move(x, p.plan, u.shape)
        elif p.kind == "scalar":  # a scalar joining a partial sum: placed, then added once
            x = be.place(np.asarray(u.const, dtype=prog.dtype), p.target)
        else:
            x = be.place(x, p.target)
        return ready(x, p, be)

    def both(f, *args):
        # f's op run eagerly; then its program's kernel by the grid backend, and by jax_local on every device
        with nb.comm_log() as log:
            want = f(*args)
        step = log.steps[-1]
        prog, op = step.prog, step.op
        assert isinstance(prog, Program), step
        hosts = iter(a for a in args if isinstance(a, np.ndarray))
        data = {serial(a): a._data for a in args if isinstance(a, nb.Tensor)}
        datas = [None if not u.value else data[u.value] if u.src is not None else next(hosts) for u in step.uses]
        grid_out = NUMPY.kernel(op, [operand(NUMPY, d, u, p, prog) for d, u, p in zip(datas, step.uses, prog.preps)],
                                prog)
        np.testing.assert_array_equal(grid_out, want._data)  # eager dispatch calls this very kernel
        specs = [s for a in args if isinstance(a, nb.Tensor) for s in [a._spec]] + \\
            [p.target for p in prog.preps if p.target is not None] + [prog.kspec, prog.result]
        cuts, atoms, names, G, pspec = device_grid(specs)
        ins = [(d, u, p) for d, u, p in zip(datas, step.uses, prog.preps) if p.kind == "sharded"]
        def body(*blocks):
            dev = JaxLocalBackend(mesh, atoms, names)
            it = iter(b.reshape(b.shape[G:]) for b in blocks)
            arrays = [operand(dev, next(it) if p.kind == "sharded" else d, u, p, prog)
                      for d, u, p in zip(datas, step.uses, prog.preps)]
            out = dev.kernel(op, arrays, prog)
            return out.reshape((1,) * G + out.shape)
        xs = [d.reshape(grid(u.src, cuts).shape + d.shape[len(grid(u.src).shape):]) for d, u, _ in ins]
        f = jax.shard_map(body, mesh=atom_mesh(mesh, atoms), in_specs=tuple(pspec(u.src, len(u.shape))
                          for _, u, _ in ins), out_specs=pspec(prog.result, len(step.out_shape)), check_vma=False)
        local_out = np.asarray(jax.jit(f)(*xs)).reshape(grid_out.shape)
        np.testing.assert_allclose(storage.assemble(local_out, prog.result, step.out_shape),
                                   storage.assemble(grid_out, prog.result, step.out_shape), rtol=1e-5, atol=1e-6)
        return prog

    rng = np.random.default_rng(0)
    v = rng.standard_normal((6, 8)).astype(np.float32)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    T = lambda a, dims, partial=(): nb.tensor(a).shard(mesh, dims, partial_axes=list(partial))
    assert both(lambda a, b: a @ b, T(v, ["dp", "tp"]), T(w, ["tp", None])).result.partial_axes  # a partial sum
    assert both(lambda a: a.max(1), T(v, ["dp", "tp"])).folded  # grid: folded all_reduce; per device: its move
    assert both(lambda a: nb.tril(a, 1), T(v, ["dp", "tp"])).local.aux  # per-layout constants, cut per device
    assert both(lambda a, b: nb.concatenate([a, b], 1), T(v, [None, "tp"]), T(v, [None, "tp"])).local.aux
    both(lambda a, b: a + b, T(v, [None, "tp"], ["dp"]), v)  # a host value added once to a partial sum
    both(lambda a: a + 1.5, T(v, ["tp", None], ["dp"]))  # a scalar added once
    both(lambda a: a.sum(0), T(v[:5], ["tp", "dp"]))  # uneven: padded blocks
    print("ok")
""")


def test_grid_and_per_device_backends_run_a_kernel_alike():
    _run_on_8_devices(KERNEL)


def test_abstract_values_run_on_the_shapes_backend():
    """An abstract value goes through the same interpreter on ``shapes``: no data, the same moves logged."""
    assert B.holding(None) is B.SHAPES and B.holding(np.ones(2)) is B.NUMPY
    mesh = nb.DeviceMesh("m", (2, 4), ("dp", "tp"))
    logs = []
    for make in (lambda s: nb.abstract(s), lambda s: nb.tensor(np.ones(s, np.float32))):
        with nb.comm_log() as log:
            x = make((8, 16)).shard(mesh, ["dp", "tp"])
            w = make((16, 12)).shard(mesh, ["tp", None])
            out = ((x @ w).max(1) + make((8,))).with_sharding(mesh, [None])
        assert (out._data is None) == (x._data is None)
        logs.append([(e.kind, e.axes, e.bytes) for e in log.events])
    assert logs[0] == logs[1] and logs[0]
