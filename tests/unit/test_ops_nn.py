"""nabla.ops.nn: one_hot, log_softmax, logsumexp, stop_gradient and cross_entropy against jax (values and jax.grad)
on random meshes, specs and float32/float64/bfloat16, every device's block checked; a sharded normalised dim
moves one value per row; Megatron's vocabulary-parallel cross-entropy in bytes; nb.jit's HLO against the log."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings, strategies as st

import nabla as nb
from nabla import DeviceMesh, ShardingError
from nabla.testing import assert_sharded_allclose, examples, meshes, programs, shapes, specs

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy
ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12, BF16: 3e-2}
MESH = DeviceMesh("cluster", (2, 4), ("dp", "tp"))


def placed(draw, mesh, value, partial=True):
    spec = draw(specs(mesh, value.shape, partial=partial))
    return nb.tensor(value).shard(mesh, spec.dim_specs, spec.replicated_axes, spec.partial_axes)


def drawn(draw, min_rank=1, dtypes=tuple(TOL)):
    """A mesh, a value (finite, of a drawn dtype, with a few -inf) and its placement (pending sums included: every
    op here sums them first)."""
    mesh = draw(meshes(max_devices=8))
    shape = draw(shapes(max_rank=3, max_dim=5, min_rank=min_rank))
    dtype = draw(st.sampled_from(dtypes))
    v = np.random.default_rng(draw(st.integers(0, 2 ** 16))).standard_normal(shape) * 3
    if v.size and draw(st.booleans()):
        v.reshape(-1)[draw(st.integers(0, v.size - 1))] = -np.inf
    v = v.astype(dtype)
    return mesh, v, placed(draw, mesh, v)


def close(got, want, dtype):
    want = np.asarray(want)
    assert got.dtype == dtype and want.dtype == dtype, (got.dtype, want.dtype)
    if dtype == BF16:
        got, want = got.astype("float64"), want.astype(np.float64)
    assert_sharded_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])


# ---- values on every sharding, against jax --------------------------------------------------------------------


@settings(max_examples=examples(15))  # each example compiles jax's reference anew (about 0.4 s)
@given(st.data())
def test_log_softmax_and_logsumexp_equal_jax(data):
    draw = data.draw
    mesh, v, t = drawn(draw)
    r = v.ndim
    if draw(st.booleans()):
        axis = draw(st.integers(-r, r - 1))
        close(nb.log_softmax(t, axis), jax.nn.log_softmax(jnp.asarray(v), axis), v.dtype)
    else:
        axis = draw(st.sampled_from([None] + list(range(-r, r)) + ([(0, r - 1)] if r > 1 else [])))
        keep = draw(st.booleans())
        close(nb.logsumexp(t, axis, keepdims=keep), jax.scipy.special.logsumexp(jnp.asarray(v), axis, keepdims=keep),
              v.dtype)


@given(st.data())
def test_one_hot_equals_jax(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    shape = draw(shapes(max_rank=2, max_dim=5))
    n = draw(st.integers(0, 6))
    ids = np.random.default_rng(draw(st.integers(0, 2 ** 16))).integers(-2, n + 2, shape)  # out of range: zeros
    axis = draw(st.integers(-len(shape) - 1, len(shape)))
    dtype = draw(st.sampled_from(["float32", "int32", "bool", "bfloat16"]))
    got = nb.one_hot(placed(draw, mesh, ids, partial=False), n, dtype=dtype, axis=axis)
    want = np.asarray(jax.nn.one_hot(ids, n, dtype=jnp.dtype(dtype), axis=axis))
    assert got.dtype == want.dtype
    assert_sharded_allclose(got.astype("float64") if dtype == "bfloat16" else got,
                            want.astype(np.float64) if dtype == "bfloat16" else want)


@settings(max_examples=examples(15))
@given(st.data())
def test_cross_entropy_equals_optax_formula(data):
    draw = data.draw
    mesh = draw(meshes(max_devices=8))
    shape = draw(shapes(max_rank=2, max_dim=4, min_rank=0))
    V = draw(st.integers(1, 7))
    dtype = draw(st.sampled_from(tuple(TOL)))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    logits = rng.standard_normal(shape + (V,)).astype(dtype) * 2
    targets = rng.integers(-V, V, shape)
    lj = jnp.asarray(logits)
    # optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), written out (optax is not a dependency)
    want = (jax.nn.logsumexp(lj, -1) - jnp.take_along_axis(lj, jnp.asarray(targets % V)[..., None], -1)[..., 0]).mean()
    got = nb.cross_entropy(placed(draw, mesh, logits), placed(draw, mesh, targets, partial=False))
    close(got, want, np.dtype(dtype))


def test_stop_gradient_is_an_identity_step_with_no_gradient():
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    p = nb.tensor(x).shard(MESH, [None, "tp"], partial_axes=["dp"])
    with nb.comm_log() as log:
        y = nb.stop_gradient(p)
    assert log.events == [] and y.sharding.layout() == p.sharding.layout()  # a pending sum stays pending
    assert_sharded_allclose(y, x)
    g = nb.grad(lambda a: (a * nb.stop_gradient(a)).sum())(nb.tensor(x).shard(MESH, ["dp", "tp"]))
    assert_sharded_allclose(g, x)  # d(a * c)/da with c = a held constant
    assert nb.flops(lambda a: nb.stop_gradient(a), p) == 0
    w = np.random.default_rng(1).standard_normal((6, 6)).astype(np.float32)
    with nb.comm_log() as log:  # what is computed from the stopped value alone gets no cotangent
        nb.grad(lambda a: (a * nb.stop_gradient(nb.relu(a @ w))).sum())(nb.tensor(x).shard(MESH, ["dp", None]))
    assert [s.name for s in log.steps if s.phase == "backward" and s.name == "multiply"] == ["multiply"]  # a's


# ---- gradients (float64, against jax.grad), pending sums included -------------------------------------------


@given(st.data())
@settings(max_examples=examples(12))
def test_gradients_equal_jax(data):
    draw = data.draw
    mesh, v, t = drawn(draw, dtypes=(np.dtype(np.float64),))
    v = np.where(np.isinf(v), -5.0, v)  # finite: jax's gradient of an all -inf row is NaN, as nabla's
    t = nb.tensor(v).shard(mesh, t.sharding.dim_specs, t.sharding.replicated_axes, t.sharding.partial_axes)
    r = v.ndim
    axis = draw(st.integers(-r, r - 1))
    targets = np.random.default_rng(1).integers(0, v.shape[-1], v.shape[:-1]) if v.shape[-1] else None
    fns = {"log_softmax": (lambda a: nb.log_softmax(a, axis), lambda a: jax.nn.log_softmax(a, axis)),
           "logsumexp": (lambda a: nb.logsumexp(a, axis), lambda a: jax.nn.logsumexp(a, axis)),
           "stop_gradient": (lambda a: a * nb.stop_gradient(a * a), lambda a: a * jax.lax.stop_gradient(a * a))}
    if targets is not None and v.size:
        fns["cross_entropy"] = (lambda a: nb.cross_entropy(a, targets), lambda a: (
            jax.nn.logsumexp(a, -1) - jnp.take_along_axis(a, targets[..., None], -1)[..., 0]).mean())
    f, jf = fns[draw(st.sampled_from(sorted(fns)))]
    w = np.random.default_rng(2).standard_normal(np.shape(jf(v)))
    want = np.asarray(jax.grad(lambda a: (jf(a) * w).sum())(v))
    g = nb.grad(lambda a: (f(a) * w).sum())(t)
    assert [d.axes for d in g.sharding.dim_specs] == [d.axes for d in t.sharding.dim_specs]
    assert g.sharding.partial_axes == ()
    assert_sharded_allclose(g, want, rtol=1e-10, atol=1e-10)


def test_bfloat16_cross_entropy_gradient_equals_jax_at_bf16_precision():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((4, 3, 10)).astype(BF16)
    targets = rng.integers(0, 10, (4, 3))

    def jce(a):
        return (jax.nn.logsumexp(a, -1) - jnp.take_along_axis(a, targets[..., None], -1)[..., 0]).mean()

    want = np.asarray(jax.grad(jce)(jnp.asarray(logits))).astype(np.float64)
    t = nb.tensor(logits).shard(MESH, ["dp", None, "tp"])
    g = nb.grad(lambda a: nb.cross_entropy(a, nb.tensor(targets).shard(MESH, ["dp", None])))(t)
    assert g.dtype == BF16 and [d.axes for d in g.sharding.dim_specs] == [("dp",), (), ("tp",)]
    np.testing.assert_allclose(g.numpy().astype(np.float64), want, rtol=3e-2, atol=3e-3)


# ---- what moves: one value per row ----------------------------------------------------------------------------


B, S, V = 8, 4, 64
R = np.random.default_rng(0)
LOGITS = R.standard_normal((B, S, V)).astype(np.float32)
TARGETS = R.integers(0, V, (B, S))
ROW = B // 2 * S * 4  # a (B/dp, S) float32 block: one value per row


def ar(block, k):
    return 2 * (k - 1) * block // k  # all_reduce's ring bytes


def sharded():
    return nb.tensor(LOGITS).shard(MESH, ["dp", None, "tp"]), nb.tensor(TARGETS).shard(MESH, ["dp", None])


def test_vocabulary_parallel_cross_entropy_moves_only_row_sums():
    """Logits (B, S, V) on [dp, -, tp], targets on [dp, -] (Megatron's vocabulary-parallel cross-entropy): the row
    max and the row sum of exponentials are all_reduced over tp, each a (B/dp, S) block (96 B); each device picks
    the target logits its vocabulary rows hold and their sum rides on the mean's: the loss is one scalar pending
    over (dp, tp), summed when read (7 B). XLA compiles the same program (jax.jit, the same NamedShardings on 8 CPU
    devices) to 292 B: an all_reduce of the max, one of the sum and the picked logits together, and one of the
    mean (tests/integration/test_xla_parity.py compares them)."""
    logits, targets = sharded()
    with nb.comm_log() as log:
        loss = nb.cross_entropy(logits, targets)
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("all_reduce", ("tp",), ar(ROW, 4))] * 2
    assert ar(ROW, 4) == 96
    assert loss.shape == () and set(loss.sharding.partial_axes) == {"dp", "tp"}
    with nb.comm_log() as log:
        value = loss.with_sharding(MESH, [])
    assert [(e.kind, e.bytes) for e in log.events] == [("all_reduce", ar(4, 8))]
    want = (jax.nn.logsumexp(LOGITS, -1) - np.take_along_axis(LOGITS, TARGETS[..., None], -1)[..., 0]).mean()
    assert_sharded_allclose(value, np.float32(want), rtol=1e-5)


def test_its_gradient_stays_sharded_on_the_vocabulary_and_moves_nothing_more():
    """(softmax - one_hot) / N, laid out [dp, -, tp]: the backward pass sends nothing; the forward's two row sums
    are all that moves. No device ever holds a whole vocabulary row: every step's blocks are at most V/tp wide."""
    logits, targets = sharded()
    with nb.comm_log() as log:
        g = nb.grad(lambda a: nb.cross_entropy(a, targets))(logits)
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("all_reduce", ("tp",), ar(ROW, 4))] * 2
    layouts = [(s.out_shape, s.out_spec) for s in log.steps] + [(u.shape, u.dst) for s in log.steps for u in s.uses]
    assert all(spec.dim_specs[-1].axes == ("tp",) for shape, spec in layouts if tuple(shape)[-1:] == (V,))
    soft = np.asarray(jax.nn.softmax(LOGITS, -1))
    want = (soft - np.eye(V, dtype=np.float32)[TARGETS]) / (B * S)
    assert [d.axes for d in g.sharding.dim_specs] == [("dp",), (), ("tp",)]
    assert_sharded_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_log_softmax_and_logsumexp_on_a_sharded_dim_reduce_per_row():
    logits, _ = sharded()
    for fn in (lambda a: nb.log_softmax(a, -1), lambda a: nb.logsumexp(a, -1)):
        with nb.comm_log() as log:
            fn(logits)
        assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("all_reduce", ("tp",), ar(ROW, 4))] * 2
        with nb.comm_log() as log:  # the gradient: one more row sum for log_softmax, nothing for logsumexp
            nb.grad(lambda a: (fn(a) ** 2).sum())(logits)
        assert all(e.bytes <= ar(ROW, 4) for e in log.events), log.events


# ---- refusals, the registry's readers ---------------------------------------------------------------------------


def test_refusals_name_the_problem():
    logits, targets = sharded()
    with pytest.raises(ShardingError, match=r"targets of shape \(8,\) for logits of shape \(8, 4, 64\)"):
        nb.cross_entropy(logits, TARGETS[:, 0])
    bad = TARGETS.copy()
    bad[3, 1] = V
    with pytest.raises(IndexError, match=f"index {V} is out of bounds for axis 2 with size {V}"):
        nb.cross_entropy(logits, bad)
    with pytest.raises(ShardingError, match="num_classes must be an int"):
        nb.one_hot(TARGETS, -1)
    with pytest.raises(ShardingError, match="axis 5 is out of range"):
        nb.one_hot(TARGETS, 3, axis=5)
    with pytest.raises(ShardingError, match="axis 3 is out of range"):
        nb.log_softmax(logits, 3)


def test_random_programs_draw_log_softmax_and_stop_gradient():
    strategy = programs(max_ops=2)
    for name in ("log_softmax", "stop_gradient"):
        prog = find(strategy, lambda p, name=name: any(d == name for d, _ in p.steps),
                    settings=settings(derandomize=True, database=None, max_examples=10000,
                                      suppress_health_check=list(HealthCheck)))
        got = prog.run(nb)
        with np.errstate(all="ignore"):
            want = prog.run(np)
        assert_sharded_allclose(got, np.asarray(want, dtype=got.dtype), rtol=1e-4, atol=1e-4)


def test_jit_of_the_loss_and_its_gradient_has_the_logs_collectives():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 jax devices (set in tests/conftest.py)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from jit_check import assert_hlo_is_the_log

    logits, targets = sharded()
    small = nb.tensor(LOGITS[:, :, :13]).shard(MESH, ["dp", None, "tp"])  # 13 over 4: uneven vocabulary blocks
    t13 = nb.tensor(TARGETS % 13).shard(MESH, ["dp", None])
    for f, args in [(lambda a, t: nb.cross_entropy(a, t), (logits, targets)),
                    (lambda a, t: nb.grad(lambda x: nb.cross_entropy(x, t))(a), (small, t13)),
                    (lambda a, t: nb.log_softmax(a, -1) + nb.one_hot(t, 13), (small, t13)),
                    (lambda a, t: nb.logsumexp(a, (1, 2)), (small, t13))]:
        lowered = nb.jit(f).lower(*args)
        assert_hlo_is_the_log(lowered)
        assert_sharded_allclose(nb.jit(f)(*args), f(*args).numpy(), rtol=1e-5, atol=1e-6)
