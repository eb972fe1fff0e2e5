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
    # ZeRO's count (Rajbhandari et al. 2020, sec. 3.1): the update writes the new parameter and moments over the old
    # ones, in place as PyTorch's optimizers do (and JAX's with donated buffers)
    assert by["params"][0] == whole
    assert by["grads"][0] == whole
    assert by["optimizer"][0] == 2 * whole  # mu and nu (the step count is a host value)
    assert by["comm"][0] == 0  # the gradient's sum over dp is made in place
    # kept for the backward pass: what its VJPs read, as jax.vjp keeps it: the batch block x (4 rows), for
    # dw = x.T @ g (the sum keeps nothing; x @ w is read by no VJP)
    assert by["activations"][0] == 4 * 64 * F32
    assert mem.peak[0] >= 4 * whole and mem.live[0] >= 3 * whole


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
    assert by["params"][0] == quarter and by["grads"][0] == quarter and by["optimizer"][0] == 2 * quarter
    # the forward all_gather of w: the whole 64 x 32 parameter is a buffer while the matmul runs
    assert by["comm"][0] == 64 * 32 * F32


def test_tensor_parallel_mlp_holds_each_devices_columns_and_rows():
    mesh = nb.DeviceMesh("m", (4,), ("tp",))
    w1 = nb.abstract((64, 32)).shard(mesh, [None, "tp"])
    w2 = nb.abstract((32, 64)).shard(mesh, ["tp", None])
    x = nb.abstract((8, 64)).shard(mesh, [None, None])
    with nb.memory_log() as mem:
        grads = nb.grad(lambda w1, w2, x: (nb.relu(x @ w1) @ w2).sum(), argnums=(0, 1))(w1, w2, x)
    by = mem.by_kind
    assert len(grads) == 2  # (held when the log closes: both count at the end)
    assert by["params"][0] == 2 * 64 * 8 * F32  # a quarter of each: 64 x 8 columns, 8 x 64 rows
    assert by["grads"][0] == 2 * 64 * 8 * F32
    assert max(mem.peak.values()) == min(mem.peak.values())  # every device holds as much


def test_uneven_blocks_are_counted_as_stored_padded():
    mesh = nb.DeviceMesh("m", (4,), ("x",))
    with nb.memory_log() as mem:
        t = nb.abstract((5, 8)).shard(mesh, ["x", None])  # rows 2, 2, 1, 0 (the ceil rule), stored padded to 2
        u = t * 2.0
    assert mem.peak == {d: 2 * 2 * 8 * F32 for d in range(4)}
    assert mem.live == mem.peak  # both held when the log closed
    with nb.memory_log() as mem:
        t * 2.0  # made and dropped: alive for its own step only
    assert mem.live == {d: 2 * 8 * F32 for d in range(4)} and mem.peak == {d: 2 * 2 * 8 * F32 for d in range(4)}
    assert u.shape == (5, 8)


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


# ---- what the backward pass keeps: the residuals each op declares, never more than jax.vjp keeps ----------------

import contextlib  # noqa: E402
import io  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import print_saved_residuals  # noqa: E402

ONE = nb.DeviceMesh("one", (1,), ("d",))  # one device holding every value whole: bytes per device are global bytes
_SIZES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "i32": 4, "bool": 1, "u8": 1}


def _jax_saved_bytes(fn, params) -> int:
    """The bytes of what jax.vjp keeps for ``fn``'s backward pass, read from jax's own report
    (jax.ad_checkpoint.print_saved_residuals), less the parameters themselves (nabla counts those as params)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, params)
    total = 0
    for line in out.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line.strip())
        if m is None or m.group(3).startswith("from the argument"):
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        total += _SIZES[m.group(1)] * int(np.prod(dims))
    return total


def _mlp(p, x, xp):
    return (xp.tanh(x @ p["w1"]) @ p["w2"]).sum()


def _norm_mlp(p, x, xp):
    if xp is nb:
        y = nb.layer_norm(x, p["g"], p["b"])
        return (nb.gelu(y @ p["w1"]) @ p["w2"]).sum()
    m = x.mean(-1, keepdims=True)
    c = x - m
    y = c / jnp.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * p["g"] + p["b"]
    return (jax.nn.gelu(y @ p["w1"]) @ p["w2"]).sum()


def _attention(p, x, xp):
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
    scores = (q @ k.T) * float(q.shape[-1]) ** -0.5  # (a Python float: weak in both, the scores stay float32)
    probs = nb.softmax(scores, -1) if xp is nb else jax.nn.softmax(scores, -1)
    return ((probs @ v) @ p["wo"]).sum()


def _residual_stack(p, x, xp):
    relu = nb.relu if xp is nb else jax.nn.relu
    for w in p["ws"]:
        x = x + relu(x @ w)
    return (x * x).sum()


PROGRAMS = {
    "mlp": (_mlp, {"w1": (16, 32), "w2": (32, 8)}),
    "norm + mlp": (_norm_mlp, {"g": (16,), "b": (16,), "w1": (16, 64), "w2": (64, 16)}),
    "softmax attention": (_attention, {"wq": (16, 8), "wk": (16, 8), "wv": (16, 8), "wo": (8, 16)}),
    "residual stack": (_residual_stack, {"ws": [(16, 16)] * 3}),
}


def _arrays(shapes, seed=0):
    rng = np.random.default_rng(seed)
    if isinstance(shapes, dict):
        return {k: _arrays(v, seed + i) for i, (k, v) in enumerate(shapes.items())}
    if isinstance(shapes, list):
        return [_arrays(v, seed + i) for i, v in enumerate(shapes)]
    return (rng.standard_normal(shapes) * 0.3).astype(np.float32)


def _placed(tree, abstract: bool):
    if isinstance(tree, dict):
        return {k: _placed(v, abstract) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_placed(v, abstract) for v in tree]
    t = nb.abstract(tree.shape) if abstract else nb.tensor(tree)
    return t.shard(ONE, [None] * tree.ndim)


def _roots(steps) -> dict:
    """serial -> the serial whose storage it is (views share their source's)."""
    root = {}
    for s in steps:
        if s.alias:
            root[s.out] = root.get(s.alias, s.alias)
    return root


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_kept_for_the_backward_pass_is_what_the_ops_declare_and_at_most_what_jax_keeps(name):
    fn, shapes = PROGRAMS[name]
    p, x = _arrays(shapes), _arrays((8, 16), seed=9)
    jax_bytes = _jax_saved_bytes(lambda p: fn(p, jnp.asarray(x), jnp), p)
    kept = {}
    for abstract in (False, True):
        pp, xx = _placed(p, abstract), _placed(x, abstract)
        with nb.memory_log() as mem:
            nb.grad(lambda p: fn(p, xx, nb))(pp)
        kept[abstract] = (mem.kept[0], mem.by_kind["activations"][0], mem.peak[0])
        # the residuals the forward steps declare (views share storage), the parameters aside
        params = {id_ for id_ in (nb.value.serial(t) for t in jax.tree_util.tree_leaves(pp))}
        root = _roots(mem.steps)
        declared = {}
        for s in mem.steps:
            if s.phase != "forward":
                continue
            for v in s.saves:
                r = root.get(v, v)
                if r not in params:
                    declared[r] = None
        sizes = {b.value: b.bytes for b in mem.buffers()}
        assert mem.kept[0] == sum(sizes[r] for r in declared), name
    assert kept[False] == kept[True]  # eager and nb.abstract record the same program
    assert 0 < kept[False][0] <= jax_bytes, f"{name}: nabla keeps {kept[False][0]} B, jax.vjp {jax_bytes} B"
    assert kept[False][1] == kept[False][0]  # nothing recomputed: the most kept at once is what the pass starts with


def test_elementwise_ops_keep_nothing():
    """An add, a negation, a scale or a cast of a value keeps nothing for the backward pass (as in jax and
    PyTorch): wrapping a matmul's output in a chain of them leaves the bytes kept unchanged."""
    w, x = _placed(_arrays((16, 16)), False), _placed(_arrays((32, 16), 1), False)
    kept = []
    for chain in (lambda y: y, lambda y: -((y + 1.0) * 2.0 - y / 4.0).astype("float64").astype("float32")):
        with nb.memory_log() as mem:
            nb.grad(lambda w: (chain(x @ w) @ w).sum())(w)
        kept.append(mem.kept[0])
    assert kept[0] == kept[1] == 32 * 16 * F32 * 2  # x (for dw of the first matmul) and x @ w (of the second)


def test_views_share_their_source_bytes():
    x = nb.abstract((64, 32)).shard(nb.DeviceMesh("m", (2,), ("d",)), ["d", None])
    with nb.memory_log() as mem:
        a = x.reshape(32, 2, 32)
        b = x.T
        c = x.with_sharding(x.mesh, ["d", None])  # laid out as it is: moves nothing, the same blocks
    block = 32 * 32 * F32
    assert mem.peak == {0: block, 1: block} and mem.live == {0: block, 1: block}
    assert a.shape == (32, 2, 32) and b.shape == (32, 64) and c.sharding == x.sharding


def test_a_data_parallel_step_needs_the_same_memory_per_device_on_any_number_of_devices():
    """Data parallelism's premise (the ZeRO paper's baseline): each device holds the whole model and its own batch
    block, so per-device memory does not depend on how many devices share the batch. A mean loss's gradient is
    broadcast back to the activations' global shape before each device cuts its block: a view (numpy's
    broadcast_to strides; XLA fuses it), not an allocation of the global batch on every device, which grew with
    the device count (196 MiB on 8 devices, 1,092 on 64, 4,164 on 256). By hand here: the weight, its gradient, and
    three 16 MiB blocks kept (x, relu's input, power's input), plus the backward pass's block-sized temporaries."""
    hw = nb.Hardware.preset("a100-sxm-80gb")
    peaks = []
    for nodes in (1, 8):
        cluster = nb.Cluster(hw, nodes=nodes, devices_per_node=8)
        mesh = cluster.mesh("m", (nodes * 8,), ("dp",))
        w = nb.abstract((1024, 1024)).shard(mesh, [None, None])
        x = nb.abstract((nodes * 8 * 4096, 1024)).shard(mesh, ["dp", None])  # 16 MiB per device
        rep = nb.estimate(nb.value_and_grad(lambda w, x: (nb.relu(x @ w) ** 2).mean()), cluster)(w, x)
        by = {k: max(v.values()) for k, v in rep.memory.by_kind.items()}
        assert by["params"] == by["grads"] == 4 * 2**20 and by["activations"] == 48 * 2**20
        assert by["temporaries"] <= 3 * 16 * 2**20  # block-sized: never the global (N * 4096, 1024) batch
        peaks.append(max(rep.memory.peak.values()))
    assert peaks[0] == peaks[1]


@pytest.mark.parametrize("case", ["returned", "into matmul"])
def test_a_broadcast_a_matmul_reads_or_a_program_returns_is_materialised_as_xla_does(case):
    """A broadcast fuses into elementwise readers (the data-parallel test above); one a matmul reads or the
    program returns is a buffer of its own: nb.jit's memory equals XLA's compiled memory_analysis (arguments +
    output + temporaries), 33,558,528 and 71,307,264 bytes here."""
    pytest.importorskip("jax")
    mesh = nb.DeviceMesh("m", (1,), ("dp",))
    x = nb.tensor(np.ones(1024, np.float32)).shard(mesh, [None])
    w = nb.tensor(np.ones((1024, 1024), np.float32)).shard(mesh, [None, None])
    f, args = {"returned": (lambda x: nb.broadcast_to(x, (8192, 1024)), (x,)),
               "into matmul": (lambda x, w: nb.broadcast_to(x, (8192, 1024)) @ w, (x, w))}[case]
    lowered = nb.jit(f).lower(*args)
    m = lowered.compile().memory_analysis()
    assert max(lowered.memory.peak.values()) == \
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def test_a_host_value_read_by_a_device_kernel_counts_on_every_device_as_placed():
    """An unplaced tensor added to a sharded one is placed for the kernel (replicated, as jax.device_put puts a
    host array on every device): it costs each device the same as placing it first."""
    mesh = nb.DeviceMesh("m", (4,), ("d",))
    x = nb.tensor(np.ones((256, 256), np.float32)).shard(mesh, [None, None])
    b = nb.tensor(np.ones((256, 256), np.float32))
    peaks = []
    for bb in (b, b.shard(mesh, [None, None])):
        with nb.memory_log() as mem:
            nb.tanh(x + bb)
        peaks.append(mem.peak)
    assert peaks[0] == peaks[1] == {d: 4 * 256 * 256 * F32 for d in range(4)}  # x, b, x + b, tanh(x + b)
    with nb.memory_log() as mem:
        nb.tanh(b)
    assert mem.peak == {} and "no value was on a mesh" in mem.summary()


def test_arguments_count_from_the_start_read_or_not():
    """The peak does not depend on the order a function reads its arguments, nor on whether it reads them."""
    cluster = nb.Cluster(nb.Hardware.preset("a100-sxm-80gb"), nodes=1, devices_per_node=2)
    mesh = cluster.mesh("m", (2,), ("d",))
    big = nb.abstract((1024, 1024)).shard(mesh, [None, None])
    x = nb.abstract((1024, 256)).shard(mesh, ["d", None])
    peaks = []
    for fn in (lambda big, x: nb.exp(x).sum() + big.sum(), lambda big, x: big.sum() + nb.exp(x).sum(),
               lambda big, x: nb.exp(x).sum()):
        peaks.append(max(nb.estimate(fn, cluster)(big, x).memory.peak.values()))
    assert max(peaks) - min(peaks) <= 16  # (the order of a few 4-byte scalars aside)
    assert peaks[0] >= 1024 * 1024 * F32 + 2 * 512 * 256 * F32  # big, x's block and exp(x)


def test_kinds_are_what_a_value_is_not_the_phase_it_was_made_in():
    mesh = nb.DeviceMesh("m", (4,), ("dp",))
    w0 = nb.abstract((64, 32))
    x = nb.abstract((16, 64)).shard(mesh, ["dp", None])
    opt = nb.optim.Adam(1e-3)
    state = opt.init(w0.shard(mesh, [None, None]), specs=["dp", None])  # ZeRO-2: state and gradients over dp
    quarter, whole = 16 * 32 * F32, 64 * 32 * F32
    with nb.memory_log() as mem:
        w = w0.shard(mesh, [None, None])  # made here, before nb.grad sees it: a parameter from its creation
        g = nb.grad(lambda w: (x @ w).sum())(w)
        g2 = g.with_sharding(mesh, ["dp", None])  # a gradient moved (ZeRO-2's layout): still a gradient
        w2, state2 = opt.update(g2, state, w)  # the state passed in and the state made: optimizer state
    by = mem.by_kind
    assert by["params"][0] == whole + quarter  # w (w2 written over it), and its quarter taken into the state's layout
    assert by["grads"][0] == whole + quarter  # g, and g2 while both are held
    assert by["optimizer"][0] == 2 * quarter  # mu and nu, passed in (the update's written over them)
    assert w2.shape == w.shape and state2 is not None


def _fsdp_mlp(ck: bool):
    mesh = nb.DeviceMesh("m", (4,), ("dp",))
    rng = np.random.default_rng(0)
    ws = [nb.tensor((rng.standard_normal((16, 16)) * 0.3).astype(np.float32)).shard(mesh, ["dp", None])
          for _ in range(3)]
    x = nb.tensor(rng.standard_normal((256, 16)).astype(np.float32)).shard(mesh, ["dp", None])

    def loss(ws):
        h = x
        for w in ws:
            h = nb.checkpoint(lambda h, w: nb.tanh(h @ w))(h, w) if ck else nb.tanh(h @ w)
        return (h * h).sum()

    return loss, ws


def test_fsdp_under_checkpoint_gathers_each_weight_twice():
    """FSDP gathers a weight for the forward pass and once more for its layer's backward (its pre-backward hook);
    under activation checkpointing the recompute runs on that second gather (PyTorch FSDP's order), so each weight
    is gathered twice, not three times; the gradients are the same."""
    grads, gathers = {}, {}
    for ck in (False, True):
        loss, ws = _fsdp_mlp(ck)
        with nb.comm_log() as log:
            grads[ck] = nb.grad(loss)(ws)
        weight = 3 * 4 * 16 * 4  # (k - 1) x a (4, 16) float32 block: a whole weight gathered
        gathers[ck] = [e.phase for e in log.events if e.kind == "all_gather" and e.bytes == weight]
    assert gathers[True] == ["forward"] * 3 + ["recompute"] * 3  # the backward reads the recompute's gathers
    assert len(gathers[False]) == 5  # forward 3; the two layers whose input gradient is needed gather again
    for a, b in zip(grads[False], grads[True]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def test_jit_program_holds_what_eager_holds():
    """nb.jit's program is read by the same liveness pass (``Lowered.memory``): inputs from the start, outputs to
    the end, every other value until its last reader."""
    mesh = nb.DeviceMesh("m", (4,), ("dp",))
    w = nb.tensor(np.ones((64, 32), np.float32)).shard(mesh, ["dp", None])
    x = nb.tensor(np.ones((16, 64), np.float32)).shard(mesh, ["dp", None])

    def step(w, x):
        return nb.grad(lambda w: nb.relu(x @ w).sum())(w)

    lowered = nb.jit(step).lower(w, x)
    with nb.memory_log() as mem:
        g = step(w, x)
    assert lowered.memory.peak == mem.peak and lowered.memory.kept == mem.kept
    assert lowered.memory.by_kind["comm"][0] == 64 * 32 * F32  # the gathered weight while the matmul runs
    assert g.shape == w.shape


def test_dot_product_attention_keeps_bytes_linear_in_the_sequence():
    """FlashAttention keeps q, k, v, the output and a float32 log-sum-exp per query row (Dao et al. 2022): bytes
    linear in the sequence; attention written with a softmax over materialised scores keeps (B, N, S, S)."""
    B, N, H, D = 2, 4, 16, 64

    def kept(S: int, flash: bool) -> int:
        x = nb.abstract((B, S, D), "bfloat16").shard(ONE, [None, None, None])
        ws = [nb.abstract((D, N * H), "bfloat16").shard(ONE, [None, None]) for _ in range(3)]

        def loss(ws):
            q, k, v = ((x @ w).reshape(B, S, N, H) for w in ws)
            if flash:
                o = nb.dot_product_attention(q, k, v, is_causal=True)
            else:
                s = nb.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
                o = nb.einsum("bnts,bsnh->btnh", nb.softmax(s, -1), v)
            return o.astype("float32").sum()

        with nb.memory_log() as mem:
            nb.grad(loss)(ws)
        return mem.kept[0]

    act = B * 128 * N * H * 2  # one (B, S, N, H) bf16 value at S = 128
    # x (for dw), q, k, v, out; the log-sum-exp; the query positions (an int32 per row, cut as the queries are)
    assert kept(128, True) == B * 128 * D * 2 + 4 * act + B * N * 128 * 4 + 128 * 4
    assert kept(256, True) == 2 * kept(128, True) and kept(512, True) == 4 * kept(128, True)
    assert kept(512, False) - kept(256, False) > 2 * (kept(256, False) - kept(128, False))  # quadratic


def test_kept_is_read_where_the_backward_pass_starts_even_with_a_recompute_first():
    """Under full recompute each checkpointed layer keeps its input only (Korthikanti et al. 2022, sec. 5: 2sbh
    per layer); the backward pass starting with a recompute does not count the recomputed values as kept, and a
    cotangent handed to the backward pass (an argument only it reads) is not kept either."""
    mesh = nb.DeviceMesh("m", (2,), ("d",))
    w = nb.abstract((256, 256)).shard(mesh, [None, None])
    x = nb.abstract((64, 256)).shard(mesh, ["d", None])
    ct = nb.abstract((64, 256)).shard(mesh, ["d", None])
    block = 32 * 256 * F32  # a (64, 256) float32 value's block on each of 2 devices
    for tail in (False, True):
        def body(w, x, tail=tail):
            for _ in range(4):
                x = nb.checkpoint(lambda x, w: nb.tanh(x @ w))(x, w)
            return x * 2.0 if tail else x

        with nb.memory_log() as mem:
            _, back = nb.vjp(lambda w: body(w, x), w)
            back(ct)
        assert mem.kept[0] == 4 * block, (tail, mem.kept[0] / block)  # the four layers' inputs


def test_pipeline_adds_the_microbatches_in_flight_to_the_passes_not_to_the_update():
    cluster = nb.Cluster(nb.Hardware.preset("a100-sxm-80gb"), nodes=1, devices_per_node=1)
    mesh = cluster.mesh("m", (1,), ("d",))
    w = nb.abstract((2048, 2048)).shard(mesh, [None, None])
    x = nb.abstract((256, 2048)).shard(mesh, [None, None])
    opt = nb.optim.Adam(1e-3)
    state = opt.init(w)

    def step(w, x, state):
        g = nb.grad(lambda w: nb.tanh(x @ w).sum())(w)
        return opt.update(g, state, w)

    report = nb.estimate(step, cluster)(w, x, state)
    mem = report.memory
    p = nb.pipeline_estimate(report, stages=8, microbatches=64).memory
    kept = mem.kept[0]
    assert kept == 2 * 256 * 2048 * F32  # x (for dw) and tanh's output
    costs = report.timeline.costs
    last = max(i for i, c in enumerate(costs) if c.phase == "backward")  # the update runs after the backward pass
    passes, update = max(mem.live[:last + 1]), max(mem.live[last + 1:])
    assert update > passes  # this stage's peak is its update's (the new moments beside the gradient)
    assert p.peak[0] == max(passes + 7 * kept, update) < mem.peak[0] + 7 * kept
