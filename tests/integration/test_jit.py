"""nb.jit against eager nabla: a corpus of programs (MLP, FSDP, attention, layer norm, vocab-parallel
softmax and cross-entropy, reshards of every kind, slices and concatenation, convolution, a training step)
on 8 forced CPU devices, with sub-axes, custom device orders, partial values and uneven dims. Each gives
the same values under numpy eager, jax eager and nb.jit, and the compiled HLO (read with the XLA harness)
holds exactly the collectives of nabla's comm log, bytes included."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

jax = pytest.importorskip("jax")

import nabla as nb  # noqa: E402
from nabla import DeviceMesh, ShardingError, optim  # noqa: E402
from nabla.testing import assert_sharded_allclose, examples, programs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jit_check import assert_hlo_is_the_log  # noqa: E402

if len(jax.devices()) < 8:
    pytest.skip("needs 8 jax devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set in conftest)",
                allow_module_level=True)

M = DeviceMesh("m", (2, 4), ("dp", "tp"))
M4 = DeviceMesh("f", (4,), ("dp",))
M8 = DeviceMesh("m8", (8,), ("x",))
MR = DeviceMesh("mr", (2, 4), ("dp", "tp"), devices=[7, 6, 5, 4, 3, 2, 1, 0])


def T(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _xent(logits, onehot):
    m = nb.max(logits, -1, keepdims=True)
    lse = nb.log(nb.exp(logits - m).sum(-1)) + m.reshape(8)
    return (lse - (logits * onehot).sum(-1)).mean()


def _attention(q, k, v):
    s = nb.softmax(nb.einsum("bhqd,bhkd->bhqk", q, k) * 0.35, -1)
    return nb.einsum("bhqk,bhkd->bhqd", s, v)


CORPUS = {
    "mlp": (lambda x, w1, w2: (nb.relu(x @ w1) @ w2).with_sharding(M, ["dp", None]),
            [(T(8, 16), M, ["dp", None]), (T(16, 32, seed=1), M, [None, "tp"]), (T(32, 4, seed=2), M, ["tp", None])]),
    "fsdp": (lambda x, w: x @ w, [(T(16, 16), M4, ["dp", None]), (T(16, 32, seed=1), M4, ["dp", None])]),
    "attention": (_attention, [(T(2, 4, 6, 8, seed=s), M, ["dp", "tp", None, None]) for s in range(3)]),
    "layer_norm": (lambda h: nb.layer_norm(h), [(T(8, 16), M, ["dp", "tp"])]),
    "softmax_vocab": (lambda z: nb.softmax(z, -1), [(T(8, 32), M, ["dp", "tp"])]),
    "cross_entropy": (_xent, [(T(8, 32), M, [None, "tp"]),
                              (np.eye(32, dtype=np.float32)[np.arange(8) * 3 % 32], M, [None, "tp"])]),
    "argmax_vocab": (lambda z: nb.argmax(z, -1), [(T(8, 32), M, ["dp", "tp"])]),
    "exchange": (lambda x: x.with_sharding(M, ["tp", "dp"]), [(T(16, 16), M, ["dp", "tp"])]),
    "exchange_merge": (lambda x: x.with_sharding(M, [None, ("dp", "tp")]), [(T(16, 16), M, ["dp", "tp"])]),
    "all_to_all": (lambda x: x.with_sharding(M, [None, "tp"]), [(T(16, 16), M, ["tp", None])]),
    "reduce_scatter": (lambda x: x.with_sharding(M, ["tp", None]), [(T(16, 16), M, "partial_tp")]),
    "partial_out": (lambda a, b: a @ b, [(T(8, 16), M, [None, "tp"]), (T(16, 4, seed=1), M, ["tp", None])]),
    "sub_axes": (lambda x: (x * 2).with_sharding(M8, ["x:(2)4", "x:(1)2"]), [(T(8, 8), M8, ["x:(1)2", "x:(2)4"])]),
    "slice": (lambda x: x[3:11] * 2, [(T(16, 16), M, ["tp", None])]),
    "concatenate": (lambda a, b: nb.concatenate([a, b], 0),
                    [(T(8, 16), M, ["dp", None]), (T(8, 16, seed=1), M, ["dp", None])]),
    "reverse": (lambda x: x[::-1] + 1, [(T(16, 4), M, ["tp", None])]),
    "uneven": (lambda x: nb.exp(x).sum(0), [(T(5, 7), M, ["tp", "dp"])]),
    "conv_spatial": (lambda x, w: nb.conv(x, w, padding=1),
                     [(T(2, 3, 16, 8), M, ["dp", None, "tp", None]), (T(4, 3, 3, 3, seed=1), M, [None] * 4)]),
    "max_pool": (lambda x: nb.max_pool(x, 3, 2, 1), [(T(2, 3, 13, 8), M, ["dp", None, "tp", None])]),
    "device_order": (lambda x, w: (x @ w).with_sharding(MR, ["dp", None]),
                     [(T(8, 16), MR, ["dp", "tp"]), (T(16, 4), MR, ["tp", None])]),
    "host_operand": (lambda x: x * T(8, 16, seed=9) + 1.0, [(T(8, 16), M, ["dp", "tp"])]),
}


def _inputs(name):
    out = []
    for value, mesh, spec in CORPUS[name][1]:
        if spec == "partial_tp":
            out.append(nb.tensor(value).shard(mesh, [None] * value.ndim, partial_axes=["tp"]))
        else:
            out.append(nb.tensor(value).shard(mesh, spec))
    return out


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_jit_equals_eager_and_its_hlo_moves_what_the_log_says(name):
    fn = CORPUS[name][0]
    args = _inputs(name)
    with nb.comm_log() as eager_log:
        want = fn(*args)
    jitted = nb.jit(fn)
    lowered = jitted.lower(*args)
    got = jitted(*args)
    assert got.shape == want.shape and got.dtype == want.dtype and got.sharding == want.sharding
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5, atol=2e-5)
    for d in want.sharding.mesh.devices:  # every device's block, padding trimmed
        if want.sharding.partial_axes:
            break
        np.testing.assert_allclose(np.asarray(got.shards[d]), want.shards[d], rtol=2e-5, atol=2e-5)
    logged = sorted((e.kind, e.axes, e.bytes) for e in lowered.comm_log.events)
    assert logged == sorted((e.kind, e.axes, e.bytes) for e in eager_log.events)  # tracing plans what eager runs
    assert_hlo_is_the_log(lowered)


@pytest.mark.parametrize("name", ["mlp", "exchange", "sub_axes", "conv_spatial", "device_order", "uneven",
                                  "partial_out", "cross_entropy"])
def test_jax_eager_backend_gives_the_same_values_and_collectives(name):
    fn = CORPUS[name][0]
    with nb.comm_log() as log:
        want = fn(*_inputs(name))
    with nb.backend("jax"), nb.comm_log() as jlog:
        got = fn(*_inputs(name))
    assert [(e.kind, e.bytes) for e in jlog.events] == [(e.kind, e.bytes) for e in log.events]
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5, atol=2e-5)


def test_a_training_step_compiles_to_one_program():
    """Forward, backward and an Adam update under nb.jit: one XLA program whose collectives are the comm
    log's (forward: one tp all_reduce; backward: one dp all_reduce per parameter), values equal eager."""
    params = {"w1": nb.random.normal((16, 32)).shard(M, [None, "tp"]),
              "w2": nb.random.normal((32, 4), seed=1).shard(M, ["tp", None])}
    x = nb.random.normal((8, 16), seed=2).shard(M, ["dp", None])
    y = nb.random.normal((8, 4), seed=3).shard(M, ["dp", None])
    opt = optim.Adam(1e-2)

    def loss(p, x, y):
        return ((nb.relu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    def step(params, state, x, y):
        value, grads = nb.value_and_grad(loss)(params, x, y)
        params, state = opt.update(grads, state, params)
        return value, params, state

    state = opt.init(params)
    jstep = nb.jit(step)
    lowered = jstep.lower(params, state, x, y)
    assert [(e.phase, e.kind, e.axes) for e in lowered.comm_log.events] == [
        ("forward", "all_reduce", ("tp",)), ("backward", "all_reduce", ("dp",)), ("backward", "all_reduce", ("dp",))]
    assert_hlo_is_the_log(lowered)
    p_eager, s_eager, p_jit, s_jit = params, state, params, state
    for _ in range(3):
        v_eager, p_eager, s_eager = step(p_eager, s_eager, x, y)
        v_jit, p_jit, s_jit = jstep(p_jit, s_jit, x, y)
        np.testing.assert_allclose(float(v_jit), float(v_eager), rtol=1e-5)
    assert len(jstep._cache) == 1  # one trace for every step: the state's count is a tensor, not a constant
    for k in params:
        assert p_jit[k].sharding == p_eager[k].sharding
        np.testing.assert_allclose(p_jit[k].numpy(), p_eager[k].numpy(), rtol=1e-5, atol=1e-6)


def test_lowering_plans_on_abstract_inputs_and_refuses_to_run_them():
    x = nb.abstract((16, 16)).shard(M, ["dp", "tp"])
    lowered = nb.jit(lambda x: x.with_sharding(M, ["tp", "dp"])).lower(x)
    assert lowered.comm_log.total_bytes == 128
    with pytest.raises(ShardingError, match="abstract"):
        lowered(x)


def test_a_retrace_happens_per_signature():
    f = nb.jit(lambda x: x * 2)
    a = nb.tensor(T(8, 8)).shard(M, ["dp", None])
    f(a)
    f(nb.tensor(T(8, 8, seed=1)).shard(M, ["dp", None]))
    assert len(f._cache) == 1
    f(nb.tensor(T(8, 8)).shard(M, [None, "tp"]))
    assert len(f._cache) == 2


def test_jit_never_writes_the_global_x64_flag_and_keeps_no_argument_alive(monkeypatch):
    """float64 stays float64 through nb.jit (jax's thread-local x64 switch), the global jax_enable_x64 is
    never written, and neither the cache nor the lowered program keeps the last arguments alive."""
    import gc
    import weakref

    writes = []
    real = jax.config.update
    monkeypatch.setattr(jax.config, "update", lambda name, value: (writes.append(name), real(name, value))[1])
    before = jax.config.jax_enable_x64
    f = nb.jit(lambda x: nb.exp(x) * 2)
    v = T(8, 8, dtype=np.float64)
    x = nb.tensor(v).shard(M, ["dp", None])
    got = f(x)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got.numpy(), np.exp(v) * 2, rtol=1e-12)
    assert "HloModule" in f.lower(x).as_text()
    assert "jax_enable_x64" not in writes and jax.config.jax_enable_x64 == before
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None


def test_the_hlo_check_compares_each_collective_s_devices_with_its_event_s_axes():
    """Two all_reduces of equal bytes over different axes of a 2 x 2 mesh: an event naming the wrong axis keeps
    every (kind, bytes) but no longer matches the HLO's replica groups."""
    m = DeviceMesh("sq", (2, 2), ("a", "b"))
    x = nb.tensor(T(4, 8)).shard(m, [None, "a"])
    y = nb.tensor(T(8, 4, seed=1)).shard(m, ["a", None])
    z = nb.tensor(T(4, 8, seed=2)).shard(m, [None, "b"])
    w = nb.tensor(T(8, 4, seed=3)).shard(m, ["b", None])
    lowered = nb.jit(lambda x, y, z, w: nb.relu(x @ y) * 2 + nb.exp(z @ w)).lower(x, y, z, w)
    assert sorted(e.axes for e in lowered.comm_log.events) == [("a",), ("b",)]
    assert_hlo_is_the_log(lowered)
    lowered.comm_log.events = [e._replace(axes=("a",)) for e in lowered.comm_log.events]
    with pytest.raises(AssertionError, match="no collective of the HLO matches"):
        assert_hlo_is_the_log(lowered)


REPEATED_MOVES = {
    # the same value moved to the same layout twice: eager moves at each use (as eager JAX does); the
    # compiled program moves once (XLA would merge the two anyway) and its comm log says so
    "explicit": (lambda a: a.with_sharding(M, [None, None]) + a.with_sharding(M, [None, None]) * 2,
                 [(T(8, 8), ["dp", "tp"])], {"all_gather": 4}, {"all_gather": 2},
                 lambda a: a * 3),
    "two_ops_one_weight": (lambda x, w: nb.relu(x @ w) + nb.tanh(x @ w),
                           [(T(8, 16), ["tp", "dp"]), (T(16, 8, seed=1), [None, "tp"])],
                           {"all_gather": 2, "all_reduce": 2}, {"all_gather": 1, "all_reduce": 1},
                           lambda x, w: np.maximum(x @ w, 0) + np.tanh(x @ w)),
    "softmax_after_reshard": (lambda a: nb.softmax(a.with_sharding(M, ["tp", None]), -1)
                              + a.with_sharding(M, ["tp", None]),
                              [(T(8, 8), ["dp", "tp"])], {"collective_permute": 8}, {"collective_permute": 4},
                              lambda a: np.exp(a) / np.exp(a).sum(-1, keepdims=True) + a),
}


@pytest.mark.parametrize("name", sorted(REPEATED_MOVES))
def test_a_value_moved_twice_to_one_layout_is_moved_once_and_the_log_says_so(name):
    fn, inputs, eager_counts, jit_counts, ref = REPEATED_MOVES[name]
    args = [nb.tensor(v).shard(M, spec) for v, spec in inputs]
    with nb.comm_log() as eager:
        want = fn(*args)
    lowered = nb.jit(fn).lower(*args)
    assert eager.counts == eager_counts and lowered.comm_log.counts == jit_counts
    assert_hlo_is_the_log(lowered)
    got = nb.jit(fn)(*args)
    assert got.sharding == want.sharding
    np.testing.assert_allclose(got.numpy(), ref(*[v for v, _ in inputs]), rtol=1e-5, atol=1e-5)


ZERO_SIZE = {
    "empty_slice_sum": (lambda x: x[2:2].sum(0), [(T(8, 8), M, ["dp", "tp"])],
                        lambda x: x[2:2].sum(0)),
    "empty_reshard": (lambda z: z.with_sharding(M, ["tp", None]), [(T(0, 8), M, ["dp", "tp"])], lambda z: z),
    "empty_gather": (lambda z: z.with_sharding(M, [None, None]) + 1, [(T(0, 8), M, ["dp", "tp"])], lambda z: z + 1),
    "empty_contraction": (lambda p: p.reshape(0) @ np.ones((0, 4), np.float32),
                          [(T(0, 6, 6), DeviceMesh("yz", (2, 3), ("y", "z")), "partial_yz")],
                          lambda p: np.zeros(4, np.float32)),
    "data_free_softmax": (lambda p: nb.softmax((p @ np.ones((0, 3), np.float32)) * -1.5, 2),
                          [(T(2, 2, 0), DeviceMesh("yz", (2, 3), ("y", "z")), "partial_yz")],
                          lambda p: np.full((2, 2, 3), 1 / 3, np.float32)),
    "read_only_through_an_empty_slice": (lambda x: nb.softmax(x, 0)[3:3] @ np.ones((0, 4), np.float32),
                                         [(T(3), M, ["dp"])], lambda x: np.zeros(4, np.float32)),
}


@pytest.mark.parametrize("name", sorted(ZERO_SIZE))
def test_tensors_without_elements_compile_and_move_nothing(name):
    fn, inputs, ref = ZERO_SIZE[name]
    args = []
    for v, mesh, spec in inputs:
        if spec == "partial_yz":
            args.append(nb.tensor(v).shard(mesh, [None] * v.ndim, partial_axes=["y", "z"]))
        else:
            args.append(nb.tensor(v).shard(mesh, spec))
    want = fn(*args)
    lowered = nb.jit(fn).lower(*args)
    got = nb.jit(fn)(*args)
    assert got.shape == want.shape and got.sharding == want.sharding
    np.testing.assert_allclose(got.numpy(), ref(*[v for v, _, _ in inputs]), rtol=1e-6, atol=1e-6)
    assert all(e.bytes > 0 for e in lowered.comm_log.events)
    assert_hlo_is_the_log(lowered)


def test_folding_runs_the_recorded_steps_and_plans_nothing(monkeypatch):
    """Values made only from values with no elements are folded by running their recorded steps again on the grid
    (``interpret``: each move by the plan it ran, each kernel by its program). With the planner's and propagation's
    entry points raising while folding, the constants are numpy's: an empty slice's partial sum all-reduced, a host
    op's result placed, kernels of them (a max's all_reduce after the kernel)."""
    from nabla import executor, interpret, program, propagation, reshard
    from nabla.jit import program as P
    from nabla.reshard import search

    v = T(8, 8)
    x = nb.tensor(v).shard(M, ["dp", "tp"])
    e = np.ones((0, 8), np.float32)

    def fn(x):
        z = x[3:3].sum(0)  # no rows: zeros, partial over dp
        w = nb.exp(z.with_sharding(M, ["tp"])) * 3.0
        c = nb.exp(nb.tensor(e).sum(0).shard(M, ["tp"])) + w  # 4 everywhere
        return x * c.sum() + c.max()

    folded, ran = P._fold, []

    def no_planning(*a, **k):
        raise AssertionError("nb.jit planned while folding")

    def fold(*a, **k):
        with monkeypatch.context() as mp:
            for mod, name in ((reshard, "plan"), (reshard, "_plan"), (search, "plan"), (search, "_plan"),
                              (search, "_route"), (program, "program_for"), (program, "propagate"),
                              (propagation, "propagate"), (executor, "program_for"), (executor, "run"),
                              (executor, "relayout"), (executor, "place")):
                mp.setattr(mod, name, no_planning)
            mp.setattr(interpret, "run", lambda ins, b, be, run=interpret.run: (ran.append(ins.kind),
                                                                                run(ins, b, be))[1])
            return folded(*a, **k)

    monkeypatch.setattr(P, "_fold", fold)
    f = nb.jit(fn)
    lowered = f.lower(x)
    assert {"move", "alias", "host", "place", "kernel"} <= set(ran)
    assert [r.event.kind for r in lowered.comm_log.removed if r.reason == "folded"].count("all_reduce") == 2
    assert lowered.comm_log.events == []
    np.testing.assert_array_equal(f(x).numpy(), v * np.float32(32) + np.float32(4))
    assert_hlo_is_the_log(lowered)


def test_gradient_buckets_run_the_registry_entry_eagerly_and_compiled_one_dtype_each(monkeypatch):
    """Eager dispatch and nb.jit sum a gradient bucket through one backend job, the registry's ``"bucket"`` entry
    (its grid move, its jax.lax lowering); a bucket holds one dtype (a flat buffer has one, as DDP's), so the
    compiled sums are the eager ones bit for bit (a float16 gradient bucketed with a float32 one was summed in
    float32 under nb.jit)."""
    import dataclasses

    from nabla import collectives as C

    entry, ran = C.REGISTRY["bucket"], []
    monkeypatch.setitem(C.REGISTRY, "bucket", dataclasses.replace(
        entry, move=lambda *a: (ran.append("move"), entry.move(*a))[1],
        lower=lambda *a: (ran.append("lower"), entry.lower(*a))[1]))
    ps = {"a": nb.tensor(T(16).astype(np.float16)).shard(M4, [None]), "b": nb.tensor(T(16, seed=1)).shard(M4, [None])}
    v = T(8, 16, seed=2) + np.float32(1 / 3)
    x, x16 = nb.tensor(v).shard(M4, ["dp", None]), nb.tensor(v.astype(np.float16)).shard(M4, ["dp", None])
    g = nb.grad(lambda p, x, x16: (x * p["b"]).sum() + (x16 * p["a"]).sum().astype(np.float32), bucket_bytes=1 << 20)
    with nb.comm_log() as log:
        want = g(ps, x, x16)
    assert ran == ["move", "move"]
    assert [e.op for e in log.events if "bucket" in e.op] == ["grad of p['b'] (one bucket)",
                                                               "grad of p['a'] (one bucket)"]
    got = nb.jit(g)(ps, x, x16)
    assert ran[2:] == ["lower", "lower"]
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(got[k].numpy(), want[k].numpy())
    np.testing.assert_allclose(got["b"].numpy(), v.sum(0), rtol=1e-5)


def _jit_program(prog):
    def fn(a, b):
        x = a
        for _, step in prog.steps:
            x = step(nb, x, [a, b])
        return x
    return fn


@settings(max_examples=examples(25), derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(max_ops=5))
def test_random_programs_under_jit_equal_numpy_with_eager_specs_and_hlo_equal_to_the_log(prog):
    """Random op chains (random meshes, device orders, specs, partial and uneven values, reshards) under
    nb.jit: numpy's values, eager nabla's specs, and an HLO holding exactly the lowered comm log."""
    fn = _jit_program(prog)
    args = [t for t, _ in prog.inputs]
    want = fn(*args)
    with np.errstate(all="ignore"):
        ref = prog.run(np)
    lowered = nb.jit(fn).lower(*args)
    got = nb.jit(fn)(*args)
    assert got.sharding == want.sharding and got.shape == want.shape and got.dtype == want.dtype
    assert_sharded_allclose(got, np.asarray(ref, dtype=got.dtype), rtol=1e-4, atol=1e-4)
    assert_hlo_is_the_log(lowered)


def test_a_permute_over_a_size_1_axis_moves_nothing():
    m = DeviceMesh("one", (1, 4), ("y", "z"))
    t = nb.tensor(T(4, 3)).shard(m, ["y", None])
    lowered = nb.jit(lambda t: t[::-1]).lower(t)
    np.testing.assert_array_equal(nb.jit(lambda t: t[::-1])(t).numpy(), T(4, 3)[::-1])
    assert_hlo_is_the_log(lowered)


def test_keyword_arguments_numpy_arrays_and_host_only_functions_as_jax_jit_takes_them():
    v = T(8, 16)
    x = nb.tensor(v).shard(M, ["dp", "tp"])
    f = nb.jit(lambda x, c=1.0, *, bias=None: x * c + (0.0 if bias is None else bias))
    np.testing.assert_allclose(f(x, c=2.0).numpy(), v * 2, rtol=1e-6)
    np.testing.assert_allclose(f(x, 2.0).numpy(), v * 2, rtol=1e-6)
    b = T(8, 16, seed=1)
    np.testing.assert_allclose(f(x, bias=b, c=3.0).numpy(), v * 3 + b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f(x, c=3.0, bias=b + 1).numpy(), v * 3 + b + 1, rtol=1e-5, atol=1e-6)  # an input, not a constant
    assert len(f._cache) == 3  # c=2.0 (by keyword or position: one call), c=3.0 with an array bias
    assert f.lower(x, bias=b, c=3.0).comm_log.events == []
    # numpy arrays are inputs, as jax.jit traces them; a function of host values only runs on one device
    g = nb.jit(lambda a, b: nb.tanh(a @ b))
    a, w = T(4, 6), T(6, 3, seed=2)
    got = g(a, w)
    assert got.sharding is None
    np.testing.assert_allclose(got.numpy(), np.asarray(jax.jit(lambda a, b: jax.numpy.tanh(a @ b))(a, w)), rtol=1e-5)
    g(T(4, 6, seed=3), w)
    assert len(g._cache) == 1
    assert "all-reduce" not in g.lower(a, w).as_text()
    with pytest.raises(ShardingError, match="uses 2 meshes"):
        nb.jit(lambda p, q: (p.sum(), q.sum()))(x, nb.tensor(v).shard(M4, ["dp", None]))
    with pytest.raises(ShardingError, match="neither a tensor"):
        nb.jit(lambda x, d: x)(x, [{1, 2}])


def test_in_and_out_shardings_take_named_shardings_partition_specs_and_sharding_specs_like_jax_jit():
    from jax.sharding import NamedSharding as JNS, PartitionSpec as P

    x, w, b = T(8, 16), T(16, 8, seed=1), T(8, seed=2)
    X = nb.tensor(x).shard(M, ["dp", "tp"])
    W = nb.tensor(w).shard(M, [None, None])

    def f(x, w, b):
        return nb.relu(x @ w + b)

    jf = nb.jit(f, in_shardings=(nb.NamedSharding(M, P("dp", None)), P(None, "tp"),
                                 nb.ShardingSpec(M, ["tp"])),
                out_shardings=P(None, "tp"))
    lowered = jf.lower(X, W, b)  # b: a numpy array, placed as in_shardings says (no communication)
    got = jf(X, W, b)
    # jax.jit with the same shardings
    jm = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    jref = jax.jit(lambda x, w, b: jax.nn.relu(x @ w + b),
                   in_shardings=(JNS(jm, P("dp", None)), JNS(jm, P(None, "tp")), JNS(jm, P("tp"))),
                   out_shardings=JNS(jm, P(None, "tp")))(x, w, b)
    np.testing.assert_allclose(got.numpy(), np.asarray(jref), rtol=1e-5, atol=1e-5)
    assert got.to_jax().sharding.spec == jref.sharding.spec
    assert [d.axes for d in got.sharding.dim_specs] == [(), ("tp",)] and not got.sharding.partial_axes
    # x's move to [dp, -] (an all_gather over tp) and the result's to [-, tp] are in the program and its log
    assert lowered.comm_log.events[0].kind == "all_gather" and lowered.comm_log.events[0].axes == ("tp",)
    assert lowered.comm_log.events[-1].axes == ("dp",)
    assert_hlo_is_the_log(lowered)
    # one sharding for every argument; None leaves a value as it comes
    g = nb.jit(lambda a, c: a * c, in_shardings=P("dp"), out_shardings=None)
    r = g(X, nb.tensor(x).shard(M, [None, "tp"]))
    assert [d.axes for d in r.sharding.dim_specs][0] == ("dp",)
    np.testing.assert_allclose(r.numpy(), x * x, rtol=1e-6)
    with pytest.raises(ShardingError, match="in_shardings has 1 entries but there are 2 arguments"):
        nb.jit(lambda a, c: a, in_shardings=(P("dp"),))(X, X)
    with pytest.raises(ShardingError, match="no mesh"):
        nb.jit(lambda a: a, in_shardings=P("dp"))(x)


def test_grad_through_a_jitted_function_equals_jax_grad_and_stays_compiled():
    """nb.grad of a function that calls a jitted one: the forward runs compiled and its VJP is a compiled
    nb.vjp of the same function (no zeros, as when results carried no trace record)."""
    import jax.numpy as jnp

    xv, w1, w2 = T(8, 16), T(16, 32, seed=1), T(32, 4, seed=2)
    x = nb.tensor(xv).shard(M, ["dp", None])
    params = {"w1": nb.tensor(w1).shard(M, [None, "tp"]), "w2": nb.tensor(w2).shard(M, ["tp", None])}

    @nb.jit
    def loss(p, x, scale=1.0):
        h = nb.relu(x @ p["w1"]) @ p["w2"]
        return (nb.tanh(h) ** 2).mean() * scale, h

    def jloss(p, x):
        h = jax.nn.relu(x @ p["w1"]) @ p["w2"]
        return (jnp.tanh(h) ** 2).mean() * 2.0

    want = jax.grad(jloss)({"w1": w1, "w2": w2}, xv)
    (value, h), got = nb.value_and_grad(lambda p: loss(p, x, scale=2.0), has_aux=True)(params)
    np.testing.assert_allclose(float(value), float(jloss({"w1": w1, "w2": w2}, xv)), rtol=1e-5)
    for k in params:
        assert got[k].sharding.dim_specs == params[k].sharding.dim_specs
        np.testing.assert_allclose(got[k].numpy(), np.asarray(want[k]), rtol=1e-4, atol=1e-6)
    (lowered,) = loss._cache.values()
    assert len(lowered._backward) == 1  # the VJP is a jitted program too
    # grad of the jitted function with respect to its input, and inside another nb.jit (inlined there)
    gx = nb.grad(lambda x: loss(params, x)[0])(x)
    np.testing.assert_allclose(gx.numpy(), np.asarray(jax.grad(lambda x: jloss({"w1": w1, "w2": w2}, x) / 2)(xv)),
                               rtol=1e-4, atol=1e-6)
    outer = nb.jit(lambda p: nb.grad(lambda p: loss(p, x, scale=2.0)[0])(p))
    for k, g in outer(params).items():
        np.testing.assert_allclose(g.numpy(), np.asarray(want[k]), rtol=1e-4, atol=1e-6)


def test_tools_that_walk_the_trace_see_a_jitted_function_s_ops():
    x = nb.tensor(T(8, 16)).shard(M, ["dp", None])
    w = nb.tensor(T(16, 4, seed=1)).shard(M, [None, "tp"])
    jf = nb.jit(lambda x, w: nb.tanh(x @ w).sum())
    assert "matmul" in nb.explain(jf, x, w)
    onnx_export = pytest.importorskip("nabla.onnx").export
    pytest.importorskip("onnx")
    assert [n.op_type for n in onnx_export(jf, x, w).graph.node][:1] == ["MatMul"]


def test_an_open_comm_log_sees_the_program_s_collectives_at_every_call():
    x = nb.tensor(T(16, 16)).shard(M, ["dp", "tp"])
    jf = nb.jit(lambda x: x.with_sharding(M, [None, None]) * 2)
    for _ in range(2):  # the first call traces and compiles, the second only runs: both log the same
        with nb.comm_log() as log:
            jf(x)
        assert [(e.kind, e.axes, e.bytes) for e in log.events] == \
            [(e.kind, e.axes, e.bytes) for e in jf.lower(x).comm_log.events]


def test_a_call_does_not_transfer_unchanged_inputs_again(monkeypatch):
    """A numpy-backed tensor's blocks go to the devices once (tensors are immutable); the copy lives as long as
    the tensor's blocks, and results fed back in are used where they are."""
    import gc

    J = sys.modules["nabla.jit"]  # the module (nb.jit is the function)
    x = nb.tensor(T(16, 16)).shard(M, ["dp", "tp"])
    w = nb.tensor(T(16, 16, seed=1)).shard(M, [None, "tp"])
    f = nb.jit(lambda x, w: (nb.relu(x @ w), w * 0.5))
    f(x, w)
    puts = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: (puts.append(1), real(*a, **k))[1])
    y, w2 = f(x, w)
    y, w3 = f(x, w2)  # a result fed back: already on its devices
    assert puts == []
    np.testing.assert_allclose(w3.numpy(), w.numpy() * 0.25, rtol=1e-6)
    f(nb.tensor(T(16, 16, seed=2)).shard(M, ["dp", "tp"]), w)  # new blocks: transferred
    assert len(puts) == 1
    n = len(J._DEVICE_COPIES)
    del x
    gc.collect()
    assert len(J._DEVICE_COPIES) < n  # the copy went with the blocks


def test_reading_a_value_inside_jit_says_why_it_cannot():
    m = DeviceMesh("m", (2, 4), ("dp", "tp"))
    x = nb.tensor(np.ones((8, 4), np.float32)).shard(m, ["dp", None])
    for f in (lambda x: x * 2 if float(x.sum()) > 0 else x, lambda x: x.numpy()):
        with pytest.raises(nb.ShardingError, match="inside nb.jit a tensor .* is traced without its values.*"
                                                   "use nb.where"):
            nb.jit(f)(x)
    assert float(nb.jit(lambda x: x.sum())(x).numpy()) == 32.0  # reading the result is fine


def test_static_argnums_and_argnames_are_taken_as_in_jax_jit():
    m = DeviceMesh("m", (2, 4), ("dp", "tp"))
    x = nb.tensor(np.arange(32, dtype=np.float32).reshape(8, 4)).shard(m, ["dp", None])

    def f(x, n, scale=1.0):
        return x.reshape(n, -1) * scale

    g = nb.jit(f, static_argnums=1, static_argnames="scale")
    for n, scale in ((4, 2.0), (2, 3.0)):
        np.testing.assert_array_equal(g(x, n, scale=scale).numpy(), np.arange(32.0).reshape(n, -1) * scale)
    with pytest.raises(nb.ShardingError, match="static argument 1 is a Tensor"):
        nb.jit(f, static_argnums=(1,))(x, x)
    with pytest.raises(nb.ShardingError, match="static argument 'scale' of type list is not hashable"):
        g(x, 4, scale=[1.0])


def test_a_jitted_gradient_step_with_an_unused_parameter_equals_jax_grad():
    """Inside nb.jit's trace the seed cotangent and an unused parameter's zeros are constants of the compiled
    program (outside it, in an abstract run, they stay abstract: no data)."""
    xv, w1, w2 = T(8, 16), T(16, 4, seed=1), T(4, 4, seed=2)
    x = nb.tensor(xv).shard(M, ["dp", None])
    params = {"w1": nb.tensor(w1).shard(M, [None, "tp"]), "unused": nb.tensor(w2).shard(M, ["tp", None])}
    step = nb.jit(nb.value_and_grad(lambda p, x: (nb.tanh(x @ p["w1"]) ** 2).sum()))
    value, got = step(params, x)
    want = jax.grad(lambda p: (jax.numpy.tanh(xv @ p["w1"]) ** 2).sum())({"w1": w1, "unused": w2})
    np.testing.assert_allclose(float(value), float((np.tanh(xv @ w1) ** 2).sum()), rtol=1e-5)
    for k in params:
        assert got[k].sharding.dim_specs == params[k].sharding.dim_specs
        np.testing.assert_allclose(got[k].numpy(), np.asarray(want[k]), rtol=1e-4, atol=1e-6)


def test_a_comm_log_around_a_compiled_call_reads_as_the_eager_one():
    """Each move of a compiled call keeps the phase and op it ran for in the traced program (they all read
    "forward ... jit_call" before): the same (phase, kind, axes, bytes, op) as eager's, event for event, and the
    same summary."""
    mesh = nb.DeviceMesh("m", (2, 4), ("dp", "tp"))
    rng = np.random.default_rng(0)
    x = nb.tensor(rng.standard_normal((32, 16)).astype(np.float32)).shard(mesh, ["dp", None])
    p = {"w1": nb.tensor(rng.standard_normal((16, 64)).astype(np.float32)).shard(mesh, [None, "tp"]),
         "w2": nb.tensor(rng.standard_normal((64, 4)).astype(np.float32)).shard(mesh, ["tp", None])}
    f = nb.value_and_grad(lambda p, x: ((nb.relu(x @ p["w1"]) @ p["w2"]) ** 2).mean())
    with nb.comm_log() as eager:
        f(p, x)
    jf = nb.jit(f)
    jf(p, x)
    with nb.comm_log() as compiled:
        jf(p, x)
    fields = lambda log: [(e.phase, e.kind, e.axes, e.bytes, e.op) for e in log.events]  # noqa: E731
    assert fields(compiled) == fields(eager) and {e.phase for e in eager.events} == {"forward", "backward"}
    assert compiled.summary() == eager.summary()


def test_jit_of_a_gradient_of_a_jitted_function_is_the_gradient():
    """nb.grad carries f's name and signature, not its attributes: jit(grad(jit(loss))) was loss itself (the inner
    jit's fn and cache copied onto the outer one). Reference: jax.grad."""
    jax = pytest.importorskip("jax")
    w0 = (np.arange(9.0).reshape(3, 3) / 10).astype(np.float32)
    x0 = np.ones((2, 3), np.float32)

    def loss(w, x):
        return ((x @ w) ** 2).sum()

    want = jax.grad(lambda w: ((x0 @ w) ** 2).sum())(w0)
    got = nb.jit(nb.grad(nb.jit(loss)))(nb.tensor(w0), nb.tensor(x0))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    value, g = nb.jit(nb.value_and_grad(nb.jit(loss)))(nb.tensor(w0), nb.tensor(x0))
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-6)
    assert float(value.numpy()) == pytest.approx(float(((x0 @ w0) ** 2).sum()), rel=1e-6)
    outer = nb.jit(nb.jit(loss), static_argnums=(1,))
    assert outer.static_argnums == (1,) and outer.fn is not loss
