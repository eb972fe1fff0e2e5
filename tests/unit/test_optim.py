"""nabla.optim against optax (the reference its API follows): the same updates, local (no communication),
shardings kept."""

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh, ShardingError, optim
from nabla.testing import assert_sharded_allclose

optax = pytest.importorskip("optax")
MESH = DeviceMesh("m", (2, 4), ("dp", "tp"))


def _params():
    r = np.random.default_rng(0)
    p = {"w": r.standard_normal((8, 12)).astype(np.float32), "b": [r.standard_normal(12).astype(np.float32)]}
    t = {"w": nb.tensor(p["w"]).shard(MESH, ["dp", "tp"]), "b": [nb.tensor(p["b"][0]).shard(MESH, ["tp"])]}
    return p, t


@pytest.mark.parametrize("ours,theirs", [(lambda: optim.SGD(0.1), lambda: optax.sgd(0.1)),
                                          (lambda: optim.SGD(0.05, momentum=0.9), lambda: optax.sgd(0.05, 0.9)),
                                          (lambda: optim.Adam(1e-2), lambda: optax.adam(1e-2)),
                                          (lambda: optim.Adam(3e-3, 0.8, 0.95, 1e-6),
                                           lambda: optax.adam(3e-3, 0.8, 0.95, 1e-6))],
                         ids=["sgd", "momentum", "adam", "adam_custom"])
def test_updates_equal_optax_and_stay_local(ours, theirs):
    p, t = _params()
    opt, ref = ours(), theirs()
    state, rstate = opt.init(t), ref.init(p)
    r = np.random.default_rng(1)
    for step in range(3):
        g = {"w": r.standard_normal((8, 12)).astype(np.float32), "b": [r.standard_normal(12).astype(np.float32)]}
        tg = {"w": nb.tensor(g["w"]).shard(MESH, ["dp", "tp"]), "b": [nb.tensor(g["b"][0]).shard(MESH, ["tp"])]}
        with nb.comm_log() as log:
            t, state = opt.update(tg, state, t)
        assert log.events == []  # updates are elementwise on identically laid out tensors
        upd, rstate = ref.update(g, rstate, p)
        p = optax.apply_updates(p, upd)
        assert t["w"].sharding.layout() == tg["w"].sharding.layout()
        assert_sharded_allclose(t["w"], np.asarray(p["w"]), rtol=1e-5, atol=1e-6)
        assert_sharded_allclose(t["b"][0], np.asarray(p["b"][0]), rtol=1e-5, atol=1e-6)


def test_mismatched_structures_are_refused():
    _, t = _params()
    with pytest.raises(nb.ShardingError, match="structures"):
        optim.SGD(0.1).update({"w": t["w"]}, optim.SGD(0.1).init(t), t)


def test_a_state_or_tree_that_does_not_fit_says_what_differs():
    p = {"a": nb.ones((2,))}
    with pytest.raises(ShardingError, match=r"Adam.update: the state is of type SGDState, not the AdamState"):
        optim.Adam(0.1).update(p, optim.SGD(0.1).init(p), p)
    with pytest.raises(ShardingError, match=r"SGD.update: the state is of type AdamState"):
        optim.SGD(0.1, momentum=0.9).update(p, optim.Adam(0.1).init(p), p)
    with pytest.raises(ShardingError, match=r"grads \{'a': <2>\}, params \{'b': <2>\}"):
        optim.Adam(0.1).update(p, optim.Adam(0.1).init({"b": nb.ones((2,))}), {"b": nb.ones((2,))})


def test_adam_with_a_float32_master_copy_equals_optax_on_float32_and_rounds_to_bfloat16():
    """Mixed precision as users write it: bfloat16 parameters and gradients; optax's Adam run on the float32
    master copy (its reference), whose rounding to bfloat16 is each step's new parameters."""
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    r = np.random.default_rng(1)
    w32 = r.standard_normal((8, 12)).astype(np.float32)
    grads = [r.standard_normal((8, 12)).astype(bf) for _ in range(3)]
    w = nb.tensor(w32.astype(bf)).shard(MESH, ["dp", "tp"])
    opt = optim.Adam(1e-2, master_dtype="float32")
    state = opt.init(w)
    assert state.master.dtype == np.float32 and state.mu.dtype == np.float32 and w.dtype == bf
    ref = optax.adam(1e-2)
    master = w32.astype(bf).astype(np.float32)  # the master copy starts as the parameters, widened
    rstate = ref.init(master)
    for g in grads:
        with nb.comm_log() as log:
            w, state = opt.update(nb.tensor(g).shard(MESH, ["dp", "tp"]), state, w)
        upd, rstate = ref.update(g.astype(np.float32), rstate, master)
        master = np.asarray(optax.apply_updates(master, upd))
        assert log.events == [] and w.dtype == bf  # local: the state is laid out as the parameters
        np.testing.assert_allclose(state.master.numpy(), master, rtol=1e-5, atol=1e-6)  # float32 rounding
        np.testing.assert_array_equal(w.numpy(), state.master.numpy().astype(bf))


def test_zero_stage_1_keeps_the_state_sharded_and_gathers_the_new_parameters():
    """The state laid out over dp (specs=), the parameters replicated: each device updates its quarter of the
    master copy and moments, and the new parameters are all_gathered (a replicated gradient is only cut)."""
    mesh = DeviceMesh("z", (4,), ("dp",))
    r = np.random.default_rng(2)
    w0 = r.standard_normal((16, 8)).astype(np.float32)
    g0 = r.standard_normal((16, 8)).astype(np.float32)
    w = nb.tensor(w0).shard(mesh, [None, None])
    opt = optim.Adam(1e-2, master_dtype="float32")
    state = opt.init(w, specs=["dp", None])
    assert state.mu.sharding.dim_specs[0].axes == ("dp",) and state.master.sharding == state.mu.sharding
    with nb.comm_log() as log:
        w1, state = opt.update(nb.tensor(g0).shard(mesh, [None, None]), state, w)
    assert [(e.kind, e.bytes) for e in log.events] == [("all_gather", 3 * 4 * 8 * 4)]  # (k-1) x a 4 x 8 block
    ref = optax.adam(1e-2)
    upd, _ = ref.update(g0, ref.init(w0), w0)
    np.testing.assert_allclose(w1.numpy(), np.asarray(optax.apply_updates(w0, upd)), rtol=1e-5, atol=1e-6)
    assert w1.sharding == w.sharding


@pytest.mark.parametrize("ours,theirs", [(lambda: optim.SGD(0.05, momentum=0.9), lambda: optax.sgd(0.05, 0.9)),
                                          (lambda: optim.Adam(0.1), lambda: optax.adam(0.1)),
                                          (lambda: optim.Adam(0.1, master_dtype="float32"), lambda: optax.adam(0.1))],
                         ids=["momentum", "adam", "adam_master"])
def test_dict_entries_are_matched_by_key_whatever_order_the_dicts_were_built_in(ours, theirs):
    """JAX's pytrees match dict entries by key (jax.tree_util sorts them): optax's state follows each parameter
    through dicts rebuilt in another order, and takes gradients in any order too. nabla's state went by position: a
    moment updated another parameter, silently."""
    r = np.random.default_rng(3)
    a0, b0 = np.float32(1.0) + r.standard_normal(4).astype(np.float32), r.standard_normal(4).astype(np.float32)
    ga, gb = r.standard_normal(4).astype(np.float32), 1e-2 * r.standard_normal(4).astype(np.float32)
    opt, ref = ours(), theirs()
    t = {"a": nb.tensor(a0).shard(MESH, ["tp"]), "b": nb.tensor(b0).shard(MESH, ["tp"])}
    state, rstate = opt.init(t), ref.init({"a": a0, "b": b0})
    p = {"a": a0, "b": b0}
    for order in (("a", "b"), ("b", "a"), ("b", "a")):  # the second and third steps with the dicts built b first
        g = {"a": ga, "b": gb}
        t, state = opt.update({k: nb.tensor(g[k]).shard(MESH, ["tp"]) for k in order[::-1]}, state,
                              {k: t[k] for k in order})  # (the gradients' dict in the other order again)
        upd, rstate = ref.update({k: g[k] for k in order}, rstate, {k: p[k] for k in order})
        p = optax.apply_updates({k: p[k] for k in order}, upd)
        for k in "ab":  # (float32 rounding at lr 0.1: 2e-6 apart in either order; swapped moments: 0.1 and more)
            assert_sharded_allclose(t[k], np.asarray(p[k]), rtol=1e-5, atol=1e-5)


def test_a_state_of_other_parameters_names_where_it_differs():
    p = {"v": nb.ones((2,))}
    with pytest.raises(ShardingError, match=r"Adam.update: the state's mu at params has keys 'v' where the "
                                            r"parameters have keys 'w'"):
        optim.Adam(0.1).update({"w": nb.ones((2,))}, optim.Adam(0.1).init(p), {"w": nb.ones((2,))})
    with pytest.raises(ShardingError, match=r"SGD.update: the state's momentum at params\['v'\] has shape \(2,\) "
                                            r"for a parameter of shape \(3,\)"):
        optim.SGD(0.1, momentum=0.9).update({"v": nb.ones((3,))}, optim.SGD(0.1, momentum=0.9).init(p),
                                            {"v": nb.ones((3,))})
    with pytest.raises(ShardingError, match=r"the state's nu at params is \[<2>, <2>\] where the parameters have 3 "
                                            r"entries"):
        q = [nb.ones((2,)), nb.ones((2,)), nb.ones((2,))]
        optim.Adam(0.1).update(q, optim.Adam(0.1).init({"x": nb.ones((2,))})._replace(mu=q, nu=q[:2]), q)
