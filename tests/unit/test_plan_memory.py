"""nb.memory_log: bytes per device by kind, counted by hand for data, fully sharded and tensor parallel training
steps, eager and on nb.abstract inputs alike."""

import numpy as np
import pytest

import nabla as nb

F32 = 4


def _tensors(abstract: bool, mesh, specs: dict, shapes: dict):
    out = {}
    for i, (name, spec) in enumerate(specs.items()):
        shape = shapes[name]
        t = nb.abstract(shape) if abstract else nb.tensor(np.random.default_rng(i).standard_normal(shape)
                                                           .astype(np.float32))
        out[name] = t.shard(mesh, spec)
    return out


@pytest.mark.parametrize("abstract", [False, True])
def test_data_parallel_step_holds_the_whole_parameter_its_gradient_and_adam_state(abstract):
    mesh = nb.DeviceMesh("m", (4,), ("dp",))
    t = _tensors(abstract, mesh, {"w": [None, None], "x": ["dp", None]}, {"w": (64, 32), "x": (16, 64)})
    opt = nb.optim.Adam(1e-3)
    with nb.memory_log() as mem:
        state = opt.init(t["w"])
        g = nb.grad(lambda w, x: (x @ w).sum())(t["w"], t["x"])
        w2, state2 = opt.update(g, state, t["w"])
    whole = 64 * 32 * F32  # every device holds the whole parameter
    assert set(mem.peak) == {0, 1, 2, 3}
    by = mem.by_kind
    assert by["params"][0] == 2 * whole  # the parameter, and the updated one returned beside it
    assert by["grads"][0] == whole
    assert by["optimizer"][0] == 4 * whole  # mu and nu, and the updated ones (the step count is a host value)
    assert by["comm"][0] == 0  # the gradient's sum over dp is made in place
    # kept for the backward pass: the batch block (4 rows), x @ w (4 x 32) and the loss's summand
    assert by["activations"][0] == 4 * 64 * F32 + 4 * 32 * F32 + F32
    assert mem.peak[0] >= 7 * whole and mem.live[0] >= 2 * whole + 4 * whole


@pytest.mark.parametrize("abstract", [False, True])
def test_fully_sharded_step_holds_a_quarter_and_gathers_the_rest_only_while_it_is_used(abstract):
    mesh = nb.DeviceMesh("m", (4,), ("dp",))
    t = _tensors(abstract, mesh, {"w": ["dp", None], "x": ["dp", None]}, {"w": (64, 32), "x": (16, 64)})
    opt = nb.optim.Adam(1e-3)
    with nb.memory_log() as mem:
        state = opt.init(t["w"])
        g = nb.grad(lambda w, x: (x @ w).sum())(t["w"], t["x"])
        opt.update(g, state, t["w"])
    quarter = 16 * 32 * F32
    by = mem.by_kind
    assert by["params"][0] == 2 * quarter and by["grads"][0] == quarter and by["optimizer"][0] == 4 * quarter
    # the forward all_gather of w: the whole 64 x 32 parameter is a buffer while the matmul runs
    assert by["comm"][0] == 64 * 32 * F32


def test_tensor_parallel_mlp_holds_each_devices_columns_and_rows():
    mesh = nb.DeviceMesh("m", (4,), ("tp",))
    w1 = nb.abstract((64, 32)).shard(mesh, [None, "tp"])
    w2 = nb.abstract((32, 64)).shard(mesh, ["tp", None])
    x = nb.abstract((8, 64)).shard(mesh, [None, None])
    with nb.memory_log() as mem:
        nb.grad(lambda w1, w2, x: (nb.relu(x @ w1) @ w2).sum(), argnums=(0, 1))(w1, w2, x)
    by = mem.by_kind
    assert by["params"][0] == 2 * 64 * 8 * F32  # a quarter of each: 64 x 8 columns, 8 x 64 rows
    assert by["grads"][0] == 2 * 64 * 8 * F32
    assert max(mem.peak.values()) == min(mem.peak.values())  # every device holds as much


def test_uneven_blocks_are_counted_per_device():
    mesh = nb.DeviceMesh("m", (4,), ("x",))
    with nb.memory_log() as mem:
        t = nb.abstract((5, 8)).shard(mesh, ["x", None])  # rows 2, 2, 1, 0 (the ceil rule)
        u = t * 2.0
    assert mem.peak == {0: 2 * 2 * 8 * F32, 1: 2 * 2 * 8 * F32, 2: 2 * 1 * 8 * F32, 3: 0}
    assert mem.live == mem.peak
    del t, u
    assert mem.live == {0: 0, 1: 0, 2: 0, 3: 0}  # the program dropped them: freed


def test_summary_names_every_kind():
    with nb.memory_log() as mem:
        nb.abstract((4, 4)).shard(nb.DeviceMesh("m", (2,), ("x",)), ["x", None])
    text = mem.summary()
    for kind in ("params", "grads", "optimizer", "activations", "temporaries", "comm", "peak"):
        assert kind in text


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_hold_the_model_state_the_zero_paper_counts(stage):
    """Rajbhandari et al. (SC'20), section 3 and figure 1: mixed-precision Adam holds 2 bytes of bf16/fp16
    parameters, 2 of gradients and 12 of optimizer state (a float32 master copy, momentum and variance) per
    parameter; stage 1 divides the 12 by the data-parallel degree N_d, stage 2 the gradients' 2 too, stage 3 all
    16. Here the stages are layouts of an ordinary program, run on nb.abstract inputs."""
    nd = 4
    mesh = nb.DeviceMesh("m", (nd,), ("dp",))
    psi = 1024 * 512  # parameters
    w = nb.abstract((1024, 512), "bfloat16").shard(mesh, ["dp", None] if stage == 3 else [None, None])
    x = nb.abstract((64, 1024), "bfloat16").shard(mesh, ["dp", None])
    opt = nb.optim.Adam(1e-3, master_dtype="float32")
    sharded = ["dp", None]
    with nb.memory_log() as mem:
        state = opt.init(w, specs=sharded if stage in (1, 2) else None)
        g = nb.grad(lambda w, x: (x @ w).sum(), grad_specs=sharded if stage == 2 else None)(w, x)
    by = mem.by_kind
    params, grads, optimizer = by["params"][0], by["grads"][0], by["optimizer"][0]
    assert params == (2 * psi if stage < 3 else 2 * psi // nd)
    assert grads == (2 * psi if stage < 2 else 2 * psi // nd)
    assert optimizer == (12 * psi if stage == 0 else 12 * psi // nd)
    want = {0: 16 * psi, 1: 4 * psi + 12 * psi // nd, 2: 2 * psi + 14 * psi // nd, 3: 16 * psi // nd}[stage]
    assert params + grads + optimizer == want
