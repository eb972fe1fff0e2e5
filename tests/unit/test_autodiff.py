"""The reverse-mode engine: pytrees, argnums, has_aux, vjp, seed 002's trace()/backward()/.grad, errors, and
the communication of training steps (DP x TP, FSDP, attention with heads on tp) asserted in bytes."""

import gc
import weakref

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh, ShardingError
from nabla.testing import assert_sharded_allclose
from nabla import trace
from nabla.trace import link_of

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy
R = np.random.default_rng(5)


def test_pytrees_argnums_and_aux():
    p = {"a": R.standard_normal(3), "b": [R.standard_normal((2, 3)), R.standard_normal(2)]}
    x = R.standard_normal(3)

    def f(p, x, scale):
        y = (p["b"][0] @ (p["a"] * x)) + p["b"][1]
        return (y * y).sum() * scale, y

    def jf(p, x, scale):
        y = (p["b"][0] @ (p["a"] * x)) + p["b"][1]
        return (y * y).sum() * scale

    tp = {"a": nb.tensor(p["a"]), "b": [nb.tensor(p["b"][0]), nb.tensor(p["b"][1])]}
    (value, aux), (gp, gx) = nb.value_and_grad(f, argnums=(0, 1), has_aux=True)(tp, nb.tensor(x), 2.0)
    wp, wx = jax.grad(jf, argnums=(0, 1))(p, x, 2.0)
    np.testing.assert_allclose(value.numpy(), jf(p, x, 2.0))
    assert isinstance(aux, nb.Tensor) and aux.shape == (2,)
    assert isinstance(gp, dict) and isinstance(gp["b"], list)
    np.testing.assert_allclose(gp["a"].numpy(), wp["a"])
    np.testing.assert_allclose(gp["b"][0].numpy(), wp["b"][0])
    np.testing.assert_allclose(gp["b"][1].numpy(), wp["b"][1])
    np.testing.assert_allclose(gx.numpy(), wx)
    g_only, aux2 = nb.grad(f, has_aux=True)(tp, nb.tensor(x), 2.0)
    np.testing.assert_allclose(g_only["a"].numpy(), wp["a"])


def test_vjp_with_a_cotangent_and_unused_inputs():
    x, y = R.standard_normal((3, 4)), R.standard_normal(4)
    out, fn = nb.vjp(lambda a, b: nb.tanh(a) * 2.0, nb.tensor(x), nb.tensor(y))
    ct = R.standard_normal((3, 4))
    gx, gy = fn(nb.tensor(ct))
    _, jfn = jax.vjp(lambda a, b: jnp.tanh(a) * 2.0, x, y)
    wx, wy = jfn(ct)
    np.testing.assert_allclose(gx.numpy(), wx)
    np.testing.assert_array_equal(gy.numpy(), np.zeros(4))  # unused: zeros of the primal's shape
    assert link_of(out) is None  # the returned value records nothing further


def test_seed_002_spelling_trace_backward_grad():
    mesh = DeviceMesh("m", (2,), ("x",))
    w = nb.tensor(R.standard_normal((4, 3))).shard(mesh, ["x", None]).trace()
    b = nb.tensor(R.standard_normal(3)).trace()
    loss = ((nb.tensor(R.standard_normal((5, 4))) @ w + b) ** 2).mean()
    loss.backward()
    assert w.grad.sharding.layout() == w.sharding.layout() and b.grad.sharding is None
    loss2 = ((nb.tensor(np.ones((5, 4))) @ w) ** 2).sum()
    first = w.grad.numpy().copy()
    loss2.backward()  # accumulates, as PyTorch does
    want = jax.grad(lambda v: ((jnp.ones((5, 4)) @ v) ** 2).sum())(w.numpy())
    np.testing.assert_allclose(w.grad.numpy(), first + np.asarray(want))


def test_errors_are_clear():
    with pytest.raises(ShardingError, match="scalar"):
        nb.grad(lambda t: t * 2.0)(nb.tensor(np.ones(3)))
    with pytest.raises(ShardingError, match="float or complex"):
        nb.grad(lambda t: t.sum())(nb.tensor(np.arange(3)))
    with pytest.raises(ShardingError, match="does not depend"):
        nb.tensor(np.ones(3)).sum().backward()
    with pytest.raises(ShardingError, match="argnums"):
        nb.grad(lambda t: t.sum(), argnums=3)(nb.tensor(np.ones(3)))


@pytest.mark.parametrize("argnums", [(0, 0), (1, -1), (0, 1, 0)])
def test_repeated_argnums_are_refused(argnums):
    """jax.grad fails on repeated argnums (an internal TypeError); a silently wrong first gradient is worse."""
    a, b = nb.tensor(np.array([1.0, 2.0])), nb.tensor(np.array([3.0, 4.0]))
    with pytest.raises(ShardingError, match="more than once"):
        nb.grad(lambda x, y: (x * y * y).sum(), argnums=argnums)(a, b)
    with pytest.raises(Exception):
        jax.grad(lambda x, y: (x * y * y).sum(), argnums=argnums)(a.numpy(), b.numpy())
    ga, gb = nb.grad(lambda x, y: (x * y * y).sum(), argnums=(1, 0))(a, b)  # distinct, any order: fine
    np.testing.assert_allclose(ga.numpy(), 2 * a.numpy() * b.numpy())
    np.testing.assert_allclose(gb.numpy(), b.numpy() ** 2)


# ---- complex values and the points where jax picks a derivative ---------------------------------------------


def test_complex_inputs_equal_jax():
    """A real loss of complex inputs: jax's convention (for |z|: conj(z) / |z|, 0 at 0), sharded."""
    mesh = DeviceMesh("m", (2,), ("x",))
    z = R.standard_normal((4, 3)) + 1j * R.standard_normal((4, 3))
    z[0, 0] = 0
    m = R.standard_normal((3, 3))
    cases = [(lambda t: nb.abs(t).sum(), lambda t: jnp.abs(t).sum()),
             (lambda t: (nb.abs(nb.exp(t) * t + nb.sin(t) @ m) ** 2).mean(),
              lambda t: (jnp.abs(jnp.exp(t) * t + jnp.sin(t) @ m) ** 2).mean())]
    for f, jf in cases:
        t = nb.tensor(z).shard(mesh, ["x", None])
        g = nb.grad(f)(t)
        assert g.dtype == z.dtype and g.sharding.layout() == t.sharding.layout()
        assert_sharded_allclose(g, np.asarray(jax.grad(jf)(z)), rtol=1e-12, atol=1e-12)


def test_grad_of_a_complex_or_integer_output_is_refused_as_in_jax():
    z = nb.tensor(np.array([1.0 + 1.0j, 2.0]))
    with pytest.raises(ShardingError, match="holomorphic"):
        nb.grad(lambda t: (t * t).sum())(z)
    with pytest.raises(TypeError, match="holomorphic"):
        jax.grad(lambda t: (t * t).sum())(z.numpy())
    with pytest.raises(ShardingError, match="integer outputs"):
        nb.grad(lambda t: (t * 2.0).sum().astype("int64"))(nb.tensor(np.ones(2)))
    out, fn = nb.vjp(lambda t: t * t, z)  # the vjp itself is defined, as in jax
    want = jax.vjp(lambda t: t * t, z.numpy())[1](np.ones(2, complex))[0]
    np.testing.assert_allclose(fn(nb.tensor(np.ones(2, complex)))[0].numpy(), want)


def test_derivatives_at_zero_match_jax():
    """|x| at 0 and -0: 1; x ** 0.0 at 0: nan (0 * 0**-1); x ** 0 (an integer power) at 0: 0; d(a ** b)/db
    at a == 0: 0 (log taken of 1 there)."""
    x = np.array([0.0, -0.0, 1.5, -2.0])
    b = np.array([0.0, -1.0, 2.0, 0.5])
    cases = [(lambda t: nb.abs(t), jnp.abs, x), (lambda t: t ** 0.0, lambda t: t ** 0.0, x),
             (lambda t: t ** 0, lambda t: t ** 0, x), (lambda t: t ** 0.5, lambda t: t ** 0.5, np.abs(x)),
             (lambda t: nb.tensor(np.abs(x)) ** t, lambda t: np.abs(x) ** t, b)]
    with np.errstate(divide="ignore", invalid="ignore"):
        for f, jf, v in cases:
            got = nb.grad(lambda t: f(t).sum())(nb.tensor(v)).numpy()
            # inf and nan where jax has them, and within an ulp elsewhere (pow is rounded differently by XLA)
            np.testing.assert_allclose(got, np.asarray(jax.grad(lambda t: jf(t).sum())(v)), rtol=2e-16, atol=0)


@pytest.mark.parametrize("rank", [2, 3, 11])
def test_weight_gradient_of_a_batched_matmul_equals_jax(rank):
    """A 2-D weight's gradient sums the batch dims in one contraction, whatever their number (11: more batch
    dims than the first 8 letters)."""
    rng = np.random.default_rng(rank)
    a = rng.standard_normal((2,) * (rank - 2) + (3, 4)).astype(np.float32)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    got = nb.grad(lambda w: ((nb.tensor(a) @ w) ** 2).sum())(nb.tensor(w)).numpy()
    want = np.asarray(jax.grad(lambda w: ((a @ w) ** 2).sum())(w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---- what the results hold on to, and the ways out of and into the trace ----------------------------------


def test_aux_is_returned_detached_and_frees_the_activations():
    import gc
    import weakref
    seen = []

    def f(w):
        h = nb.tanh(nb.tensor(np.ones((4, 3))) @ w)
        seen.append(weakref.ref(h))
        return (h * h).sum(), {"h2": h * 2.0, "n": 3}

    (g, aux) = nb.grad(f, has_aux=True)(nb.tensor(R.standard_normal((3, 2))))
    assert link_of(aux["h2"]) is None and aux["n"] == 3
    gc.collect()
    assert seen[0]() is None  # nothing returned keeps the forward's activations alive


def test_to_local_refuses_and_from_local_differentiates():
    mesh = DeviceMesh("m", (2, 2), ("x", "y"))
    x = R.standard_normal(4)
    w = R.standard_normal(4)
    with pytest.raises(ShardingError, match="to_local"):
        nb.grad(lambda t: nb.tensor(t.to_local(0)).sum())(nb.tensor(x).shard(mesh, ["x"]))
    leaf = nb.tensor(x).shard(mesh, ["x"]).trace()
    with pytest.raises(ShardingError, match="to_local"):
        (leaf * 2.0).to_local(0)
    assert isinstance(nb.tensor(x).shard(mesh, ["x"]).to_local(0), np.ndarray)  # untraced: as before

    def sharded(t):  # device (i, j) holds rows [2i, 2i+2); the y replicas are only checked against each other
        blocks = {d: t[2 * mesh.coords(d)[0]:2 * mesh.coords(d)[0] + 2] for d in mesh.devices}
        return nb.from_local(blocks, mesh, ["x"])

    def partial(t):  # y holds summands 0.25 t and 0.75 t
        return nb.from_local({d: t * (0.25, 0.75)[mesh.coords(d)[1]] for d in mesh.devices}, mesh, [None],
                             partial_axes=["y"])

    want = np.asarray(jax.grad(lambda t: (jnp.sin(t) * w).sum())(x))
    for build in (sharded, partial):
        g = nb.grad(lambda t: (nb.sin(build(t)) * w).sum())(nb.tensor(x))
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-12)


# ---- higher order: the backward pass inside an enclosing differentiation is recorded ----------------------


def test_grad_of_grad_equals_jax_on_sharded_inputs():
    mesh = DeviceMesh("m", (2, 2), ("x", "y"))
    a = R.standard_normal((4, 3))
    t = nb.tensor(a).shard(mesh, ["x", "y"])
    g2 = nb.grad(lambda u: nb.grad(lambda b: (b ** 3).sum())(u).sum())(t)
    want = jax.grad(lambda u: jax.grad(lambda b: (b ** 3).sum())(u).sum())(a)
    np.testing.assert_allclose(np.asarray(want), 6 * a)
    assert g2.sharding.layout() == t.sharding.layout()
    assert_sharded_allclose(g2, np.asarray(want), rtol=1e-12, atol=1e-12)
    # third order, and a gradient that closes over the outer variable
    g3 = nb.grad(lambda u: nb.grad(lambda v: nb.grad(lambda b: (nb.sin(b) * b).sum())(v).sum())(u).sum())(t)
    w3 = jax.grad(lambda u: jax.grad(lambda v: jax.grad(lambda b: (jnp.sin(b) * b).sum())(v).sum())(u).sum())(a)
    assert_sharded_allclose(g3, np.asarray(w3), rtol=1e-12, atol=1e-12)
    c = R.standard_normal((4, 3))
    gc = nb.grad(lambda u: nb.grad(lambda b: (nb.tanh(u * b) * b).sum())(nb.tensor(c)).sum())(t)
    wc = jax.grad(lambda u: jax.grad(lambda b: (jnp.tanh(u * b) * b).sum())(c).sum())(a)
    assert_sharded_allclose(gc, np.asarray(wc), rtol=1e-12, atol=1e-12)
    # value_and_grad's value stays differentiable inside an outer grad
    gv = nb.grad(lambda u: sum(nb.value_and_grad(lambda b: (nb.exp(b) * b).sum())(u)[1].sum() * k
                               for k in (1.0,)) + nb.value_and_grad(lambda b: (b * b).sum())(u)[0])(t)
    wv = jax.grad(lambda u: jax.grad(lambda b: (jnp.exp(b) * b).sum())(u).sum() + (u * u).sum())(a)
    assert_sharded_allclose(gv, np.asarray(wv), rtol=1e-12, atol=1e-12)


def test_hessian_vector_product_of_a_sharded_mlp_equals_jax():
    """HVP (grad of <grad, v>) of a DP x TP MLP loss with respect to both weights."""
    mesh = DeviceMesh("m", (2, 2), ("dp", "tp"))
    r = np.random.default_rng(9)
    p = {"w1": r.standard_normal((6, 8)), "w2": r.standard_normal((8, 3))}
    x, y = r.standard_normal((4, 6)), r.standard_normal((4, 3))
    v = {"w1": r.standard_normal((6, 8)), "w2": r.standard_normal((8, 3))}
    tp = {"w1": nb.tensor(p["w1"]).shard(mesh, [None, "tp"]), "w2": nb.tensor(p["w2"]).shard(mesh, ["tp", None])}
    tx, ty = nb.tensor(x).shard(mesh, ["dp", None]), nb.tensor(y).shard(mesh, ["dp", None])

    def loss(p, x, y):
        return ((nb.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    def jloss(p, x, y):
        return ((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    hvp = nb.grad(lambda q: sum((g * v[k]).sum() for k, g in nb.grad(loss)(q, tx, ty).items()))(tp)
    want = jax.grad(lambda q: sum((g * v[k]).sum() for k, g in jax.grad(jloss)(q, x, y).items()))(p)
    for k in p:
        assert hvp[k].sharding.layout() == tp[k].sharding.layout()
        assert_sharded_allclose(hvp[k], np.asarray(want[k]), rtol=1e-10, atol=1e-12)
    # the seed-002 spelling inside an outer grad is recorded too
    def inner(u):
        w = u.trace()
        (nb.sin(w) ** 2).sum().backward()
        return (w.grad * nb.tensor(v["w1"])).sum()
    g = nb.grad(inner)(tp["w1"])
    want = jax.grad(lambda u: (jax.grad(lambda w: (jnp.sin(w) ** 2).sum())(u) * v["w1"]).sum())(p["w1"])
    assert_sharded_allclose(g, np.asarray(want), rtol=1e-10, atol=1e-12)


def test_a_recorded_grad_does_not_keep_its_tape_alive():
    """The tape is a side table: a link lives as long as its value. ``w.grad`` recorded inside an outer grad is made
    from ``w``, so through the table it would keep ``w`` (and its whole tape) alive for good; once the outer forward
    run ends it holds the same value unrecorded, and everything is freed (by reference counts alone)."""
    held = []

    def inner(u):
        w = u.trace()
        (nb.sin(w) ** 2).sum().backward()
        held.append(weakref.ref(w))
        return (w.grad * 3.0).sum()

    x = np.linspace(-1.0, 1.0, 6)
    g = nb.grad(inner)(nb.tensor(x))
    np.testing.assert_allclose(g.numpy(), 3 * 2 * np.cos(2 * x), rtol=1e-12)
    gc.collect()
    assert held[0]() is None


def test_a_copy_of_a_traced_tensor_is_differentiated_through():
    """The tape is keyed by the object: ``copy.copy``/``copy.deepcopy`` of a tensor inside a differentiated function
    is the same value under another object, linked as it is (Python's default protocol made an unlinked copy: its
    gradient was silently zero)."""
    import copy

    x = np.arange(4.0)
    for cp in (copy.copy, copy.deepcopy):
        g = nb.grad(lambda w: (cp(w * w) * 3.0).sum())(nb.tensor(x))
        np.testing.assert_allclose(g.numpy(), 6 * x)
    t = nb.tensor(x)
    assert link_of(copy.copy(t)) is None and copy.deepcopy(t).numpy().tolist() == x.tolist()


def test_a_cycle_through_a_link_is_collected():
    """A layer remembering its last output, checkpointed through a bound method: out -> its link -> the recompute's
    fn -> the layer -> out. With the link on the value the cycle was garbage once the layer was dropped."""
    seen = []

    class Layer:
        def __init__(self, w):
            self.w = w

        def forward(self, x, w):
            return nb.tanh(x @ w)

        def __call__(self, x):
            self.out = nb.checkpoint(self.forward)(x, self.w)
            seen.append(weakref.ref(self.out))
            return self.out

    x = nb.tensor(R.standard_normal((3, 4)))
    nb.grad(lambda w: Layer(w)(x).sum())(nb.tensor(R.standard_normal((4, 2))))
    gc.collect()
    assert seen[0]() is None


MESH22 = DeviceMesh("ck", (2, 2), ("dp", "tp"))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_gradient_inside_a_checkpoint_equals_jax(sharded):
    """nb.checkpoint's forward run records nothing; an nb.grad inside it records its own ops (it gave zeros), and
    what it reads from outside stays differentiable: gradients of it by the checkpoint's argument and by a tensor
    the checkpointed function closes over are jax's (second order, through the recompute)."""
    a, wv, c = R.standard_normal((4, 4)), R.standard_normal((4, 2)), R.standard_normal((4, 2))
    x0, w0 = nb.tensor(a), nb.tensor(wv)
    if sharded:
        x0, w0 = x0.shard(MESH22, ["dp", None]), w0.shard(MESH22, [None, "tp"])

    def inner(x):
        return nb.grad(lambda w: (nb.sin(nb.tanh(x @ w)) ** 2).sum())

    def jinner(x):
        return jax.grad(lambda w: (jnp.sin(jnp.tanh(x @ w)) ** 2).sum())

    got = nb.checkpoint(inner(x0))(w0)
    np.testing.assert_allclose(got.numpy(), np.asarray(jinner(a)(wv)), rtol=1e-10, atol=1e-12)
    by_w = nb.grad(lambda w: (nb.checkpoint(inner(x0))(w) * c).sum())(w0)
    want_w = jax.grad(lambda w: (jax.checkpoint(jinner(a))(w) * c).sum())(wv)
    np.testing.assert_allclose(by_w.numpy(), np.asarray(want_w), rtol=1e-9, atol=1e-11)
    by_x = nb.grad(lambda x: (nb.checkpoint(inner(x))(w0) * c).sum())(x0)
    want_x = jax.grad(lambda x: (jax.checkpoint(jinner(x))(wv) * c).sum())(a)
    np.testing.assert_allclose(by_x.numpy(), np.asarray(want_x), rtol=1e-9, atol=1e-11)


def _table_since(before: set) -> set:
    gc.collect()
    return set(trace._LINKS) - before


def test_a_finished_grad_leaves_no_links_on_what_the_user_kept():
    """Links made inside an outermost ``nb.grad`` are read by its backward pass alone (its results carry none): when
    it returns they are gone, also those of intermediates the user kept, of nested gradients (a Hessian-vector
    product), checkpoints and jitted calls; the gradient is jax's."""
    gc.collect()
    before = set(trace._LINKS)
    a, wv, v = R.standard_normal((3, 4)), R.standard_normal((4, 2)), R.standard_normal((4, 2))
    x, tv = nb.tensor(a), nb.tensor(v)
    kept = []
    layer = nb.checkpoint(lambda w: nb.tanh(x @ w))

    def inner(w):
        h = layer(w)
        kept.append(h)
        return (nb.sin(h) ** 2).sum()

    def hvp(w):
        g = nb.grad(inner)(w)
        kept.append(g)
        return (g * tv).sum()

    got = nb.grad(hvp)(nb.tensor(wv))
    jinner = lambda w: (jnp.sin(jnp.tanh(a @ w)) ** 2).sum()  # noqa: E731
    want = jax.grad(lambda w: (jax.grad(jinner)(w) * v).sum())(wv)
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-10, atol=1e-12)
    assert len(kept) == 2 and all(link_of(k) is None for k in kept)
    assert not _table_since(before)
    # a value kept from one call is a constant to the next (as jax would have it: no trace of the first call)
    got = nb.grad(lambda w: (nb.tanh(x @ w) * kept[0]).sum())(nb.tensor(wv))
    want = jax.grad(lambda w: (jnp.tanh(a @ w) * np.tanh(a @ wv)).sum())(wv)
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-10, atol=1e-12)
    assert not _table_since(before)


def test_a_vjp_keeps_its_links_while_its_vjp_fn_lives():
    """``nb.vjp``'s ``vjp_fn`` reads the links of its forward run, however late and however often it is called;
    they go with it."""
    gc.collect()
    before = set(trace._LINKS)
    a, wv = R.standard_normal((3, 4)), R.standard_normal((4, 2))
    x = nb.tensor(a)
    kept = []

    def f(w):
        h = nb.tanh(x @ w)
        kept.append(h)
        return (h * h).sum()

    out, back = nb.vjp(f, nb.tensor(wv))
    assert link_of(out) is None and link_of(kept[0]) is not None
    want = jax.grad(lambda w: (jnp.tanh(a @ w) ** 2).sum())(wv)
    for _ in range(2):
        g, = back(nb.tensor(1.0))
        np.testing.assert_allclose(g.numpy(), np.asarray(want), rtol=1e-10, atol=1e-12)
    del back, g
    assert link_of(kept[0]) is None and not _table_since(before)


def test_a_value_kept_from_a_grad_no_longer_holds_its_residuals():
    """The memory log counts what is held when it closes: of a gradient call whose intermediate ``a = sin(h)`` the
    user kept, ``x``, ``w``, the gradient and ``a`` (512 + 2,048 + 2,048 + 512 B a device), not ``h``, which
    only ``a``'s link kept for the backward pass."""
    mesh = DeviceMesh("m", (2, 2), ("dp", "tp"))
    x = nb.tensor(R.standard_normal((8, 16))).shard(mesh, ["dp", None])
    w = nb.tensor(R.standard_normal((16, 32))).shard(mesh, [None, "tp"])
    kept = []

    def f(w):
        a = nb.sin(nb.tanh(x @ w))
        kept.append(a)
        return (a * a).sum()

    with nb.memory_log() as mem:
        g = nb.grad(f)(w)
        gc.collect()
    assert g.shape == w.shape and set(mem.live.values()) == {512 + 2048 + 2048 + 512}


def test_the_eager_tape_reaches_through_values_kept_from_a_grad():
    """What depends on a ``.trace()``d tensor made outside any transform is the eager tape's: a value kept from
    inside ``nb.grad`` that depends on it keeps its link (a later ``.backward()`` reaches the leaf through it), one
    that does not loses it; statements before and after the grad make one tape."""
    av, xv = R.standard_normal(3), R.standard_normal(3)
    w = nb.tensor(av).trace()
    h = w * 2.0  # a statement of the eager tape
    kept = []

    def f(x):
        y = x * h
        z = x * 3.0
        kept.extend([y, z])
        return (y + z).sum()

    g = nb.grad(f)(nb.tensor(xv))
    np.testing.assert_allclose(g.numpy(), 2 * av + 3)
    assert link_of(g) is None and link_of(kept[0]) is not None and link_of(kept[1]) is None
    loss = kept[0].sum() + (h * h).sum()  # d/dw: 2 x + 8 w
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * xv + 8 * av, rtol=1e-12)
    (h * kept[1]).sum().backward()  # kept[1] = 3 x, a constant now: d/dw = 6 x
    np.testing.assert_allclose(w.grad.numpy(), 8 * xv + 8 * av, rtol=1e-12)


def test_a_cycle_through_a_link_under_vjp_or_jit_is_collected():
    """The layer keeping its last output, under ``nb.vjp`` (collected once its ``vjp_fn`` is gone) and as a jitted
    call inside ``nb.grad`` (the compiled call's link holds the jitted bound method)."""
    seen = []

    class Layer:
        def __init__(self, w, jit=False):
            self.w = w
            self.f = nb.jit(self.forward) if jit else nb.checkpoint(self.forward)

        def forward(self, x, w):
            return nb.tanh(x @ w)

        def __call__(self, x):
            self.out = self.f(x, self.w)
            seen.append(weakref.ref(self.out))
            return self.out

    x = nb.tensor(R.standard_normal((3, 4)))
    wv = R.standard_normal((4, 2))
    out, back = nb.vjp(lambda w: Layer(w)(x).sum(), nb.tensor(wv))
    back(nb.tensor(1.0))
    gc.collect()
    assert seen[0]() is not None  # vjp_fn can still be called
    del back
    gc.collect()
    assert seen[0]() is None
    g = nb.grad(lambda w: Layer(w, jit=True)(x).sum())(nb.tensor(wv))
    np.testing.assert_allclose(g.numpy(), np.asarray(jax.grad(lambda w: jnp.tanh(x.numpy() @ w).sum())(wv)),
                               rtol=1e-10, atol=1e-12)
    gc.collect()
    assert seen[1]() is None


def test_nested_transforms_match_jax_and_leave_no_links():
    """grad(vmap), grad(grad(jit)), vmap(grad), jit(grad) and a ``.backward()`` inside ``nb.grad`` give jax's
    gradients, and once they return (and the jitted function is dropped) no link of theirs is left."""
    gc.collect()
    before = set(trace._LINKS)
    a, wv, xs = R.standard_normal((3, 4)), R.standard_normal((4, 2)), R.standard_normal((5, 3, 4))
    x, w, txs = nb.tensor(a), nb.tensor(wv), nb.tensor(xs)
    f = lambda w, xi: (nb.tanh(xi @ w) ** 2).sum()  # noqa: E731
    jf = lambda w, xi: (jnp.tanh(xi @ w) ** 2).sum()  # noqa: E731
    jfn = nb.jit(f)
    cases = [
        (nb.grad(lambda w: nb.vmap(lambda xi: f(w, xi))(txs).sum())(w),
         jax.grad(lambda w: jax.vmap(lambda xi: jf(w, xi))(xs).sum())(wv)),
        (nb.grad(lambda w: (nb.grad(lambda v: jfn(v, x))(w) ** 2).sum())(w),
         jax.grad(lambda w: (jax.grad(jf)(w, a) ** 2).sum())(wv)),
        (nb.vmap(nb.grad(f), (None, 0))(w, txs), jax.vmap(jax.grad(jf), (None, 0))(wv, xs)),
        (nb.jit(nb.grad(f))(w, x), jax.grad(jf)(wv, a)),
    ]

    def inner(v):
        u = v.trace()
        (nb.sin(u * x[:, :2].sum()) ** 2).sum().backward()
        return (u.grad * v).sum()

    cases.append((nb.grad(inner)(w), jax.grad(
        lambda v: (jax.grad(lambda u: (jnp.sin(u * a[:, :2].sum()) ** 2).sum())(v) * v).sum())(wv)))
    for got, want in cases:
        np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-10, atol=1e-12)
    del jfn, cases
    assert not _table_since(before)


def test_gradients_outside_any_differentiation_record_nothing():
    """A top-level gradient, value and vjp output carry no trace (nothing keeps the activations alive)."""
    t = nb.tensor(R.standard_normal(3))
    value, g = nb.value_and_grad(lambda b: (nb.exp(b) * b).sum())(t)
    assert link_of(value) is None and link_of(g) is None


# ---- communication of training steps, in bytes ----------------------------------------------------------


def _mlp(mesh):
    params = {"w1": nb.random.normal((16, 32)).shard(mesh, [None, "tp"]),
              "w2": nb.random.normal((32, 4), seed=1).shard(mesh, ["tp", None])}
    x = nb.random.normal((8, 16), seed=2).shard(mesh, ["dp", None])
    y = nb.random.normal((8, 4), seed=3).shard(mesh, ["dp", None])
    return params, x, y


def _mlp_loss(p, x, y):
    return ((nb.relu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()


def test_dp_tp_mlp_step_communication():
    """Forward: one all_reduce over tp of the [4, 4] activation (2*3/4*64 = 96 B). Backward: one all_reduce
    over dp of each parameter's local block (w1's [16, 8]: 512 B -> 512 B; w2's [8, 4]: 128 B -> 128 B), and
    nothing gathered."""
    mesh = DeviceMesh("m", (2, 4), ("dp", "tp"))
    params, x, y = _mlp(mesh)
    with nb.comm_log() as log:
        value, grads = nb.value_and_grad(_mlp_loss)(params, x, y)
    fwd = [(e.kind, e.axes, e.bytes) for e in log.events if e.phase == "forward"]
    bwd = sorted((e.kind, e.axes, e.bytes) for e in log.events if e.phase == "backward")
    assert fwd == [("all_reduce", ("tp",), 96)]
    assert bwd == [("all_reduce", ("dp",), 128), ("all_reduce", ("dp",), 512)]
    jp = {k: v.numpy() for k, v in params.items()}
    want = jax.grad(lambda p, a, b: ((jax.nn.relu(a @ p["w1"]) @ p["w2"] - b) ** 2).mean())(jp, x.numpy(), y.numpy())
    for k in grads:
        assert grads[k].sharding.layout() == params[k].sharding.layout()
        assert_sharded_allclose(grads[k], np.asarray(want[k]), rtol=1e-4, atol=1e-5)


def test_fsdp_all_gathers_forward_and_reduce_scatters_backward():
    """FSDP on 4 devices, a two-layer MLP with x [dp, -] (64 x 16) and both weights [dp, -] (w1 16 x 32, w2 32 x 8,
    float32). Forward: exactly one all_gather per parameter (3 x its block: w1 3 x 512 B, w2 3 x 256 B), as
    jax.jit does. Backward: exactly one reduce_scatter per parameter gradient (3/4 of the whole gradient: w1
    1,536 B, w2 768 B), plus w2 gathered again for the input gradient of layer 2 (FSDP's backward re-gather;
    w1's is not needed, x has no gradient). Nothing else, on dp only."""
    mesh = DeviceMesh("f", (4,), ("dp",))
    x = nb.random.normal((64, 16)).shard(mesh, ["dp", None])
    params = {"w1": nb.random.normal((16, 32), seed=1).shard(mesh, ["dp", None]),
              "w2": nb.random.normal((32, 8), seed=2).shard(mesh, ["dp", None])}

    def loss(p):
        return (nb.tanh(nb.tanh(x @ p["w1"]) @ p["w2"]) ** 2).sum()

    with nb.comm_log() as log:
        grads = nb.grad(loss)(params)
    fwd = [(e.kind, e.axes, e.bytes) for e in log.events if e.phase == "forward"]
    bwd = sorted((e.kind, e.axes, e.bytes) for e in log.events if e.phase == "backward")
    assert fwd == [("all_gather", ("dp",), 3 * 512), ("all_gather", ("dp",), 3 * 256)]
    assert bwd == [("all_gather", ("dp",), 3 * 256),
                   ("reduce_scatter", ("dp",), 3 * 1024 // 4), ("reduce_scatter", ("dp",), 3 * 2048 // 4)]
    jp = {k: v.numpy() for k, v in params.items()}
    want = jax.grad(lambda p: (jnp.tanh(jnp.tanh(x.numpy() @ p["w1"]) @ p["w2"]) ** 2).sum())(jp)
    for k in params:
        assert grads[k].sharding.layout() == params[k].sharding.layout()
        assert_sharded_allclose(grads[k], np.asarray(want[k]), rtol=1e-4, atol=1e-4)


def test_attention_with_heads_on_tp_moves_nothing():
    """Heads sharded over tp, batch over dp: forward and backward of attention are local."""
    mesh = DeviceMesh("m", (2, 4), ("dp", "tp"))
    q = nb.random.normal((2, 4, 6, 8)).shard(mesh, ["dp", "tp", None, None])
    k = nb.random.normal((2, 4, 6, 8), seed=1).shard(mesh, ["dp", "tp", None, None])
    v = nb.random.normal((2, 4, 6, 8), seed=2).shard(mesh, ["dp", "tp", None, None])

    def attn(q, k, v):
        s = nb.softmax(nb.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(8.0), -1)
        return nb.einsum("bhqk,bhkd->bhqd", s, v)

    w = R.standard_normal((2, 4, 6, 8))
    with nb.comm_log() as log:
        grads = nb.grad(lambda q, k, v: (attn(q, k, v) * w).sum() * 1.0, argnums=(0, 1, 2))(q, k, v)
    assert log.events == []  # forward and backward: not one byte moves (the loss's pending sum is never needed)

    def jattn(q, k, v):
        s = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(8.0), -1)
        return (jnp.einsum("bhqk,bhkd->bhqd", s, v) * w).sum()

    want = jax.grad(jattn, (0, 1, 2))(q.numpy(), k.numpy(), v.numpy())
    for g, wg, t in zip(grads, want, (q, k, v)):
        assert g.sharding.layout() == t.sharding.layout()
        assert_sharded_allclose(g, np.asarray(wg), rtol=1e-4, atol=1e-5)


def test_backward_collectives_are_named_after_user_ops_and_parameters():
    """The summary names backward collectives as the forward's: the public op (softmax, not the max inside it),
    and a gradient's final sum after its parameter's path, never internal names (d max, add, with_sharding)."""
    import re
    mesh = DeviceMesh("m", (2, 4), ("dp", "tp"))
    params, x, y = _mlp(mesh)

    def loss(p, x, y):
        return ((nb.softmax(nb.relu(x @ p["w1"]) @ p["w2"], 0) - y) ** 2).mean()

    with nb.comm_log() as log:
        nb.value_and_grad(loss)(params, x, y)
    rows = [re.split(r"\s{2,}", line.strip()) for line in log.summary().splitlines()[2:-1]]
    table = {(r[0], r[1], r[2]): (int(r[3]), r[4].replace(",", ""), r[6]) for r in rows}
    assert table == {
        ("forward", "all_reduce", "tp"): (1, "96", "softmax"),  # the matmul's pending sum, made for softmax
        ("forward", "all_reduce", "dp"): (2, "32", "softmax"),  # softmax over the dp-sharded batch: max and sum
        ("backward", "reduce_scatter", "dp"): (1, "64", "softmax"),
        ("backward", "all_reduce", "dp"): (4, "672", "softmax, grad of p['w2'], grad of p['w1']"),  # as completed
    }, log.summary()
    by_op = {}
    for e in log.events:
        by_op.setdefault((e.phase, e.op), []).append((e.kind, e.bytes))
    assert by_op[("backward", "grad of p['w1']")] == [("all_reduce", 512)]  # 2 (k-1)/k x the [16, 8] block
    assert by_op[("backward", "grad of p['w2']")] == [("all_reduce", 128)]
    # a positional argument, a list of them, and the seed-002 spelling
    w = nb.random.normal((16, 32)).shard(mesh, [None, "tp"])
    with nb.comm_log() as log:
        nb.grad(lambda ws, x: (nb.tanh(x @ ws[0]) ** 2).sum())([w], x)
        leaf = w.trace()
        (nb.tanh(x @ leaf) ** 2).sum().backward()
    assert [e.op for e in log.events if e.phase == "backward"] == ["grad of ws[0]", "grad of a traced tensor"]


# forward move (kind, mesh shape, primal dims, primal partial axes, moved-to dims) and the cotangent's layout: a
# constant laid out as the cotangent of the moved value arrives (partial where the move summed or gathered)
MOVES = {
    "all_gather": ((4,), ["x", None], (), [None, None], ([None, None], ("x",))),
    "reduce_scatter": ((4,), [None, None], ("x",), ["x", None], (["x", None], ())),
    "all_reduce": ((4,), [None, None], ("x",), [None, None], ([None, None], ("x",))),
    "all_to_all": ((4,), ["x", None], (), [None, "x"], ([None, "x"], ())),
    "collective_permute": ((2, 2), [("x", "y"), None], (), [("y", "x"), None], ([("y", "x"), None], ())),
}


@pytest.mark.parametrize("kind", sorted(MOVES))
def test_backward_of_each_move_is_the_registry_transpose(kind):
    """For each collective kind, the backward of a forward move of that kind (``with_sharding``) is the move the
    collective registry names as its transpose (all_gather <-> reduce_scatter, all_reduce and all_to_all and
    collective_permute their own), with the bytes the ring formula gives for the transposed block."""
    from nabla.collectives import REGISTRY
    shape = MOVES[kind][0]
    mesh = DeviceMesh("m", shape, ("x", "y")[:len(shape)])
    dims, partial, moved, (ct_dims, ct_partial) = MOVES[kind][1:]
    value = R.standard_normal((8, 8))
    c = R.standard_normal((8, 8))
    x = nb.tensor(value).shard(mesh, dims, partial_axes=partial)
    const = nb.tensor(c).shard(mesh, ct_dims, partial_axes=ct_partial)
    with nb.comm_log() as log:
        g = nb.grad(lambda t: (t.with_sharding(mesh, moved) * const).sum())(x)
    fwd = [(e.kind, e.bytes) for e in log.events if e.phase == "forward"]
    bwd = [(e.kind, e.bytes) for e in log.events if e.phase == "backward"]
    k = 4
    whole, block = 8 * 8 * 8, 8 * 8 * 8 // k
    src_block = whole if partial or dims == [None, None] else block  # the block each device holds before the move
    assert fwd == [(kind, REGISTRY[kind].ring_bytes(src_block, k))]
    back = REGISTRY[kind].transpose
    ct_block = whole if ct_partial or ct_dims == [None, None] else block
    assert bwd == [(back, REGISTRY[back].ring_bytes(ct_block, k))]
    assert {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather"}.get(kind, kind) == back
    assert g.sharding.partial_axes == () and [d.axes for d in g.sharding.dim_specs] == [
        d.axes for d in x.sharding.dim_specs]
    np.testing.assert_allclose(g.numpy(), c)  # d sum(t * c) / dt


def test_backward_of_a_local_slice_moves_nothing_until_the_gradient_is_laid_out():
    """A local slice's transpose (the registry's local_pad) communicates nothing: the cotangent stays as sliced
    blocks, and only the gradient's final layout (replicated, as its primal) gathers them, once."""
    from nabla.collectives import REGISTRY
    assert REGISTRY["slice"].transpose == "local_pad" and REGISTRY["slice"].local
    mesh = DeviceMesh("m", (4,), ("x",))
    x = nb.tensor(R.standard_normal((8, 6))).shard(mesh, [None, None])
    c = R.standard_normal((8, 6))
    with nb.comm_log() as log:
        g = nb.grad(lambda t: (nb.exp(t.with_sharding(mesh, ["x", None])) * c).sum())(x)
    assert [(e.phase, e.kind, e.bytes, e.op) for e in log.events] == [
        ("backward", "all_gather", 3 * 2 * 6 * 8, "grad of t")]
    np.testing.assert_allclose(g.numpy(), np.exp(x.numpy()) * c)


def test_abstract_training_step_plans_1024_devices():
    """The comm plan of a whole training step (value_and_grad, then Adam's update) of a 24-layer Megatron MLP
    stack on 1,024 devices, without data: forward one tp all_reduce per layer; backward one tp all_reduce per
    layer (the input gradient) plus one dp all_reduce per parameter; the update none. Nothing along the way is
    concrete: no parameter, gradient or optimizer state holds data (opt.init used to build real zeros: 15 s
    and 1.5 GiB here), and the whole step allocates next to nothing."""
    import tracemalloc
    from nabla import optim

    mesh = DeviceMesh("big", (64, 16), ("dp", "tp"))
    layers = 24
    params = [{"w1": nb.abstract((1024, 4096)).shard(mesh, [None, "tp"]),
               "w2": nb.abstract((4096, 1024)).shard(mesh, ["tp", None])} for _ in range(layers)]
    x = nb.abstract((4096, 1024)).shard(mesh, ["dp", None])

    def loss(params, x):
        for p in params:
            x = nb.relu(x @ p["w1"]) @ p["w2"]
        return (x * x).sum()

    opt = optim.Adam(1e-3)
    tracemalloc.start()
    try:
        state = opt.init(params)
        with nb.comm_log() as log:
            value, grads = nb.value_and_grad(loss)(params, x)
        with nb.comm_log() as update_log:
            new_params, state = opt.update(grads, state, params)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"the abstract step allocated {peak / 2**20:.0f} MiB at its peak"
    trees = {"grads": grads, "params": new_params, "mu": state.mu, "nu": state.nu}
    for name, tree in trees.items():
        leaves = [t for layer in tree for t in layer.values()]
        assert len(leaves) == 2 * layers and all(t.is_abstract for t in leaves), name
        assert [t.sharding.layout() for t in leaves] == [p[k].sharding.layout() for p in params for k in p], name
    assert value.is_abstract and state.count.shape == ()
    assert update_log.events == []
    per_axis = {}
    for e in log.events:
        per_axis.setdefault((e.phase, e.kind, e.axes), []).append(e.bytes)
    act = 4096 // 64 * 1024 * 4  # a [64, 1024] float32 activation block per device
    assert per_axis == {
        ("forward", "all_reduce", ("tp",)): [2 * 15 * act // 16] * layers,
        ("backward", "all_reduce", ("tp",)): [2 * 15 * act // 16] * (layers - 1),  # layer 0's input: no gradient
        ("backward", "all_reduce", ("dp",)): [2 * 63 * (1024 * 256 * 4) // 64] * (2 * layers),
    }, {k: (len(v), sorted(set(v))) for k, v in per_axis.items()}


# ---- nb.checkpoint: the backward pass recomputes what the forward run did not keep ------------------------------


def _remat_case():
    mesh = nb.DeviceMesh("remat", (2, 2), ("dp", "tp"))
    r = np.random.default_rng(3)
    vals = [r.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 32), (32, 16))]
    x = nb.tensor(vals[0]).shard(mesh, ["dp", None])
    w1 = nb.tensor(vals[1]).shard(mesh, [None, "tp"])
    w2 = nb.tensor(vals[2]).shard(mesh, ["tp", None])
    return vals, (x, w1, w2)


@pytest.mark.parametrize("policy", ["full", "save_matmuls"])
def test_checkpoint_recomputes_in_the_backward_pass_and_gives_jax_s_gradients(policy):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    vals, (x, w1, w2) = _remat_case()

    def block(x, w1, w2, np_=nb):
        h = np_.tanh(x @ w1) @ w2  # the row-parallel matmul leaves a sum over tp: one all_reduce in the forward
        return h * h

    f = nb.checkpoint(block, policy)
    with nb.comm_log() as log:
        g1, g2 = nb.grad(lambda w1, w2, x: f(x, w1, w2).sum(), argnums=(0, 1))(w1, w2, x)
    ref = jax.grad(lambda a, b, c: jax.checkpoint(lambda c, a, b: block(c, a, b, jnp))(c, a, b).sum(),
                   argnums=(0, 1))(vals[1], vals[2], vals[0])
    np.testing.assert_allclose(g1.numpy(), ref[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g2.numpy(), ref[1], rtol=1e-4, atol=1e-4)
    again = [s.name for s in log.steps if s.phase == "recompute"]
    if policy == "full":  # the whole forward again, its all_reduce over tp included (h * h makes the sum first)
        assert again == ["matmul", "tanh", "matmul", "move", "multiply"]
        assert [e.kind for s in log.steps if s.phase == "recompute" for e in s.events] == ["all_reduce"]
    else:  # the matmuls' outputs were kept: only tanh and the product are recomputed, nothing is sent again
        assert again == ["tanh", "multiply"]
        assert [e for s in log.steps if s.phase == "recompute" for e in s.events] == []
    forward = [e.kind for s in log.steps if s.phase == "forward" for e in s.events]
    assert forward == ["all_reduce"]
    # each weight's data-parallel sum is made once, by the enclosing pass, named after it (not the recompute)
    assert sorted((s.user, e.kind, e.axes) for s in log.steps if s.phase == "backward" for e in s.events
                  if "dp" in e.axes) == [("grad of w1", "all_reduce", ("dp",)), ("grad of w2", "all_reduce", ("dp",))]


@pytest.mark.parametrize("policy", ["full", "save_matmuls"])
def test_checkpoint_differentiates_the_tensors_its_function_closes_over_as_jax_does(policy):
    """A block that reads its weights from the enclosing scope (as a layer's method does) still gives them
    gradients, and still recomputes: jax.checkpoint converts closures the same way."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    vals, (x, w1, w2) = _remat_case()

    def loss(w1, w2, x, np_=nb, ck=nb.checkpoint):
        block = ck(lambda h: np_.tanh(h @ w1) @ w2, policy) if np_ is nb else ck(lambda h: np_.tanh(h @ w1) @ w2)
        return (block(x) * block(x * 2.0)).sum()  # two calls: each closure is read twice

    with nb.comm_log() as log:
        got = nb.grad(loss, argnums=(0, 1, 2))(w1, w2, x)
    ref = jax.grad(lambda a, b, c: loss(a, b, c, jnp, jax.checkpoint), argnums=(0, 1, 2))(*vals[1:], vals[0])
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-4)
    again = [s.name for s in log.steps if s.phase == "recompute"]
    assert again.count("tanh") == 2  # each call's forward ran again for its gradient
    # two calls, one data-parallel sum per weight: the recomputes hand their pending sums to the enclosing pass
    assert sorted((s.user, e.kind, e.axes) for s in log.steps if s.phase == "backward" for e in s.events
                  if "dp" in e.axes) == [("grad of w1", "all_reduce", ("dp",)), ("grad of w2", "all_reduce", ("dp",))]
    # only w1, w2 (closed over) and x: the closure gave no gradient a second time
    w_only = nb.grad(lambda w1: nb.checkpoint(lambda h: (h @ w1).sum())(x))(w1)
    np.testing.assert_allclose(w_only.numpy(), np.broadcast_to(vals[0].sum(0)[:, None], (16, 32)), rtol=1e-4)


def test_checkpoint_outside_differentiation_is_a_plain_call():
    _, (x, w1, w2) = _remat_case()
    f = nb.checkpoint(lambda x, w: x @ w)
    with nb.comm_log() as log:
        y = f(x, w1)
    assert all(s.phase == "forward" for s in log.steps) and y.shape == (8, 32)
    with pytest.raises(nb.ShardingError, match="policy must be 'full', 'save_matmuls' or 'regather'"):
        nb.checkpoint(lambda x: x, policy="dots")


# ---- gradient buckets and gradient layouts --------------------------------------------------------------------


def _five_layers():
    mesh = nb.DeviceMesh("buckets", (4,), ("dp",))
    r = np.random.default_rng(5)
    ps = {f"w{i}": nb.tensor(r.standard_normal((32, 32)).astype(np.float32)).shard(mesh, [None, None])
          for i in range(5)}
    x = nb.tensor(r.standard_normal((8, 32)).astype(np.float32)).shard(mesh, ["dp", None])

    def loss(p, x):
        for i in range(5):
            x = nb.tanh(x @ p[f"w{i}"])
        return x.sum()
    return ps, x, loss


def test_gradient_buckets_fuse_the_data_parallel_sums_as_ddp_does():
    ps, x, loss = _five_layers()
    with nb.comm_log() as plain:
        want = nb.grad(loss)(ps, x)
    with nb.comm_log() as log:
        got = nb.grad(loss, bucket_bytes=8192)(ps, x)  # each gradient's block is 32 x 32 x 4 = 4,096 B
    for k in want:
        np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=1e-6, atol=1e-6)
        assert got[k].sharding == want[k].sharding
    ring = lambda block: 2 * 3 * block // 4  # noqa: E731 - an all_reduce over 4 devices sends 2(k-1)/k of a block
    assert [(e.kind, e.bytes) for e in plain.events] == [("all_reduce", ring(4096))] * 5
    # packed in the order the backward pass completes the gradients (the last layer's first, as DDP's hooks
    # fire), at most 8,192 B a bucket: (w4, w3), (w2, w1), (w0); each bucket summed as soon as it is full
    assert [(e.kind, e.bytes) for e in log.events] == [("all_reduce", ring(8192))] * 2 + [("all_reduce", ring(4096))]
    assert [e.op for e in log.events] == ["grad of p['w4'], p['w3'] (one bucket)", "grad of p['w2'], p['w1'] (one bucket)",
                                         "grad of p['w0'] (one bucket)"]
    backward = [s.name for s in log.steps if s.phase == "backward"]
    assert backward.index("bucket") < len(backward) - 3  # the first bucket is summed before the pass ends
    with nb.comm_log() as one:
        nb.grad(loss, bucket_bytes=1 << 20)(ps, x)
    assert [(e.kind, e.bytes) for e in one.events] == [("all_reduce", ring(5 * 4096))]
    with pytest.raises(ShardingError, match="bucket_bytes must be a positive int"):
        nb.grad(loss, bucket_bytes=0)


def test_gradients_summed_into_another_layout_are_reduce_scattered():
    """ZeRO stage 2: the gradient of a replicated weight lands sharded over dp, never whole on a device."""
    ps, x, loss = _five_layers()
    want = nb.grad(loss)(ps, x)
    with nb.comm_log() as log:
        got = nb.grad(loss, grad_specs={k: ["dp", None] for k in ps})(ps, x)
    assert {e.kind for e in log.events} == {"reduce_scatter"} and len(log.events) == 5
    assert all(e.bytes == 3 * 4096 // 4 for e in log.events)  # (k-1)/k of each 32 x 32 float32 gradient
    for k in want:
        assert got[k].sharding.dim_specs[0].axes == ("dp",)
        np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=1e-6, atol=1e-6)


def test_a_pending_cotangent_feeding_two_operands_is_summed_once_first():
    """The backward of a norm's scale inside a tensor-parallel block, as Megatron plans it: the activation
    gradient arrives as a sum pending over tp (from the column-parallel matmul's backward); the scale multiply
    hands it to two operands (the normalised input and the scale), so it is summed over tp once, and the
    scale's gradient is then summed over dp only (not a reduce_scatter + all_reduce + all_gather of its own)."""
    mesh = nb.DeviceMesh("mega", (2, 4), ("dp", "tp"))
    r = np.random.default_rng(7)
    B, D, F = 4, 16, 32
    x = nb.tensor(r.standard_normal((B, D)).astype(np.float32)).shard(mesh, ["dp", None])
    g = nb.tensor(r.standard_normal((D,)).astype(np.float32)).shard(mesh, [None])
    w1 = nb.tensor(r.standard_normal((D, F)).astype(np.float32)).shard(mesh, [None, "tp"])
    w2 = nb.tensor(r.standard_normal((F, D)).astype(np.float32)).shard(mesh, ["tp", None])

    def block(x, g, w1, w2, np_=nb):
        h = x / np_.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
        return (np_.tanh(h @ w1) @ w2).sum()

    with nb.comm_log() as log:
        grads = nb.grad(block, argnums=(0, 1, 2, 3))(x, g, w1, w2)
    back = [(e.kind, e.axes) for e in log.events if e.phase == "backward"]
    assert ("reduce_scatter", ("tp",)) not in back and ("all_gather", ("tp",)) not in back, back
    assert back.count(("all_reduce", ("tp",))) == 1  # the (B/dp, D) activation gradient, once
    assert sorted(e.op for e in log.events if e.axes == ("dp",)) == ["grad of g", "grad of w1", "grad of w2"]
    jax = pytest.importorskip("jax")
    ref = jax.grad(lambda *a: block(*a, np_=jax.numpy), argnums=(0, 1, 2, 3))(
        x.numpy(), g.numpy(), w1.numpy(), w2.numpy())
    for got, want in zip(grads, ref):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


def test_an_abstract_gradient_holds_no_data_not_even_its_seed_or_an_unused_parameter_s_zeros():
    """Planning a step without data must not build its arrays: the seed cotangent of an abstract loss is
    abstract (a concrete one made the whole backward pass hold 4096 x 4096 blocks: 33.6 MB here)."""
    import tracemalloc
    mesh = nb.DeviceMesh("abs", (4,), ("dp",))
    x = nb.abstract((4096, 4096), "bfloat16").shard(mesh, ["dp", None])
    w = nb.abstract((4096, 4096), "bfloat16").shard(mesh, [None, None])
    unused = nb.abstract((4096, 4096), "float32").shard(mesh, [None, "dp"])
    tracemalloc.start()
    try:
        loss, (gw, gu) = nb.value_and_grad(lambda w, u, x: (x @ w).astype("float32").sum(), argnums=(0, 1))(w, unused, x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 ** 20, peak  # one block of any of these is 8 MiB at least
    assert gw.is_abstract and gu.is_abstract and loss.is_abstract
    assert gu.sharding.layout() == unused.sharding.layout() and gw.dtype == np.dtype("bfloat16")


def test_a_finished_gradient_s_raw_sum_is_not_kept_until_the_backward_pass_ends():
    """FSDP-style: each weight's gradient is reduce_scattered as soon as the backward pass completes it; its raw
    (unsummed, full) block must die then, not wait in the pass's bookkeeping for the last layer. With 8 layers of
    a 256 x 256 float32 weight on 4 devices, a raw gradient is 256 KiB a device: the memory log's peak of
    temporaries holds about one layer's, not eight."""
    mesh = nb.DeviceMesh("fsdp", (4,), ("dp",))
    ws = [nb.abstract((256, 256), "float32").shard(mesh, ["dp", None]) for _ in range(8)]
    x = nb.abstract((64, 256), "float32").shard(mesh, ["dp", None])

    def loss(ws, x):
        for w in ws:
            x = nb.tanh(x @ w)
        return x.sum()

    with nb.memory_log() as mem:
        nb.grad(loss)(ws, x)
    raw = 256 * 256 * 4
    temporaries = max(mem.by_kind.get("temporaries", {}).values(), default=0)
    assert temporaries < 3 * raw, temporaries / raw  # was 8 raw blocks and more: every layer's, kept to the end


def _gpt(sp: bool, diff_input: bool = True):
    """A 2-layer GPT-style model (LayerNorm with scale and bias; a column-parallel projection, tanh, a row-parallel
    one in attention's place; a GELU MLP) on a 2 x 4 mesh, Megatron's layout, norms replicated; with
    ``sp`` the norms run on sequence shards (Korthikanti et al. 2022). Returns the comm log of one training step,
    the gradients taken with respect to the parameters and (``diff_input``) the model's input, as a residual
    stream's is."""
    mesh = nb.DeviceMesh("m", (2, 4), ("dp", "tp"))
    B, S, D, F = 4, 16, 32, 64
    ab = lambda shape, spec: nb.abstract(shape).shard(mesh, spec)  # noqa: E731
    layers = [{"ln1_g": ab((D,), [None]), "ln1_b": ab((D,), [None]), "wv": ab((D, D), [None, "tp"]),
               "wo": ab((D, D), ["tp", None]), "ln2_g": ab((D,), [None]), "ln2_b": ab((D,), [None]),
               "w1": ab((D, F), [None, "tp"]), "w2": ab((F, D), ["tp", None])} for _ in range(2)]
    stream = ["dp", "tp", None] if sp else ["dp", None, None]
    into = (lambda h: h.with_sharding(mesh, ["dp", None, None])) if sp else (lambda h: h)  # noqa: E731
    out = (lambda y: y.with_sharding(mesh, stream)) if sp else (lambda y: y)  # noqa: E731

    def loss(ps, x):
        for p in ps:
            h = into(nb.layer_norm(x, p["ln1_g"], p["ln1_b"]))
            x = x + out(nb.tanh(h @ p["wv"]) @ p["wo"])
            h = into(nb.layer_norm(x, p["ln2_g"], p["ln2_b"]))
            x = x + out(nb.gelu(h @ p["w1"]) @ p["w2"])
        return (x * x).mean()

    with nb.comm_log() as log:
        nb.grad(loss, (0, 1) if diff_input else 0)(layers, ab((B, S, D), stream))
    return log, B // 2 * S * D * 4


def test_layer_norm_bias_and_scale_gradients_reuse_the_input_gradient_s_tp_sum():
    """Megatron sums each norm's incoming gradient over tp once, for the norm's input gradient, and the scale's
    and the bias's gradients come from that sum (their own sums are over dp only). The scale's did (a cotangent
    fanned out by a product is summed first); the bias's took a reduce_scatter and an all_gather of its own over
    tp, 4 + 4 on this step: the add that applies it passed the pending sum on to the bias's reduction too."""
    log, act = _gpt(sp=False)
    back = [e for e in log.events if e.phase == "backward" and "tp" in e.axes]
    assert not [e for e in back if "ln" in e.op], [(e.kind, e.op) for e in back]
    sums = [e for e in back if e.kind == "all_reduce"]
    assert len(sums) == 4 and all(e.bytes == 2 * 3 * act // 4 for e in sums)  # one per norm: its input's gradient
    assert {e.kind for e in back} == {"all_reduce"}
    # the step, the input not differentiated (5 + 5 before): only the first norm, whose input gradient is
    # not made, sums its scale and bias over tp itself, two (D,) vectors rather than the (B, S, D) activation
    log, act = _gpt(sp=False, diff_input=False)
    back = [e for e in log.events if e.phase == "backward" and "tp" in e.axes]
    assert sorted((e.kind, e.op) for e in back if "ln" in e.op) == sorted(
        (k, f"grad of ps[0]['ln1_{p}']") for k in ("reduce_scatter", "all_gather") for p in "bg")
    assert [e.kind for e in back if "ln" not in e.op] == ["all_reduce"] * 3


def test_with_sequence_parallelism_a_norm_bias_is_summed_over_tp_once_like_its_scale():
    """With the norms on sequence shards each device holds part of every norm parameter's gradient: Megatron-SP
    all-reduces them over tp. A bias's gradient takes exactly what its scale's takes (one reduce_scatter and one
    all_gather of the (D,) vector), nothing more."""
    log, act = _gpt(sp=True)
    per = {}
    for e in log.events:
        if e.phase == "backward" and "tp" in e.axes and "ln" in e.op:
            per.setdefault(e.op, []).append(e.kind)
    assert len(per) == 8, per  # 2 layers x 2 norms x (scale, bias)
    assert all(sorted(k) == ["all_gather", "reduce_scatter"] for k in per.values()), per


def test_the_backward_pass_keeps_only_what_its_vjps_read():
    """Eager autodiff holds a forward value only when an op's VJP reads it (as jax.vjp and PyTorch do): between
    the forward pass and the backward pass, the blocks of x @ w (read by no VJP: the add keeps nothing) are gone,
    tanh's output's (read by its VJP) are alive, and the gradient equals jax's."""
    import gc
    import weakref
    mesh = DeviceMesh("m", (2,), ("x",))
    xv, wv = R.standard_normal((8, 4)), R.standard_normal((4, 4))
    x, w = nb.tensor(xv).shard(mesh, ["x", None]), nb.tensor(wv).shard(mesh, [None, None])
    refs = {}

    def f(w):
        y = x @ w
        t = nb.tanh(y + 1.0)
        refs["y"], refs["t"] = weakref.ref(y._data), weakref.ref(t._data)  # the stored blocks themselves
        return (t * 3.0).sum()

    out, pull = nb.vjp(f, w)
    gc.collect()
    assert refs["y"]() is None and refs["t"]() is not None
    g, = pull(nb.tensor(np.float64(1.0)))
    want = jax.grad(lambda w: (jnp.tanh(xv @ w + 1.0) * 3.0).sum())(wv)
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-6)


def test_the_sums_of_a_relayouts_and_a_placements_cotangents_are_named_as_their_steps():
    """A value made by ``with_sharding``, or a host value placed by ``shard``, used three times: the comm log names
    the sums of its cotangents after the step that made it ("gradient of with_sharding", as the relayout's own
    transpose is, and "gradient of shard"), not "relayout" and "place", names no step has."""
    mesh = DeviceMesh("m", (2, 4), ("dp", "tp"))
    x0, h0 = R.standard_normal((8, 16)), R.standard_normal((8, 16))
    x = nb.tensor(x0).shard(mesh, ["dp", "tp"])

    def loss(x, h):
        z = x.with_sharding(mesh, ["dp", None])  # an all_gather: transposed by a local cut
        p = (h * 1.0).shard(mesh, [None, "tp"])
        return (z * z).sum() + (z * 2.0).sum() + (p * p).sum() + (p * x).sum()

    with nb.comm_log() as log:
        gx, gh = nb.grad(loss, argnums=(0, 1))(x, nb.tensor(h0))
    backward = [(s.name, s.user) for s in log.steps if s.phase == "backward"]
    assert [n for n, u in backward if u == "gradient of with_sharding"] == ["add", "add", "with_sharding"], backward
    assert [n for n, u in backward if u == "gradient of shard"] == ["add", "add"], backward
    assert not any("relayout" in u or "place" in u for _, u in backward)
    assert_sharded_allclose(gx, 2 * x0 + 2 + h0, rtol=1e-12, atol=1e-12)
    assert_sharded_allclose(gh, 2 * h0 + x0, rtol=1e-12, atol=1e-12)
