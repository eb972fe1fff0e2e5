"""numpy semantics of the op surface on host tensors, and the errors bad calls raise."""

import re

import numpy as np
import pytest

import nabla as nb
from nabla import ShardingError
from nabla.testing import assert_sharded_allclose

X = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7.0


@pytest.mark.parametrize("fn, ref", [
    (lambda t: t.sum(axis=(0, 2)), lambda x: x.sum(axis=(0, 2))),
    (lambda t: t.mean(axis=-1, keepdims=True), lambda x: x.mean(axis=-1, keepdims=True)),
    (lambda t: t.max(), lambda x: x.max()),
    (lambda t: t.min(axis=1), lambda x: x.min(axis=1)),
    (lambda t: t.argmax(axis=2), lambda x: x.argmax(axis=2)),
    (lambda t: t.transpose(2, 0, 1), lambda x: x.transpose(2, 0, 1)),
    (lambda t: t.transpose(), lambda x: x.transpose()),
    (lambda t: t.reshape(4, -1), lambda x: x.reshape(4, -1)),
    (lambda t: t.reshape((6, 4)), lambda x: x.reshape((6, 4))),
    (lambda t: nb.swapaxes(t, 0, 2), lambda x: np.swapaxes(x, 0, 2)),
    (lambda t: nb.expand_dims(t, (0, 2)), lambda x: np.expand_dims(x, (0, 2))),
    (lambda t: nb.squeeze(t[:, :1]), lambda x: np.squeeze(x[:, :1])),
    (lambda t: t[..., 1], lambda x: x[..., 1]),
    (lambda t: t[-1, None, ::-1], lambda x: x[-1, None, ::-1]),
    (lambda t: nb.softmax(t, axis=1), lambda x: np.exp(x) / np.exp(x).sum(1, keepdims=True)),
    (lambda t: t @ np.ones((4, 2), np.float32), lambda x: x @ np.ones((4, 2), np.float32)),
    (lambda t: nb.einsum("bij,bkj->bik", t, t), lambda x: np.einsum("bij,bkj->bik", x, x)),
    (lambda t: nb.einsum("bij->j", t), lambda x: np.einsum("bij->j", x)),
    (lambda t: nb.where(t > 1, t, 0.0), lambda x: np.where(x > 1, x, 0.0)),
    (lambda t: nb.concatenate([t, t], axis=-1), lambda x: np.concatenate([x, x], -1)),
    (lambda t: abs(-t) ** 2, lambda x: np.abs(-x) ** 2),
    (lambda t: nb.broadcast_to(t[:, :1], (2, 3, 4)), lambda x: np.broadcast_to(x[:, :1], (2, 3, 4))),
])
def test_numpy_semantics(fn, ref):
    got = fn(nb.tensor(X))
    np.testing.assert_allclose(got.numpy(), ref(X), rtol=1e-6)
    assert got.dtype == np.asarray(ref(X)).dtype


@pytest.mark.parametrize("call, message", [
    (lambda: nb.ones((5, 2)) + nb.ones((3, 2)), r"add: shapes \[\(5, 2\), \(3, 2\)\] do not broadcast"),
    (lambda: nb.ones((5, 2)) @ nb.ones((3, 2)), "matmul: contracted dims differ: operand 0 dim 1 has size 2"),
    (lambda: nb.ones((5, 2)).reshape(3, 3), r"reshape: cannot reshape size 10 \(5, 2\)"),
    (lambda: nb.ones((5, 2)).sum(axis=2), "sum: axis 2 is out of range for a tensor of rank 2"),
    (lambda: nb.concatenate([nb.ones((5, 2)), nb.ones((3, 3))], 0), "concatenate: operand 1, dim 1: size 3"),
    (lambda: nb.ones((5, 2))[7], "getitem: index 7 is out of bounds for dim 0 of size 5"),
    (lambda: nb.ones((5, 2))[[0, 1], [1, 0]], "2 arrays in one index"),
    (lambda: nb.ones((5, 2))[nb.ones((5, 2)) > 0], r"nb.where\(mask, t, fill\)"),
    (lambda: nb.add(nb.ones(2), "abc"), "add: operand 1 .* is not a numeric array"),
    (lambda: nb.broadcast_to(nb.ones((3, 2)), (4, 2)), r"cannot broadcast shape \(3, 2\) to \(4, 2\)"),
    (lambda: nb.einsum("ij,jk->ik", nb.ones((2, 3)), nb.ones((4, 2))), "letter 'j' has size 4 but 3"),
    (lambda: nb.squeeze(nb.ones((2, 3)), 0), "squeeze: dim 0 has size 2, not 1"),
    (lambda: nb.transpose(nb.ones((2, 3)), (0, 0)), "not a permutation"),
    (lambda: nb.matmul(nb.ones(()), nb.ones(3)), "at least 1 dim"),
    (lambda: nb.abstract((2, -1)), "negative dim"),
])
def test_errors_name_the_problem(call, message):
    with pytest.raises(ShardingError, match=message):
        call()


@pytest.mark.parametrize("call, shape", [
    (lambda t: t.reshape(-2, -8), (-2, -8)),
    (lambda t: t.reshape(-1, -1), (-1, -1)),
    (lambda t: nb.reshape(t, (-2, 4)), (-2, 4)),
    (lambda t: t.reshape((4, -3)), (4, -3)),
])
def test_reshape_refuses_negative_dims_other_than_one_minus_one(call, shape):
    """numpy refuses two unknown dims; a lone -2 numpy 2.4 quietly takes as -1, while jax.numpy and numpy's
    documentation allow only -1, so nabla refuses it rather than guess."""
    x = np.arange(16.0).reshape(2, 8)
    if shape.count(-1) + sum(s < -1 for s in shape) > 1:
        with pytest.raises(ValueError, match="can only specify one unknown dimension"):
            x.reshape(shape)
    with pytest.raises(ShardingError, match=rf"reshape: .*{re.escape(str(shape))}.*\(2, 8\)"):
        call(nb.tensor(x).shard(nb.DeviceMesh("m", (2,), ("x",)), ["x", None]))


def test_sharding_error_is_a_value_error():
    assert issubclass(ShardingError, ValueError)


def test_slicing_a_sharded_dim_moves_only_rows_that_change_owner():
    """x[4:12] of 16 rows over 4 devices: result blocks are 2 rows; device 0 needs rows 4-5 (from device 1),
    device 3 rows 10-11 (from device 2), devices 1 and 2 hold theirs: 1 -> 0 and 2 -> 3 do not collide, so
    one collective_permute of 2 rows (16 B of float64), where gathering the dim would send 96 B per device."""
    m = nb.DeviceMesh("m", (4,), ("x",))
    v = np.arange(16.0)
    t = nb.tensor(v).shard(m, ["x"])
    with nb.comm_log() as log:
        s = t[4:12]
    assert s.sharding.dim_specs[0].axes == ("x",)
    assert [(e.kind, e.bytes) for e in log.events] == [("collective_permute", 16)]
    assert_sharded_allclose(s, v[4:12], rtol=0, atol=0)
    with nb.comm_log() as log:  # whole blocks, strided: each device keeps what it has
        u = t[0:16:4]
    assert log.events == [] or log.total_bytes <= 8 * 3
    assert_sharded_allclose(u, v[0:16:4], rtol=0, atol=0)


def test_concatenate_keeps_the_joined_dim_sharded():
    m = nb.DeviceMesh("m", (4,), ("x",))
    a, b = np.arange(8.0), -np.arange(8.0) - 0.0
    b[0] = -0.0  # the sign of zero survives (a select, not a sum of padded operands)
    ta, tb = nb.tensor(a).shard(m, ["x"]), nb.tensor(b).shard(m, ["x"])
    with nb.comm_log() as log:
        c = nb.concatenate([ta, tb])
    want = np.concatenate([a, b])
    assert c.sharding.dim_specs[0].axes == ("x",)
    assert_sharded_allclose(c, want, rtol=0, atol=0)
    assert np.array_equal(np.signbit(c.numpy()), np.signbit(want))
    # result blocks of 4 rows: device p needs rows 4p..4p+4, i.e. a's or b's blocks 2p, 2p+1 (2 rows each):
    # at most 4 rows (32 B) arrive at any device
    assert 0 < log.total_bytes <= 4 * 8 * 2 and set(log.counts) == {"collective_permute"}


# ---- creation: shapes, values and dtypes ------------------------------------------------------------------

import sys  # noqa: E402
import warnings  # noqa: E402

from hypothesis import given, strategies as st  # noqa: E402


@pytest.mark.parametrize("call, words", [
    (lambda: nb.abstract((2.5, 4)), ["abstract", "non-integer dim 2.5", "position 0"]),
    (lambda: nb.abstract(4.0), ["abstract", "4.0"]),
    (lambda: nb.abstract((2, True)), ["abstract", "non-integer dim True"]),
    (lambda: nb.abstract(None), ["abstract", "shape", "None"]),
    (lambda: nb.abstract("34"), ["abstract", "shape", "'34'"]),
    (lambda: nb.abstract((2**63,)), ["abstract", "past numpy's limit"]),
    (lambda: nb.abstract((2**40, 2**40)), ["abstract", "more than 2**63 elements"]),
    (lambda: nb.abstract((1,) * 33), ["abstract", "at most 32"]),
    (lambda: nb.ones((2, "3")), ["ones", "non-integer dim '3'"]),
    (lambda: nb.zeros({2: 3}), ["zeros", "shape"]),
    (lambda: nb.zeros((-1,)), ["zeros", "negative dim -1"]),
    (lambda: nb.ones(3, dtype="float33"), ["ones", "dtype 'float33'"]),
    (lambda: nb.ones(3, dtype=5), ["ones", "dtype 5"]),
    (lambda: nb.ones(3, dtype=object), ["ones", "dtype object is not numeric"]),
    (lambda: nb.ones(3, dtype="U3"), ["ones", "is not numeric"]),
    (lambda: nb.tensor(None), ["tensor", "None", "not numeric"]),
    (lambda: nb.tensor("abc"), ["tensor", "'abc'", "not numeric"]),
    (lambda: nb.tensor(b"abc"), ["tensor", "b'abc'", "not numeric"]),
    (lambda: nb.tensor([1.0, None]), ["tensor", "NoneType None"]),
    (lambda: nb.tensor(["1", "2"]), ["tensor", "<U1", "not numeric"]),
    (lambda: nb.tensor([[1], [2, 3]]), ["tensor", "not array-like"]),
    (lambda: nb.tensor({"a": 1}), ["tensor", "dict", "not a number"]),
    (lambda: nb.tensor(2**70), ["tensor", "too large for int64", "dtype="]),
    (lambda: nb.tensor(2**70, dtype="int64"), ["tensor", "does not fit dtype int64"]),
    (lambda: nb.tensor([1, 2], dtype="float33"), ["tensor", "dtype 'float33'"]),
    (lambda: nb.tensor([1j, 2], dtype="float32"), ["tensor", "imaginary parts"]),
    (lambda: nb.tensor([1e300], dtype="float32"), ["tensor", "does not fit dtype float32"]),
    (lambda: nb.tensor([float("nan")], dtype="int32"), ["tensor", "does not fit dtype int32"]),
    (lambda: nb.arange(), ["arange", "0 arguments"]),
    (lambda: nb.arange(0, 1, 0), ["arange", "step is 0"]),
    (lambda: nb.arange("3"), ["arange", "stop must be a real number", "'3'"]),
    (lambda: nb.arange(1j), ["arange", "stop must be a real number"]),
    (lambda: nb.arange(float("nan")), ["arange", "stop is nan"]),
    (lambda: nb.arange(10**30), ["arange", "past int64"]),
])
def test_creation_refuses_bad_shapes_values_and_dtypes(call, words):
    """Regression: abstract((2.5, 4)) truncated to (2, 4); tensor(None) and tensor("abc") made object/str
    tensors; unknown dtypes raised TypeError."""
    with pytest.raises(ShardingError) as e:
        call()
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("value, dtype", [
    (True, None), (3, None), (2.5, None), (1 + 2j, None), ([True, 2, 3.5, 4j], None), (np.float16(1), None),
    ([[1, 2], [3, 4]], "int8"), (2**63, None), (2**70, "float64"), (np.arange(3), "complex64"), ((), None),
])
def test_creation_accepts_every_numeric_value(value, dtype):
    t = nb.tensor(value, dtype=dtype)
    np.testing.assert_array_equal(t.numpy(), np.array(value, dtype=dtype))
    assert t.dtype == np.array(value, dtype=dtype).dtype


def test_creation_accepts_numpy_habits():
    assert nb.ones(3).shape == (3,) and nb.zeros(()).shape == () and nb.ones(np.int64(2)).shape == (2,)
    assert nb.abstract(np.array([2, 3])).shape == (2, 3) and nb.abstract(5).shape == (5,)
    assert nb.ones((2, np.int32(3)), dtype=np.float64).dtype == np.float64
    np.testing.assert_array_equal(nb.arange(1.5, 4).numpy(), np.arange(1.5, 4))
    np.testing.assert_array_equal(nb.arange(np.int64(5), dtype="int8").numpy(), np.arange(5, dtype="int8"))


def test_tensor_copies_and_leaves_the_callers_array_alone():
    a = np.arange(3.0)
    t = nb.tensor(a)
    a[0] = 7.0  # still writable, and the tensor does not change with it
    assert t.numpy()[0] == 0.0


def test_bfloat16_through_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for make in (lambda: nb.tensor([1.5, 2.0], dtype="bfloat16"), lambda: nb.ones(2, dtype="bfloat16"),
                 lambda: nb.zeros(2, dtype="bfloat16"), lambda: nb.arange(2, dtype="bfloat16"),
                 lambda: nb.abstract(2, dtype="bfloat16"), lambda: nb.random.normal(2, seed=0, dtype="bfloat16")):
        assert make().dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(nb.tensor([1.5, 2.0], dtype="bfloat16").numpy().astype(np.float32), [1.5, 2.0])
    assert nb.tensor(np.ones(2, ml_dtypes.bfloat16)).dtype == np.dtype(ml_dtypes.bfloat16)
    # astype takes the ml_dtypes names as creation does (np.dtype("bfloat16") does not know them)
    x = nb.tensor([1.5, 2.0]).shard(nb.DeviceMesh("bf", (2,), ("x",)), ["x"])
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        assert x.astype(name).dtype == np.dtype(getattr(ml_dtypes, name))
    with pytest.raises(ShardingError, match="astype: dtype 'float33' is not a dtype numpy knows"):
        x.astype("float33")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float16", "float32"])
def test_python_floats_are_weak_beside_low_precision_tensors_as_in_jax_numpy(dtype):
    """NEP 50: a Python float takes the tensor's float dtype (numpy keeps float16 * 1.5 float16; with ml_dtypes'
    bfloat16 it gives float32, and where(c, x, 0.0) float64, where jax.numpy keeps bfloat16)."""
    jnp = pytest.importorskip("jax.numpy")
    v = np.array([[0.5, -1.25, 2.0], [3.0, -0.75, 1.5]], dtype=dtype)
    mesh = nb.DeviceMesh("weak", (2,), ("x",))
    x = nb.tensor(v).shard(mesh, ["x", None])
    j = jnp.asarray(v)
    cases = [(lambda a: a * 1.5, lambda a: a * 1.5), (lambda a: 1.0 - a, lambda a: 1.0 - a),
             (lambda a: a ** 2.0, lambda a: a ** 2.0), (lambda a: nb.maximum(a, 0.0), lambda a: jnp.maximum(a, 0.0)),
             (lambda a: nb.where(a > 0, a, 0.0), lambda a: jnp.where(a > 0, a, 0.0)),
             (lambda a: a * 2, lambda a: a * 2)]
    for f, ref in cases:
        got, want = f(x), ref(j)
        assert got.dtype == want.dtype, (dtype, got.dtype, want.dtype)
        np.testing.assert_array_equal(got.numpy().astype(np.float64), np.asarray(want).astype(np.float64))
    i = nb.tensor(np.arange(3, dtype=np.int32))
    assert (i * 1.5).dtype == np.float64  # an int tensor beside a float still promotes, as numpy's does


def test_bfloat16_without_ml_dtypes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now raises ImportError
    for make in (lambda: nb.tensor([1.0], dtype="bfloat16"), lambda: nb.ones(2, dtype="bfloat16"),
                 lambda: nb.abstract(2, dtype="float8_e4m3fn")):
        with pytest.raises(ShardingError, match=r"pip install ml_dtypes \(or pip install nabla-spmd\[jax\]"):
            make()


# ---- fuzzing: nb.tensor and nb.abstract take anything and give a tensor or a ShardingError ----------------

def _anything(small_ints=False):
    ints = st.integers(-3, 6) if small_ints else st.one_of(st.integers(), st.integers(-2**70, 2**70))
    scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.complex_numbers(), st.text(max_size=4),
                        st.binary(max_size=3), st.integers(0, 5).map(np.int64), st.floats(0, 4).map(np.float32),
                        st.just(object()), st.just(Ellipsis))
    return st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4), st.lists(kids, max_size=3).map(tuple),
                                                        st.lists(st.lists(kids, min_size=2, max_size=2), max_size=3),
                                                        st.frozensets(st.integers(0, 3), max_size=2),
                                                        st.dictionaries(st.text(max_size=2), kids, max_size=2)),
                        max_leaves=16)


_DTYPES = st.one_of(st.none(), st.sampled_from(["float32", "int8", "bool", "complex64", "uint64", "bfloat16", "float33",
                                                "U3", "object", "datetime64", "V4", "f8", "i"]),
                    st.sampled_from([np.float64, int, float, complex, object, str, 5, 2.5]))


@given(value=_anything(), dtype=_DTYPES)
def test_fuzz_tensor_takes_anything(value, dtype):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no ComplexWarning or cast-overflow RuntimeWarning either
            t = nb.tensor(value, dtype=dtype)
    except ShardingError:
        return
    v = t.numpy()
    assert v.dtype.kind in "biufc" or v.dtype.type.__module__.startswith("ml_dtypes")
    assert v.shape == t.shape and v.dtype == t.dtype and t.ndim <= 32


@given(shape=_anything(), dtype=_DTYPES)
def test_fuzz_abstract_takes_anything(shape, dtype):
    try:
        t = nb.abstract(shape, dtype=dtype)
    except ShardingError:
        return
    assert all(isinstance(d, int) and d >= 0 for d in t.shape) and len(t.shape) <= 32
    assert t.shape == ((int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in np.asarray(shape).reshape(-1)))


@given(shape=_anything(small_ints=True), dtype=_DTYPES)
def test_fuzz_ones_and_zeros_take_anything(shape, dtype):
    try:
        t = nb.zeros(shape, dtype=dtype)
    except ShardingError:
        return
    assert t.size == 0 or not t.numpy().any()
    np.testing.assert_array_equal(nb.ones(shape, dtype=dtype).numpy(), np.ones(t.shape, dtype=t.dtype))


def test_bad_op_arguments_raise_sharding_errors_naming_them():
    # numpy raises TypeError for axis='a'; nabla's op-argument errors are ShardingErrors (ValueErrors) naming it
    m = nb.DeviceMesh("m", (2,), ("x",))
    t = nb.tensor(np.ones((2, 3))).shard(m, ["x", None])
    with pytest.raises(nb.ShardingError, match="subscripts"):
        nb.einsum(5, t)
    for axis in ("a", 1.0, True, (0, "a")):
        for f in (nb.sum, nb.mean, nb.max, nb.min):
            with pytest.raises(nb.ShardingError, match="axis"):
                f(t, axis=axis)
    np.testing.assert_array_equal(t.sum(axis=np.int64(1)).numpy(), np.full(2, 3.0))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8, np.int64, np.complex64])
@pytest.mark.parametrize("shape, axis", [((2, 4, 32, 16), 2), ((8, 64, 3), 1), ((40, 7), 0), ((2, 17, 1, 5), 1),
                                         ((3, 0, 20, 4), 2)])
def test_reducing_a_middle_axis_through_a_leading_copy_is_numpy_bit_for_bit(dtype, shape, axis):
    """The kernels move a short-run middle axis in front before reducing (3x faster on sharded blocks); the
    rows are combined in the same order, so every value, NaN and inf included, is numpy's exactly."""
    from nabla.ops import _reduce_leading
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 100).astype(dtype)
    if x.dtype.kind in "fc" and x.size:
        x.flat[5] = np.nan
        x.flat[-3] = np.inf
    for ufunc in (np.add, np.maximum, np.minimum):
        if dtype == np.complex64 and ufunc is not np.add:
            continue
        for keepdims in (False, True):
            with np.errstate(all="ignore"):
                got = _reduce_leading(ufunc, x, axis, keepdims, 64)
                want = ufunc.reduce(x, axis=axis, keepdims=keepdims)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got.real),
                                                                                  np.signbit(want.real))


def test_an_index_out_of_range_is_an_index_error_too():
    """numpy raises IndexError there; code written for numpy that catches it catches nabla's too (a
    ShardingError still, naming op, dim and size)."""
    t = nb.ones((5, 2)).shard(nb.DeviceMesh("m2", (2,), ("x",)), ["x", None])
    for bad in (lambda a: a[7], lambda a: a[0, 0, 0], lambda a: a[:, -3]):
        with pytest.raises(IndexError) as numpy_error:
            bad(np.ones((5, 2)))
        with pytest.raises(IndexError) as ours:
            bad(t)
        assert isinstance(ours.value, nb.ShardingError) and type(numpy_error.value) is IndexError
    assert "dim 1 of size 2" in str(pytest.raises(IndexError, lambda: t[:, -3]).value)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_floor_divide_remainder_clip_and_friends_equal_numpy_and_jax_grad(dtype):
    """``//``, ``%`` (numpy's remainder: the divisor's sign), ``nb.clip``, floor, ceil, sign and square on a
    sharded value equal numpy, dtypes included (NaN and a zero divisor as numpy gives them); gradients as
    jax.grad's (zero for floor, floor_divide and sign; d(a % b)/db = -floor(a / b))."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    m = nb.DeviceMesh("fd", (2, 2), ("x", "y"))
    v = np.array([[-2.5, -0.3, 0.0, 0.3], [1.7, -1.7, 2.2, 7.0]]).astype(dtype)
    if dtype != "int32":
        v[1, 3] = np.nan
    t = nb.tensor(v).shard(m, ["x", "y"])
    two = 2 if dtype == "int32" else 0.3
    cases = [(lambda a: a // two, lambda a: a // two), (lambda a: a % two, lambda a: a % two),
             (lambda a: nb.clip(a, -1, 1), lambda a: np.clip(a, -1, 1)),
             (lambda a: np.clip(a, None, 0.5), lambda a: np.clip(a, None, 0.5)),
             (nb.floor, np.floor), (nb.ceil, np.ceil), (nb.sign, np.sign), (nb.square, np.square),
             (lambda a: 7 % a, lambda a: 7 % a), (lambda a: 7 // a, lambda a: 7 // a)]
    with np.errstate(all="ignore"):
        for f, g in cases:
            got, want = f(t), g(v)
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            np.testing.assert_array_equal(got.numpy(), want)
    if dtype != "float32":
        return
    w = np.array([[0.7, 1.3], [2.9, -0.4]], np.float32)
    tw = nb.tensor(w).shard(m, ["x", None])
    for f, jf in ((lambda a: (a % 0.5).sum(), lambda a: (a % 0.5).sum()),
                  (lambda a: (1.3 % a + a // 0.3 + nb.floor(a) + nb.sign(a)).sum(),
                   lambda a: (1.3 % a + a // 0.3 + jnp.floor(a) + jnp.sign(a)).sum()),
                  (lambda a: (nb.square(a) * nb.clip(a, 0.0, 1.0)).sum(),
                   lambda a: (jnp.square(a) * jnp.clip(a, 0.0, 1.0)).sum())):
        np.testing.assert_allclose(nb.grad(f)(tw).numpy(), np.asarray(jax.grad(jf)(jnp.asarray(w))), rtol=1e-6)


@pytest.mark.parametrize("dims", [[None, None], [None, ("x", "y")], ["x", "y"]])  # the row whole, or cut 5 over 4
def test_softmax_and_sigmoid_of_integers_compute_in_exps_float_dtype(dims):
    """In the float numpy's exp gives an integer (int8: float16), not in the integer: -x and x - max wrapped, so
    sigmoid(uint8 1) was 0 (0.731) and softmax of int8 [0, 1, 6, -100, 100] NaN where it is 1."""
    m = nb.DeviceMesh("m", (2, 2), ("x", "y"))
    for v in (np.uint8([[0, 1, 6, 200, 255]] * 2), np.int8([[0, 1, 6, -100, 100], [-128, 127, 0, 3, -3]]),
              np.int32([[1, 5, 70000, -3, 2]] * 2), np.bool_([[True, False, True, True, False]] * 2)):
        t, x = nb.tensor(v).shard(m, dims), v.astype(np.float64)
        e = np.exp(x - x.max(1, keepdims=True))
        with np.errstate(over="ignore"):  # (sigmoid(-128) in float16: exp(128) is inf, as numpy's)
            pairs = ((nb.softmax(t, axis=1), e / e.sum(1, keepdims=True)), (nb.sigmoid(t), 1 / (1 + np.exp(-x))))
        for got, want in pairs:
            assert got.dtype == np.exp(v[:0]).dtype, (v.dtype, got.dtype)
            assert_sharded_allclose(got, want.astype(got.dtype), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("dims", [[None, None, None], ["x", None, "y"], [None, ("x", "y"), None]])
def test_argmax_and_argmin_keep_dims_as_numpy_does(name, axis, dims):
    """``keepdims`` on the function, the method and ``np.<name>(t)``, on every layout: numpy's shape and indices."""
    x = np.random.default_rng(3).standard_normal((4, 5, 6)).astype(np.float32)
    x[1, 2, 3] = np.nan
    t = nb.tensor(x).shard(nb.DeviceMesh("m", (2, 2), ("x", "y")), dims)
    want = getattr(np, name)(x, axis=axis, keepdims=True)
    for got in (getattr(nb, name)(t, axis, keepdims=True), getattr(t, name)(axis, keepdims=True),
                getattr(np, name)(t, axis=axis, keepdims=True)):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(getattr(nb, name)(t, axis).numpy(), getattr(np, name)(x, axis=axis))
