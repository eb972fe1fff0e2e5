"""nabla.ops.lax_ops: the internal ops nb.import_jax runs JAX's primitives as. Each equals jax.lax's on sharded
operands (bit for bit where JAX's are integers), and its ONNX export equals it under onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

import nabla as nb
from nabla.ops import lax_ops as X

jax = pytest.importorskip("jax")
pytestmark = pytest.mark.usefixtures("jax_x32")  # these programs are written for 32-bit jax
import jax.numpy as jnp  # noqa: E402

MESH = nb.DeviceMesh("m", (2, 4), ("x", "y"))
RNG = np.random.default_rng(0)
F = RNG.uniform(0.1, 0.9, (4, 8)).astype(np.float32)
G = RNG.uniform(-2, 2, (4, 8)).astype(np.float32)
ZERO_SOME = np.where(np.arange(32).reshape(4, 8) % 5 == 0, 0, G[::-1]).astype(np.float32)
U = RNG.integers(0, 2 ** 32, (4, 8), dtype=np.uint64).astype(np.uint32)
S = RNG.integers(0, 40, (4, 8)).astype(np.uint32)

# name -> (nabla function, jax function, operands)
CASES = {
    "log1p": (X.log1p, jnp.log1p, [F]), "expm1": (X.expm1, jnp.expm1, [F]), "tan": (X.tan, jnp.tan, [F]),
    "arctan": (X.arctan, jnp.arctan, [G]), "arcsin": (X.arcsin, jnp.arcsin, [F]), "arccos": (X.arccos, jnp.arccos, [F]),
    "sinh": (X.sinh, jnp.sinh, [G]), "cosh": (X.cosh, jnp.cosh, [G]), "arctan2": (X.arctan2, jnp.arctan2, [G, ZERO_SOME]),
    "rint": (X.rint, jnp.rint, [G * 3]), "cbrt": (X.cbrt, jnp.cbrt, [G]), "erf_inv": (X.erf_inv, jax.lax.erf_inv, [G / 2.5]),
    "erfc": (X.erfc, jax.lax.erfc, [G * 3]), "arcsinh": (X.arcsinh, jnp.arcsinh, [G * 50]),
    "arccosh": (X.arccosh, jnp.arccosh, [1.0 + F * 9]), "arctanh": (X.arctanh, jnp.arctanh, [G / 2.5]),
    "rem": (X.rem, jax.lax.rem, [np.float32([[-1e-30, 1.0, 1e7, -3.5, 5.0, -7.0, 0.5, -0.0]] * 4),
                                 np.float32([[1.0, 0.1, 0.3, 2.0, -3.0, np.inf, 0.7, 2.0]] * 4)]),
    # XLA's integer x rem 0 is x and INT_MIN rem -1 is 0 (its EmitIntegerRemainder); numpy's fmod gave 0 and warned
    "int_rem": (X.rem, jax.lax.rem, [np.int32([[7, -7, 0, -(2 ** 31), 2 ** 31 - 1, -5, 9, 1]] * 4),
                                     np.int32([[0, 0, 0, -1, 0, 3, -4, -1]] * 4)]),
    "signed_shifts": (lambda a, b: X.bitwise_xor(X.left_shift(a, b), X.right_shift(a, b)),
                      lambda a, b: jax.lax.shift_left(a, b) ^ jax.lax.shift_right_arithmetic(a, b),
                      [U.astype(np.int32), S.astype(np.int32) - 4]),  # (counts from -4 to 35: negative ones saturate)
    "shifts": (lambda a, b: X.bitwise_xor(X.left_shift(a, b), X.right_shift(a, b)),
               lambda a, b: jax.lax.shift_left(a, b) ^ jax.lax.shift_right_logical(a, b), [U, S]),
    "logic": (lambda a, b: X.bitwise_or(X.bitwise_and(a, X.invert(b)), b), lambda a, b: (a & ~b) | b, [U, S]),
    "bool_logic": (lambda a, b: X.bitwise_or(X.bitwise_and(a, X.invert(b)), X.bitwise_xor(a, b)),
                   lambda a, b: (a & ~b) | (a ^ b), [U % 3 == 0, S % 2 == 0]),  # (a mask & a causal mask)
    "threefry": (lambda a, b: X.threefry2x32(np.uint32(3), np.uint32(9), a, b),
                 lambda a, b: jnp.stack(_threefry(jnp.uint32(3), jnp.uint32(9), a, b), -1), [U, S]),
}


def _threefry(*args):
    from jax._src.random.threefry2x32 import threefry2x32_p  # the primitive the key functions bind
    return threefry2x32_p.bind(*args)


def _sharded(args):
    return [nb.tensor(a).shard(MESH, ["x", "y"]) for a in args]


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_jax_lax_on_sharded_operands(name):
    fn, ref, args = CASES[name]
    got = fn(*_sharded(args)).numpy()
    want = np.asarray(jax.jit(ref)(*args))
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 if name != "rem" else 0)  # (-1e-30 rem 1 gave 0)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_onnx_export_equals_nabla(name):
    ort = pytest.importorskip("onnxruntime")
    nox = pytest.importorskip("nabla.onnx")
    fn, _, args = CASES[name]
    ts = _sharded(args)
    model = nox.export(fn, *ts)
    got = ort.InferenceSession(model.SerializeToString()).run(
        None, {i.name: a for i, a in zip(model.graph.input, args)})[0]
    np.testing.assert_allclose(got.astype(np.float64), fn(*ts).numpy().astype(np.float64), rtol=1e-5, atol=1e-6)


def test_bitcast_reads_the_bits_and_refuses_other_widths():
    t = nb.tensor(np.float32([1.5, -2.0])).shard(MESH, ["x"])
    np.testing.assert_array_equal(X.bitcast(t, "uint32").numpy(), np.float32([1.5, -2.0]).view(np.uint32))
    with pytest.raises(nb.ShardingError, match="differ in width"):
        X.bitcast(t, "uint16")
