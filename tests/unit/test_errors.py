"""Errors name the call the user made (``nb.grad`` says "grad:", not the "vjp:" it is built on; ``nb.std`` says
"std:"), and a missing extra names the pip command that installs it (scipy for ``nb.autoshard``, matplotlib for
``report.plot()``, onnx for ``nabla.onnx``), as ``nb.jit`` names jax's; the extras in pyproject.toml hold them."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nabla as nb
from nabla import ShardingError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("call, name", [(nb.grad, "grad"), (nb.value_and_grad, "value_and_grad")])
def test_differentiating_an_integer_tensor_names_the_call(call, name):
    with pytest.raises(ShardingError, match=rf"^{name}: differentiating with respect to a int64 tensor"):
        call(lambda x: x.sum())(nb.tensor(np.arange(3)))
    with pytest.raises(ShardingError, match=rf"^{name}: with has_aux=True, f must return \(output, aux\)"):
        call(lambda x: x.sum(), has_aux=True)(nb.tensor(np.ones(3)))
    with pytest.raises(ShardingError, match=rf"^{name}: f must return tensors, got float"):
        call(lambda x: 3.0)(nb.tensor(np.ones(3)))
    with pytest.raises(ShardingError, match=rf"^{name}: expected a Tensor \(or an array\), got str"):
        call(lambda x: x.sum())("abc")
    with pytest.raises(ShardingError, match=rf"^{name}: argnums 3 out of range"):
        call(lambda x: x.sum(), argnums=3)(nb.tensor(np.ones(3)))


def test_vjp_still_says_vjp():
    with pytest.raises(ShardingError, match=r"^vjp: differentiating with respect to a int64 tensor"):
        nb.vjp(lambda x: x.sum(), nb.tensor(np.arange(3)))


@pytest.mark.parametrize("call, name", [(lambda x: nb.std(x, 3), "std"), (lambda x: x.std(3), "std"),
                                        (lambda x: nb.var(x, 3), "var"), (lambda x: x.var(3), "var")])
def test_std_and_var_name_themselves(call, name):
    with pytest.raises(ShardingError, match=rf"^{name}: axis 3 is out of range for a tensor of rank 2"):
        call(nb.tensor(np.ones((2, 3))))


def test_a_bad_ddof_names_the_call():
    with pytest.raises(ShardingError, match=r"^std: ddof must be a number, got 'a'"):
        nb.std(nb.tensor(np.ones(3)), ddof="a")


def test_autoshard_without_scipy_names_the_pip_command(monkeypatch):
    cluster = nb.Cluster(nb.Hardware.preset("h100-sxm-80gb"), nodes=1, devices_per_node=2)
    mesh = cluster.mesh("m", (2,), ("dp",))
    free = nb.DimSpec([], is_open=True)
    w, x = nb.abstract((8, 8)).shard(mesh, [free, free]), nb.abstract((4, 8)).shard(mesh, [free, free])
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # as if scipy were not installed
    with pytest.raises(ShardingError, match=r"^autoshard needs scipy .*pip install 'nabla-spmd\[plan\]'"):
        nb.autoshard(nb.value_and_grad(lambda w, x: (x @ w).sum()), cluster, w, x)


def test_plot_without_matplotlib_names_the_pip_command(monkeypatch):
    cluster = nb.Cluster(nb.Hardware.preset("h100-sxm-80gb"), nodes=1, devices_per_node=2)
    mesh = cluster.mesh("m", (2,), ("dp",))
    report = nb.estimate(lambda x: (x * x).sum(), cluster)(nb.abstract((4, 8)).shard(mesh, ["dp", None]))
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ShardingError, match=r"^plot needs matplotlib: pip install 'nabla-spmd\[plot\]'"):
        report.plot()


def test_nabla_onnx_without_onnx_names_the_pip_command():
    code = "import sys; sys.modules['onnx'] = None\ntry:\n import nabla.onnx\nexcept ImportError as e: print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=120)
    assert out.stdout.startswith("nabla.onnx needs onnx: pip install 'nabla-spmd[onnx]'"), out.stdout + out.stderr


def test_the_extras_hold_what_the_messages_promise():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {k: {r.split(">")[0].split("[")[0].split("=")[0] for r in v} for k, v in extras.items()}
    assert {"scipy", "matplotlib"} <= names["plan"]  # nb.autoshard, and report.plot() on what it returns
    assert "matplotlib" in names["plot"]
    assert "onnx" in names["onnx"] and "jax" in names["jax"] and "rich" in names["viz"]


def test_a_norm_s_scale_of_the_wrong_size_names_the_norm_and_the_scale():
    # (it said "multiply: shapes [(8, 16), (5,)] do not broadcast", the op inside)
    with pytest.raises(nb.ShardingError, match=r"layer_norm: scale of shape \(5,\) does not broadcast to the "
                                               r"normalised dims \(16,\) \(x of shape \(8, 16\)"):
        nb.layer_norm(nb.ones((8, 16)), nb.ones(5))
    with pytest.raises(nb.ShardingError, match=r"layer_norm: bias of shape \(4, 16\)"):
        nb.layer_norm(nb.ones((8, 16)), nb.ones(16), nb.ones((4, 16)))
    np.testing.assert_allclose(nb.layer_norm(nb.ones((8, 16)), nb.ones((1, 16))).numpy(), np.zeros((8, 16)))


@pytest.mark.parametrize("a,b,said", [((3,), (4,), r"operand 0 \(shape \(3,\)\) dim 0 has size 3, operand 1 \(shape "
                                                   r"\(4,\)\) dim 0 has size 4"),
                                      ((2, 3), (4,), r"operand 0 \(shape \(2, 3\)\) dim 1 has size 3, operand 1 "
                                                     r"\(shape \(4,\)\) dim 0")])
def test_matmul_of_a_vector_names_the_vector_s_own_dim(a, b, said):
    with pytest.raises(ValueError):  # numpy refuses them too
        np.ones(a) @ np.ones(b)
    with pytest.raises(nb.ShardingError, match="matmul: contracted dims differ: " + said):
        nb.ones(a) @ nb.ones(b)


def test_a_fixed_spec_naming_an_unknown_axis_names_the_fixed_entry():
    cl = nb.Cluster(nb.Hardware.preset("h100-sxm-80gb"), nodes=1, devices_per_node=4)
    m = cl.mesh("m", (4,), ("dp",))
    o = nb.DimSpec([], is_open=True)
    p = {"w1": nb.abstract((8, 8)).shard(m, [o, o])}
    with pytest.raises(nb.ShardingError, match=r"""autoshard: fixed\["p\['w1'\]"\] = \['zz', None\]: .*unknown axis """
                                               r"'zz'; the mesh has axes \['dp'\]"):
        nb.autoshard(lambda p, x: (x @ p["w1"]).sum(), cl, p, nb.abstract((4, 8)).shard(m, [o, o]),
                     fixed={"p['w1']": ["zz", None]})
