"""nb.shard_map and nb.lax against jax.shard_map and jax.lax (8 CPU devices): the same per-device programs
give the same values, each collective shows in the comm log, and nb.jit compiles them to the same HLO
collectives."""

import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import nabla as nb  # noqa: E402
from nabla import DeviceMesh, ShardingError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import xla_harness as H  # noqa: E402

if len(jax.devices()) < 8:
    pytest.skip("needs 8 jax devices", allow_module_level=True)

from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

M = DeviceMesh("m", (2, 4), ("dp", "tp"))
JM = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
X = np.arange(64, dtype=np.float32).reshape(8, 8) / 7.0
W = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
X3 = np.arange(128, dtype=np.float32).reshape(8, 4, 4) / 7.0

# name -> (nabla per-device fn, jax per-device fn, in specs, out spec, inputs, expected kinds)
PROGRAMS = {
    "psum": (lambda x, w: nb.lax.psum(x @ w, "tp"), lambda x, w: jax.lax.psum(x @ w, "tp"),
             [["dp", "tp"], ["tp", None]], ["dp", None], (X, W), {"all_reduce": 1}),
    "pmax": (lambda x: nb.lax.pmax(x, ("dp", "tp")), lambda x: jax.lax.pmax(x, ("dp", "tp")),
             [["dp", "tp"]], [None, None], (X,), {"all_reduce": 1}),
    "all_gather": (lambda x: nb.lax.all_gather(x, "tp", axis=1, tiled=True),
                   lambda x: jax.lax.all_gather(x, "tp", axis=1, tiled=True),
                   [["dp", "tp"]], ["dp", None], (X,), {"all_gather": 1}),
    "all_gather_stack": (lambda x: nb.lax.all_gather(x, "dp", axis=0, tiled=False),
                         lambda x: jax.lax.all_gather(x, "dp", axis=0, tiled=False),
                         [["dp", None]], [None, None, None], (X,), {"all_gather": 1}),
    "psum_scatter": (lambda x: nb.lax.psum_scatter(x, "tp", scatter_dimension=1, tiled=True),
                     lambda x: jax.lax.psum_scatter(x, "tp", scatter_dimension=1, tiled=True),
                     [["dp", None]], ["dp", "tp"], (X,), {"reduce_scatter": 1}),
    "all_to_all": (lambda x: nb.lax.all_to_all(x, "tp", 1, 0, tiled=True),
                   lambda x: jax.lax.all_to_all(x, "tp", 1, 0, tiled=True),
                   [["tp", None]], [None, "tp"], (X,), {"all_to_all": 1}),
    "all_to_all_2axes": (lambda x: nb.lax.all_to_all(x, ("dp", "tp"), 0, 1, tiled=True),
                         lambda x: jax.lax.all_to_all(x, ("dp", "tp"), 0, 1, tiled=True),
                         [[None, ("dp", "tp")]], [("dp", "tp"), None], (X,), {"all_to_all": 1}),
    # JAX's defaults (tiled=False): all_gather stacks a new dim, psum_scatter and all_to_all take a dim of the
    # group's size away, and all_to_all stacks what it receives as a new dim at concat_axis
    "all_gather_default": (lambda x: nb.lax.all_gather(x, "tp", axis=1), lambda x: jax.lax.all_gather(x, "tp", axis=1),
                           [["dp", "tp"]], ["dp", None, None], (X,), {"all_gather": 1}),
    "psum_scatter_default": (lambda x: nb.lax.psum_scatter(x, "tp"), lambda x: jax.lax.psum_scatter(x, "tp"),
                             [["dp", None]], [("dp", "tp")], (X,), {"reduce_scatter": 1}),
    "all_to_all_default": (lambda x: nb.lax.all_to_all(x, "tp", 1, 2), lambda x: jax.lax.all_to_all(x, "tp", 1, 2),
                           [["tp", None, None]], ["tp", None, None], (X3,), {"all_to_all": 1}),
    "all_to_all_default_back": (lambda x: nb.lax.all_to_all(x, "tp", 2, 0),
                                lambda x: jax.lax.all_to_all(x, "tp", 2, 0),
                                [["tp", None, None]], ["tp", None, None], (X3,), {"all_to_all": 1}),
    "all_to_all_default_same": (lambda x: nb.lax.all_to_all(x, "tp", 1, 1),
                                lambda x: jax.lax.all_to_all(x, "tp", 1, 1),
                                [[None, None, "tp"]], [None, None, "tp"], (X3,), {"all_to_all": 1}),
    "all_to_all_default_2axes": (lambda x: nb.lax.all_to_all(x, ("dp", "tp"), 1, 0),
                                 lambda x: jax.lax.all_to_all(x, ("dp", "tp"), 1, 0),
                                 [[("dp", "tp"), None]], [None, ("dp", "tp")], (X,), {"all_to_all": 1}),
    "ppermute": (lambda x: nb.lax.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)]),
                 lambda x: jax.lax.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)]),
                 [["tp", None]], ["tp", None], (X,), {"collective_permute": 1}),
    "axis_index": (lambda x: x * 0 + nb.lax.axis_index(("dp", "tp")).astype("float32"),
                   lambda x: x * 0 + jax.lax.axis_index(("dp", "tp")).astype(np.float32),
                   [["dp", "tp"]], ["dp", "tp"], (X,), {}),
    "ring_matmul": (None, None, None, None, None, None),  # below
}


def _ring_nb(x, w):
    """A ring of ppermutes: each device multiplies the w block it holds, then passes it on."""
    acc = x[:, 0:2] @ w * 0.0
    blk = w
    idx = nb.lax.axis_index("tp")
    for step in range(4):
        acc = acc + x[:, 0:2] @ blk * (idx.astype("float32") + step)
        if step < 3:  # (a fourth pass would be dead code, which XLA drops)
            blk = nb.lax.ppermute(blk, "tp", [(i, (i + 1) % 4) for i in range(4)])
    return acc


def _ring_jax(x, w):
    acc = x[:, 0:2] @ w * 0.0
    blk = w
    idx = jax.lax.axis_index("tp")
    for step in range(4):
        acc = acc + x[:, 0:2] @ blk * (idx.astype(np.float32) + step)
        if step < 3:
            blk = jax.lax.ppermute(blk, "tp", [(i, (i + 1) % 4) for i in range(4)])
    return acc


PROGRAMS["ring_matmul"] = (_ring_nb, _ring_jax, [["dp", "tp"], [None, "tp"]], ["dp", "tp"],
                           (X, np.ones((2, 8), np.float32)), {"collective_permute": 3})


def _pspec(spec):
    return P(*[tuple(d) if isinstance(d, (tuple, list)) else d for d in spec])


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_shard_map_equals_jax_and_logs_its_collectives(name):
    fn, jfn, ins, out, args, kinds = PROGRAMS[name]
    want = jax.jit(jax.shard_map(jfn, mesh=JM, in_specs=tuple(_pspec(s) for s in ins), out_specs=_pspec(out),
                                 check_vma=False))(*args)
    prog = nb.shard_map(fn, M, ins, out)
    tensors = [nb.tensor(a) for a in args]
    with nb.comm_log() as log:
        got = prog(*tensors)
    assert got.shape == tuple(np.shape(want))
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert log.counts == kinds
    # nb.jit compiles the same per-device program: its HLO holds the logged collectives
    placed = [t.shard(M, s) for t, s in zip(tensors, ins)]
    jitted = nb.jit(prog)
    lowered = jitted.lower(*placed)
    np.testing.assert_allclose(jitted(*placed).numpy(), np.asarray(want), rtol=1e-5, atol=1e-5)
    hlo = sorted((c.kind, c.bytes) for c in H.collectives(lowered.as_text()))
    assert hlo == sorted((e.kind, e.bytes) for e in lowered.comm_log.events)


def test_errors_name_what_is_wrong():
    with pytest.raises(ShardingError, match="does not split evenly"):
        nb.shard_map(lambda x: x, M, [["tp", None]], ["tp", None])(nb.tensor(np.ones((6, 2))))
    with pytest.raises(ShardingError, match="differs across mesh axes"):
        nb.shard_map(lambda x: x, M, [["tp", None]], [None, None])(nb.tensor(np.ones((8, 2))))
    with pytest.raises(ShardingError, match="outside nb.shard_map"):
        nb.lax.axis_index("tp")
    with pytest.raises(ShardingError, match="per-device value"):
        nb.lax.psum(nb.tensor(np.ones(2)), "tp")
    # untiled (JAX's default), the scattered or split dim must be the group's size, as jax.lax requires
    with pytest.raises(ShardingError, match=r"psum_scatter: dim 1 of size 8 is not the 4 devices of \('tp',\)"):
        nb.shard_map(lambda x: nb.lax.psum_scatter(x, "tp", scatter_dimension=1), M, [["dp", None]],
                     ["dp", "tp"])(nb.tensor(X))
    with pytest.raises(ShardingError, match=r"all_to_all: split dim 1 of size 8 is not the 4 devices"):
        nb.shard_map(lambda x: nb.lax.all_to_all(x, "tp", 1, 0), M, [["tp", None]], [None, "tp"])(nb.tensor(X))
    with pytest.raises(ShardingError, match="global tensor inside shard_map"):
        g = nb.tensor(np.ones((8, 2))).shard(M, ["dp", None])
        nb.shard_map(lambda x: x + g, M, [["tp", None]], ["tp", None])(nb.tensor(np.ones((8, 2))))


# ---- gradients through shard_map: each collective's transpose, against jax.grad of jax.shard_map ------------

GRAD_EXTRA = {
    # psum of a value that does not vary along the axis multiplies it by the axis size: so does its transpose
    "psum_invariant": (lambda x: nb.lax.psum(x, "tp"), lambda x: jax.lax.psum(x, "tp"), [["dp", None]], ["dp", "tp"],
                       (X,)),
    "psum_scatter_varying": (lambda x: nb.lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True),
                             lambda x: jax.lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True),
                             [["dp", "tp"]], [("dp", "tp"), None], (X,)),
    # a cotangent varying along the gathered axis: the transpose is a reduce_scatter
    "all_gather_varying": (lambda x: nb.lax.all_gather(x, "tp", axis=1, tiled=True) * (
                               nb.lax.axis_index("tp").astype("float32") + 1.0),
                           lambda x: jax.lax.all_gather(x, "tp", axis=1, tiled=True) * (
                               jax.lax.axis_index("tp").astype(np.float32) + 1.0),
                           [["dp", "tp"]], ["dp", "tp"], (X,)),
    "ppermute_partial": (lambda x: nb.lax.ppermute(x, "tp", [(0, 2), (2, 3), (3, 0)]),
                         lambda x: jax.lax.ppermute(x, "tp", [(0, 2), (2, 3), (3, 0)]), [["tp", None]], ["tp", None],
                         (X,)),
    "replicated_in": (lambda x, w: x * w.sum(), lambda x, w: x * w.sum(), [["dp", "tp"], [None, None]], ["dp", "tp"],
                      (X, W)),
}


def _jax_all_to_all_untiled(x, axes, s, c):
    """jax.lax.all_to_all's untiled form as JAX builds it (a size-1 dim for the pieces, the tiled move, the split
    dim squeezed away): jax.grad of the untiled call itself fails when split_axis != concat_axis in this jax."""
    if s < c:
        c += 1
        x = jnp.expand_dims(x, c)
    elif s > c:
        x = jnp.expand_dims(x, c)
        s += 1
    y = jax.lax.all_to_all(x, axes, s, c, tiled=True)
    return y if s == c else jnp.squeeze(y, s)


for _name, (_s, _c) in {"all_to_all_default": (1, 2), "all_to_all_default_back": (2, 0),
                        "all_to_all_default_2axes": (1, 0)}.items():
    _fn, _, _ins, _out, _args, _ = PROGRAMS[_name]
    _axes = ("dp", "tp") if _name.endswith("2axes") else "tp"
    GRAD_EXTRA[_name] = (_fn, lambda x, a=_axes, s=_s, c=_c: _jax_all_to_all_untiled(x, a, s, c), _ins, _out, _args)
# the backward collectives of each: (kind, axes), the transposes of the forward ones
GRAD_KINDS = {"psum": [("all_reduce", ("dp",))], "all_gather": [], "all_gather_stack": [], "psum_scatter": [("all_gather", ("tp",))],
              "all_gather_default": [], "psum_scatter_default": [("all_gather", ("tp",))],
              "all_to_all_default": [("all_to_all", ("tp",))], "all_to_all_default_back": [("all_to_all", ("tp",))],
              "all_to_all_default_same": [("all_to_all", ("tp",))],
              "all_to_all_default_2axes": [("all_to_all", ("dp", "tp"))],
              "all_to_all": [("all_to_all", ("tp",))], "all_to_all_2axes": [("all_to_all", ("dp", "tp"))],
              "ppermute": [("collective_permute", ("tp",))], "axis_index": [],
              # w's blocks are used by every dp row: each hop's cotangent is summed over dp first (as jax does)
              "ring_matmul": [("collective_permute", ("tp",))] * 3 + [("all_reduce", ("dp",))] * 4, "psum_invariant": [("all_reduce", ("tp",))],
              "psum_scatter_varying": [("all_gather", ("tp",))],
              "all_gather_varying": [("reduce_scatter", ("tp",))], "ppermute_partial": [("collective_permute", ("tp",))],
              "replicated_in": [("all_reduce", ("dp", "tp"))]}


@pytest.mark.parametrize("name", sorted(set(PROGRAMS) - {"pmax"} | set(GRAD_EXTRA)))
def test_gradients_through_shard_map_equal_jax(name):
    fn, jfn, ins, out, args = {**PROGRAMS, **GRAD_EXTRA}[name][:5]
    jf = jax.shard_map(jfn, mesh=JM, in_specs=tuple(_pspec(s) for s in ins), out_specs=_pspec(out), check_vma=False)
    wt = np.random.default_rng(1).standard_normal(jax.eval_shape(jf, *args).shape).astype(np.float32)
    nums = tuple(range(len(args)))
    # compiled once: jax's eager shard_map runs each primitive of the body per device, seconds per program
    want = jax.jit(jax.grad(lambda *a: (jnp.sin(jf(*a)) * wt).sum(), argnums=nums))(*args)
    prog = nb.shard_map(fn, M, ins, out)
    placed = [nb.tensor(a).shard(M, s) for a, s in zip(args, ins)]
    with nb.comm_log() as log:
        got = nb.grad(lambda *a: (nb.sin(prog(*a)) * wt).sum(), argnums=nums)(*placed)
    for g, wg, p in zip(got, want, placed):
        assert g.sharding.layout() == p.sharding.layout()
        np.testing.assert_allclose(g.numpy(), np.asarray(wg), rtol=2e-4, atol=2e-4)
    bwd = [(e.kind, e.axes) for e in log.events if e.phase == "backward"]
    assert sorted(bwd) == sorted(GRAD_KINDS[name]), bwd


def test_second_order_through_shard_map_equals_jax():
    """A Hessian-vector product of a loss computed per device with psum and ppermute."""
    def body(x, w, lib):
        y = lib.lax.ppermute(lib.tanh(x @ w), "tp", [(i, (i + 1) % 4) for i in range(4)])
        return lib.lax.psum(y * y, "tp")

    v = np.random.default_rng(3).standard_normal((8, 4)).astype(np.float32)
    jf = jax.shard_map(lambda x, w: body(x, w, jnp_lib), mesh=JM, in_specs=(P("dp", "tp"), P("tp", None)),
                       out_specs=P("dp", None), check_vma=False)
    prog = nb.shard_map(lambda x, w: body(x, w, nb), M, [["dp", "tp"], ["tp", None]], ["dp", None])
    want = jax.jit(jax.grad(lambda w: (jax.grad(lambda u: jf(X, u).sum())(w) * v).sum()))(W)
    got = nb.grad(lambda w: (nb.grad(lambda u: prog(nb.tensor(X), u).sum())(w) * v).sum())(nb.tensor(W))
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-4, atol=1e-4)


class jnp_lib:  # jax spelled as nabla is, for code written once for both
    lax = jax.lax
    tanh = staticmethod(jnp.tanh)


def test_grad_inside_shard_map_and_bare_in_specs():
    """A per-device gradient (nb.grad inside fn), and in_specs given as one spec for a one-argument fn (JAX's
    pytree prefix): a PartitionSpec or a bare list."""
    def jbody(x):
        return jax.grad(lambda y: (jnp.sin(y) * jax.lax.axis_index("tp")).sum())(x)

    def body(x):
        return nb.grad(lambda y: (nb.sin(y) * nb.lax.axis_index("tp").astype("float32")).sum())(x)

    want = jax.jit(jax.shard_map(jbody, mesh=JM, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"), check_vma=False))(X)
    for spec in (P("dp", "tp"), ["dp", "tp"]):
        got = nb.shard_map(body, M, spec, ["dp", "tp"])(nb.tensor(X))
        np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-5, atol=1e-5)
    two = nb.shard_map(lambda a, b: a * b, M, P("dp", None), P("dp", None))(nb.tensor(X), nb.tensor(X))
    np.testing.assert_allclose(two.numpy(), X * X, rtol=1e-6)


def test_pmax_has_no_gradient_as_in_jax():
    prog = nb.shard_map(lambda x: nb.lax.pmax(x, "tp"), M, [["dp", "tp"]], ["dp", None])
    with pytest.raises(ShardingError, match="pmax"):
        nb.grad(lambda x: prog(x).sum())(nb.tensor(X))


def test_a_bad_spec_names_which_spec_of_shard_map():
    m = nb.DeviceMesh("m_sm", (2, 4), ("dp", "tp"))
    x = nb.ones((8, 8)).shard(m, ["dp", None])
    with pytest.raises(ShardingError, match=r"shard_map: out_specs\[0\] \['dp', 'dp'\]: .*'dp' .* used twice"):
        nb.shard_map(lambda b: b, m, in_specs=[["dp", None]], out_specs=["dp", "dp"])(x)
    with pytest.raises(ShardingError, match=r"shard_map: in_specs\[0\]"):
        nb.shard_map(lambda b: b, m, in_specs=[["dp", "dp"]], out_specs=["dp", None])(x)


@pytest.mark.parametrize("fn, ins, outs, args, message", [
    (lambda x: (x, 2 * x), [["tp", None]], ["tp", None], 1,
     r"fn returned 2 outputs but out_specs holds 1 spec \(\['tp', None\]\)"),
    (lambda x: (x, 2 * x), [["tp", None]], [["tp", None]] * 3, 1, "fn returned 2 outputs but out_specs holds 3 specs"),
    (lambda x: x, [["tp", None]], [["tp", None]] * 2, 1, "fn returned 1 output but out_specs holds 2 specs"),
    (lambda x, y: x, [["tp", None]] * 3, ["tp", None], 2, "fn was called with 2 arguments but in_specs holds 3 specs"),
    (lambda x, y: x, [["tp", None]], ["tp", None], 2, "fn was called with 2 arguments but in_specs holds 1 spec"),
])
def test_spec_counts_that_differ_are_named(fn, ins, outs, args, message):
    with pytest.raises(ShardingError, match=message):
        nb.shard_map(fn, M, ins, outs)(*[nb.tensor(X)] * args)


def test_a_list_of_out_specs_gives_each_output_its_own():
    got = nb.shard_map(lambda x: (x, nb.lax.psum(x, "tp")), M, [["tp", None]], [["tp", None], [None, None]])(
        nb.tensor(X))
    np.testing.assert_allclose(got[0].numpy(), X)
    np.testing.assert_allclose(got[1].numpy(), X.reshape(4, 2, 8).sum(0), rtol=1e-6)


def test_one_partition_spec_serves_every_output_as_in_jax():
    """jax.shard_map takes out_specs as a pytree prefix of the outputs: one PartitionSpec applies to each."""
    P = pytest.importorskip("jax.sharding").PartitionSpec
    a, b = nb.shard_map(lambda x: (x * 2, x + 1), M, P("tp", None), P("tp", None))(nb.tensor(X))
    np.testing.assert_allclose(a.numpy(), X * 2)
    np.testing.assert_allclose(b.numpy(), X + 1)
    assert a.sharding == b.sharding
