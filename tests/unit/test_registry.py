"""The op registry (nabla.ops.registry): one ``elementwise(...)`` call, made after ``import nabla``, gives an op that
``nb.<name>``, numpy's protocol, ``nb.grad``, ``nb.jit``, ONNX export, ``nb.explain`` and ``nabla.testing.programs``
all know; and the registry's own API (register, unregister, lookups, refusals)."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, find, settings

import nabla as nb
from nabla import DeviceMesh, ShardingError
from nabla.ops import elementwise, registry, unregister
from nabla.testing import assert_sharded_allclose, numpy_unanswered, programs

MESH = DeviceMesh("cluster", (2, 2), ("dp", "tp"))
X = np.random.default_rng(0).uniform(-1.2, 1.2, (4, 6)).astype(np.float32)


@pytest.fixture
def tan():
    """A tangent registered in one call for the test (``my_tan``, answering ``np.tan``), and gone after it. It
    reserves no name: an op nabla itself has for ``np.tan`` is set aside meanwhile."""
    with numpy_unanswered("tan"):
        f = elementwise("my_tan", "tan", numpy="tan", onnx="Tan", vjp=lambda g, x, out: g * (1 + out * out),
                        domain=(-1.2, 1.2))
        yield f
        unregister("my_tan")
    assert "my_tan" not in registry.REGISTRY


def sharded(a, dims, partial=()):
    return nb.tensor(a).shard(MESH, dims, partial_axes=partial)


# ---- an op registered at run time, everywhere -------------------------------------------------------------------


def test_a_registered_op_runs_sharded_as_nb_name_and_in_nabla_ops(tan):
    t = sharded(X, ["dp", "tp"])
    out = nb.my_tan(t)
    assert_sharded_allclose(out, np.tan(X))
    assert out.sharding.layout().dim_specs == t.sharding.layout().dim_specs
    assert nb.my_tan is tan and nb.ops.my_tan is tan and tan.op is registry.lookup("my_tan")
    assert "my_tan" in dir(nb) and "my_tan" in registry.names()
    with nb.comm_log() as log:  # a partial operand is summed first (tan is not linear)
        got = nb.my_tan(sharded(X, ["dp", None], partial=("tp",)))
    assert [e.kind for e in log.events] == ["all_reduce"]
    assert_sharded_allclose(got, np.tan(X), rtol=1e-5, atol=1e-6)


def test_numpy_ufunc_on_a_tensor_runs_the_registered_op(tan):
    t = sharded(X, ["dp", None])
    out = np.tan(t)
    assert isinstance(out, nb.Tensor) and out.sharding.layout().dim_specs == t.sharding.layout().dim_specs
    assert_sharded_allclose(out, np.tan(X))


def test_grad_through_a_registered_op_equals_jax(tan):
    jax = pytest.importorskip("jax")
    w = np.random.default_rng(1).standard_normal(X.shape).astype(np.float32)
    got = nb.grad(lambda x: (tan(x) * w).sum())(sharded(X, ["dp", "tp"]))
    want = jax.grad(lambda x: (jax.numpy.tan(x) * w).sum())(X)
    assert_sharded_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)


def test_jit_of_a_registered_op_equals_numpy_with_the_collectives_of_its_log(tan):
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 jax devices (set in tests/conftest.py)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from jit_check import assert_hlo_is_the_log

    def f(x):
        return nb.my_tan(x) * 2.0

    x = sharded(X, ["dp", None], partial=("tp",))
    lowered = nb.jit(f).lower(x)
    assert [e.kind for e in lowered.comm_log.events] == ["all_reduce"]
    assert_hlo_is_the_log(lowered)
    assert_sharded_allclose(nb.jit(f)(x), np.tan(X) * 2, rtol=1e-5, atol=1e-5)


def test_onnx_export_of_a_registered_op_runs_in_onnxruntime(tan):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import nabla.onnx as nox
    from nabla.onnx.export import MAPPING

    m = nox.export(lambda a: nb.my_tan(a) + 1.0, sharded(X, ["dp", "tp"]))
    assert [n.op_type for n in m.graph.node] == ["Tan", "Add"]
    assert m.graph.node[0].device_configurations  # its operand's and result's shardings
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got, = sess.run(None, {m.graph.input[0].name: X})
    np.testing.assert_allclose(got, np.tan(X) + 1, rtol=1e-5, atol=1e-6)
    assert MAPPING["my_tan"] == ("Tan",) and tan.op in registry.by_onnx("Tan")


def test_explain_shows_a_registered_op(tan):
    text = nb.explain(lambda x: nb.my_tan(x), sharded(X, ["dp", None], partial=("tp",)), show=False)
    assert "my_tan" in text and "all_reduce" in text


def test_random_programs_draw_a_registered_op_inside_its_domain(tan):
    strategy = programs(max_ops=3)  # the registry is read here
    prog = find(strategy, lambda p: any(d.split()[0] == "my_tan" for d, _ in p.steps),
                settings=settings(derandomize=True, database=None, max_examples=3000,
                                  suppress_health_check=list(HealthCheck)))
    assert any(d == "my_tan on [-1.2, 1.2]" for d, _ in prog.steps), prog
    got = prog.run(nb)
    with np.errstate(all="ignore"):
        want = prog.run(np)
    assert_sharded_allclose(got, np.asarray(want, dtype=got.dtype), rtol=1e-4, atol=1e-4)


def test_an_unregistered_op_is_gone_everywhere(tan):
    unregister("my_tan")
    try:
        with pytest.raises(AttributeError, match="my_tan"):
            nb.my_tan  # noqa: B018
        with pytest.raises(ShardingError, match="np.tan"):
            np.tan(sharded(X, ["dp", None]))
        from nabla.onnx.export import MAPPING
        assert "my_tan" not in MAPPING and "my_tan" not in dir(nb)
    finally:
        registry.register(tan.op)  # for the fixture's cleanup


# ---- the registry's API -------------------------------------------------------------------------------------------


def test_every_public_op_is_nb_name_answers_numpy_by_its_name_and_exports():
    from nabla.onnx.export import MAPPING
    for name in registry.names():
        op = registry.lookup(name)
        assert getattr(nb, name) is op.public
        assert name in MAPPING, name
        if op.numpy is not None:
            assert registry.by_numpy(op.numpy) is op and hasattr(np, op.numpy)
    assert registry.by_numpy("absolute") is registry.lookup("abs")
    assert registry.function("reciprocal") is None  # internal: no nb.reciprocal
    assert not hasattr(nb, "reciprocal")


def test_star_import_takes_the_registry_functions_and_leaves_builtins_alone():
    ns: dict = {}
    exec("from nabla import *", ns)
    assert ns["exp"] is nb.exp and ns["matmul"] is nb.matmul and "sum" not in ns and "abs" not in ns


def test_a_taken_name_or_numpy_name_is_refused():
    with pytest.raises(ShardingError, match="'exp' is registered already"):
        elementwise("exp", numpy=None)
    with pytest.raises(ShardingError, match="np.exp already runs op 'exp'"):
        elementwise("my_exp", "exp", numpy="exp")
    assert "my_exp" not in registry.REGISTRY and registry.by_numpy("exp") is nb.exp.op
    with pytest.raises(ShardingError, match="no op named 'nothing'"):
        unregister("nothing")
    with pytest.raises(ShardingError, match="no op named 'nothing'"):
        registry.lookup("nothing")


def test_elementwise_refuses_what_it_cannot_define():
    with pytest.raises(ShardingError, match="numpy has no function 'frobnicate'"):
        elementwise("frobnicate")
    with pytest.raises(ShardingError, match="one derivative each"):
        elementwise("my_hypot", "hypot", vjp=lambda g, a, b, out: g)
    assert "frobnicate" not in registry.REGISTRY and "my_hypot" not in registry.REGISTRY


def test_a_binary_op_from_a_kernel_function_broadcasts_and_differentiates_per_operand():
    jax = pytest.importorskip("jax")
    f = elementwise("my_hypot", lambda xp, a, b: xp.sqrt(a * a + b * b),
                    vjp=(lambda g, a, b, out: g * a / out, lambda g, a, b, out: g * b / out))
    try:
        assert f.op.arity == 2 and f.op.reference is not None and f.op.numpy is None
        a, b = X + 2, X[:1] - 2  # b broadcasts over rows
        out = f(sharded(a, ["dp", "tp"]), b)
        assert_sharded_allclose(out, np.hypot(a, b), rtol=1e-5)
        assert_sharded_allclose(f(b=b, a=a), np.hypot(a, b), rtol=1e-5)  # by name, as a def takes them
        with pytest.raises(TypeError):
            f(a)
        ga, gb = nb.grad(lambda x, y: f(x, y).sum(), argnums=(0, 1))(sharded(a, ["dp", "tp"]), nb.tensor(b))
        wa, wb = jax.grad(lambda x, y: jax.numpy.hypot(x, y).sum(), argnums=(0, 1))(a, b)
        assert gb.shape == b.shape
        assert_sharded_allclose(ga, np.asarray(wa), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gb.numpy(), np.asarray(wb), rtol=1e-5, atol=1e-5)
        with pytest.raises(ShardingError, match="no ONNX mapping"):
            import nabla.onnx as nox
            nox.export(lambda x: f(x, x), sharded(a, ["dp", "tp"]))
    finally:
        unregister(f.op)


def test_an_op_without_a_vjp_is_not_differentiable_and_a_comparison_has_no_cotangent():
    f = elementwise("my_cbrt", "cbrt")
    try:
        with pytest.raises(ShardingError):
            nb.grad(lambda x: f(x).sum())(nb.tensor(X))
    finally:
        unregister("my_cbrt")
    g = nb.grad(lambda x: (nb.where(nb.less(x, 0.0), x, 0.0)).sum())(nb.tensor(X))
    np.testing.assert_array_equal(g.numpy(), (X < 0).astype(np.float32))
