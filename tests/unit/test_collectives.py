import contextlib

import numpy as np
import pytest

import nabla as nb
from nabla import collectives as C, commlog


def test_gather_into_moves_grid_axes_into_a_dim():
    # grid (2, 3), one dim of chunk 2: device (i, j) holds block 3*i + j of a length-12 vector
    x = np.arange(12).reshape(2, 3, 2)
    y = C.gather_into(x, 2, 0, (0, 1), 12)
    assert y.shape == (1, 1, 12)
    assert y.reshape(-1).tolist() == list(range(12))


def test_gather_minor_atom_only():
    x = np.arange(12).reshape(2, 3, 2)
    y = C.gather_into(x, 2, 0, (1,), 6)
    assert y.shape == (2, 1, 6)
    assert y[1, 0].tolist() == [6, 7, 8, 9, 10, 11]


def test_split_onto_is_the_inverse_of_gather():
    x = np.arange(12).reshape(1, 1, 12)
    y = C.split_onto(x, 2, 0, (0, 1), (2, 3), 2)
    np.testing.assert_array_equal(y, np.arange(12).reshape(2, 3, 2))


def test_split_pads_uneven_dims():
    x = np.arange(5).reshape(1, 5)
    y = C.split_onto(x, 1, 0, (0,), (4,), 2)
    assert y.shape == (4, 2) and y[:2].reshape(-1).tolist() == [0, 1, 2, 3] and y[2, 0] == 4


def test_reduce_over_atoms():
    x = np.arange(8.0).reshape(2, 4, 1)
    assert C.reduce_over(x, (1,)).reshape(-1).tolist() == [6.0, 22.0]
    assert C.reduce_over(x, (0, 1), "max").item() == 7.0
    assert C.reduce_over(x, (0,), "min").reshape(-1).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_permute_blocks_swaps_axis_roles():
    # a dim sharded [a, b] (a=2, b=3): device (i, j) holds block 3i + j; after [b, a] it holds 2j + i
    blocks = np.arange(6).reshape(2, 3, 1)
    y = C.permute_blocks(blocks, (0, 1), (1, 0))
    for i in range(2):
        for j in range(3):
            assert y[i, j, 0] == 2 * j + i


def test_logs_nest_and_count():
    mesh = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    a = nb.ones((4, 8)).shard(mesh, ["x", None])  # 2x8 float32 blocks: 64 B
    p = nb.ones((4, 8)).shard(mesh, [None, None], partial_axes=["y"])  # 4x8 summands: 128 B
    with nb.comm_log() as outer:
        a.with_sharding(mesh, [None, None])  # all_gather over x: (2 - 1) * 64 B
        with nb.comm_log() as inner:
            # the planner cuts rows over the idle x first (local), sums 2x8 halves over y (2 * 3/4 * 64 B),
            # then gathers them over x (64 B): 160 B instead of one all_reduce of 4x8 (2 * 3/4 * 128 = 192 B)
            p.with_sharding(mesh, [None, None])
    assert outer.counts == {"all_gather": 2, "all_reduce": 1} and outer.total_bytes == 64 + 96 + 64
    assert inner.counts == {"all_reduce": 1, "all_gather": 1} and inner.total_bytes == 160
    assert [s.name for s in outer.steps] == ["with_sharding", "with_sharding"] and len(inner.steps) == 1
    assert inner.steps[0].events == tuple(inner.events)
    a.with_sharding(mesh, [None, None])  # no open log: nothing recorded
    assert outer.total_bytes == 224


def test_ring_cost_model():
    ev = C.CommEvent("all_reduce", ("x",), 1000, 4)
    assert ev.steps == 6
    model = nb.CostModel()  # 5 us per ring step, 25 GB/s
    assert model.time(ev.steps, ev.bytes, ev.axes) == 6 * 5e-6 + 1000 / 25e9
    assert C.CommEvent("collective_permute", ("x",), 8, 4).steps == 1
    assert "all_reduce(x; 1000 B/device)" == repr(ev)


def test_the_registry_makes_the_events_and_the_comm_log_is_read_through_it_too():
    # event: from a local block (the registry's ring bytes); sent_event: bytes already counted (a planned move's)
    assert C.event("all_gather", ("x",), 32, 4) == C.sent_event("all_gather", ("x",), 96, 4) == \
        C.CommEvent("all_gather", ("x",), 96, 4)
    assert C.event("collective_permute", ("x",), 32, 4).bytes == 32  # a halo's or a mirror's block, as sent
    for name in ("CommLog", "comm_log", "recording", "phase", "user_op", "named_scope", "publish", "unlogged"):
        assert getattr(C, name) is getattr(commlog, name)  # one comm log, re-exported by the registry


# ---- the registry: a new collective is one register call plus a move generator --------------------------


@contextlib.contextmanager
def _tree_all_gather(lower=None):
    """Register a tree all_gather (the same bytes as the ring, log2(k) latency steps, so the planner prefers
    it) and its move generator; unregister on exit."""
    from nabla import reshard

    tree = C.Collective("tree_all_gather", lambda B, k: (k - 1) * B, lambda k: max(1, (k - 1).bit_length()),
                        "reduce_scatter", C.REGISTRY["all_gather"].move, lower=lower)

    def trees(m, s):
        for step in reshard.gathers(m, s):
            if step.kind == "all_gather":
                yield step._replace(kind="tree_all_gather")

    m = nb.DeviceMesh("m", (8,), ("x",))
    nb.tensor(np.arange(16.0)).shard(m, ["x"]).with_sharding(m, [None])  # a plan cached before the registration
    C.register(tree)  # the public calls only: plans made from now on see the new kind (no cache is cleared)
    reshard.register_generator(trees)
    try:
        yield
    finally:
        reshard.unregister_generator(trees)
        C.unregister("tree_all_gather")
    assert "tree_all_gather" not in C.kinds()
    with nb.comm_log() as log:  # and once it is gone, plans stop using it
        nb.tensor(np.arange(16.0)).shard(m, ["x"]).with_sharding(m, [None])
    assert log.counts == {"all_gather": 1}


def test_a_toy_collective_joins_the_planner_and_the_estimator():
    """A new kind, registered once: eager plans with it, and nb.estimate prices the same program by its entry
    (3 latency steps of the A100 preset's NVLink, 3.4 us each, and (k - 1) x 16 bytes at 300 GB/s x 0.775: the
    alpha-beta sum by hand)."""
    cl = nb.Cluster(nb.Hardware.preset("a100-sxm-80gb"), nodes=1, devices_per_node=8)
    with _tree_all_gather():
        m = nb.DeviceMesh("m", (8,), ("x",))
        v = np.arange(16.0)
        with nb.comm_log() as log:
            out = nb.tensor(v).shard(m, ["x"]).with_sharding(m, [None])
        assert log.counts == {"tree_all_gather": 1} and log.events[0].steps == 3
        np.testing.assert_array_equal(out.numpy(), v)
        cm = cl.mesh("m", (8,), ("x",))
        est = nb.estimate(lambda t: t.with_sharding(cm, [None]), cl)(nb.tensor(v).shard(cm, ["x"]))
        assert [iv.name for iv in est.timeline.intervals if iv.stream == "comm"] == ["tree_all_gather"]
        assert est.comm_time == pytest.approx(3 * 3.4e-6 + 7 * 16 / (300e9 * 0.775))


def _toy_lowering(x, step, ctx):
    """The toy's jax.lax twin: a tiled all_gather over the step's axes, trimmed to the gathered dim."""
    return ctx.fit(ctx.lax.all_gather(x, ctx.names, axis=step.src, tiled=True), step.src, step.src_chunk)


def test_a_toy_collective_compiles_under_jit_through_its_registry_lowering():
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 jax devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    m = nb.DeviceMesh("m", (8,), ("x",))
    v = np.arange(12.0, dtype=np.float32)  # uneven: 12 over 8 is 2 per device, the last two empty
    with _tree_all_gather(lower=_toy_lowering):
        x = nb.tensor(v).shard(m, ["x"])
        f = nb.jit(lambda t: t.with_sharding(m, [None]) * 2)
        lowered = f.lower(x)
        assert lowered.comm_log.counts == {"tree_all_gather": 1}
        np.testing.assert_array_equal(f(x).numpy(), v * 2)
        hlo = lowered.as_text()
    gathers = [ln for ln in hlo.splitlines() if " all-gather(" in ln or " all-gather-start(" in ln]
    assert len(gathers) == 1 and "f32[16]" in gathers[0] and "replica_groups={{0,1,2,3,4,5,6,7}}" in gathers[0]
    assert lowered.comm_log.events[0].bytes == 7 * 8  # (k - 1) * B for the 2-element float32 block
    assert "collective-permute" not in hlo and "all-reduce" not in hlo


def test_a_collective_without_a_lowering_says_so_under_jit():
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 jax devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    m = nb.DeviceMesh("m", (8,), ("x",))
    with _tree_all_gather():
        x = nb.tensor(np.arange(16.0, dtype=np.float32)).shard(m, ["x"])
        with pytest.raises(nb.ShardingError, match="'tree_all_gather' has no jax.lax lowering"):
            nb.jit(lambda t: t.with_sharding(m, [None])).lower(x).as_text()


def test_every_collective_names_a_registered_transpose():
    for c in C.REGISTRY.values():
        assert c.transpose in C.REGISTRY, c
    assert C.REGISTRY["all_gather"].transpose == "reduce_scatter"
    assert C.REGISTRY["reduce_scatter"].transpose == "all_gather"
    assert C.REGISTRY["slice"].transpose == "local_pad" and C.REGISTRY["local_pad"].transpose == "slice"


@pytest.mark.parametrize("held", [(), (2,)])
def test_local_pad_is_the_transpose_of_a_local_slice(held):
    # a dim of 24 cut over atoms (2, 3) (with held: two major pieces, each cut alike); padding each block back
    # into place among zeros and summing over the atoms gives the dim again; <slice x, y> == <x, pad y>
    from nabla.reshard import Move, State

    rng = np.random.default_rng(0)
    s = Move("slice", ("a", "b"), 0, 6, State((), frozenset()), dst=0, atoms=(0, 1), sizes=(2, 3),
             dst_chunk=4 // (2 if held else 1), held=held)
    x = rng.standard_normal((1, 1, 24, 3))
    cut = C.REGISTRY["slice"].move(x, 2, s, "sum")
    padded = C.REGISTRY["local_pad"].move(cut, 2, s, "sum")
    assert padded.shape == (2, 3, 24, 3) and C.REGISTRY["local_pad"].local
    np.testing.assert_array_equal(padded.sum(axis=(0, 1)), x[0, 0])
    y = rng.standard_normal(cut.shape)
    np.testing.assert_allclose((cut * y).sum(), (x * C.REGISTRY["local_pad"].move(y, 2, s, "sum")).sum())
    for i, j in np.ndindex(2, 3):  # its jax.lax twin on each device's block (numpy standing in for jax.numpy)
        ctx = type("Ctx", (), {"xp": np, "k": 6, "index": lambda self, i=i, j=j: 3 * i + j,
                               "fit": lambda self, x, axis, n: C._fit(x, axis, n)})()
        np.testing.assert_array_equal(C.REGISTRY["local_pad"].lower(cut[i, j], s, ctx), padded[i, j])


# ---- the comm log is safe state ---------------------------------------------------------------------------


def test_nested_logs_do_not_remove_each_other():
    m = nb.DeviceMesh("m", (2,), ("x",))
    t = nb.tensor(np.ones(4, np.float32)).shard(m, ["x"])
    with nb.comm_log() as outer:
        with nb.comm_log() as inner_empty:
            pass
        with nb.comm_log() as inner:
            t.with_sharding(m, [None])
        t.with_sharding(m, [None])
    assert inner_empty.events == [] and len(inner.events) == 1 and len(outer.events) == 2


def test_logs_and_strategies_are_per_thread():
    import threading

    m = nb.DeviceMesh("m", (2,), ("x",))
    t = nb.tensor(np.ones(4, np.float32)).shard(m, ["x"])
    seen = {}
    ready, go = threading.Event(), threading.Event()

    def other():
        with nb.comm_log() as log:
            ready.set()
            go.wait(5)
            t.with_sharding(m, [None])
        seen["other"] = len(log.events)

    th = threading.Thread(target=other)
    with nb.comm_log() as mine:
        th.start()
        ready.wait(5)
        go.set()
        th.join(5)
    assert seen["other"] == 1 and mine.events == []  # the thread's collective went to its own log only


def test_strategy_backend_and_cost_model_are_per_thread_and_per_task():
    import asyncio
    import threading

    seen = {}

    def other():
        seen["thread"] = (nb.propagation.current_strategy(), nb.backends.active().name, nb.cost.current())

    slow = nb.CostModel(latency=1e-3)
    with nb.strategy("basic"), nb.cost_model(slow):
        th = threading.Thread(target=other)
        th.start()
        th.join(5)
        mine = (nb.propagation.current_strategy(), nb.cost.current())
    assert seen["thread"] == ("aggressive", "numpy", nb.CostModel()) and mine == ("basic", slow)

    async def task(name, strategy, results):
        with nb.strategy(strategy):
            await asyncio.sleep(0)  # the other task runs here, inside its own block
            results[name] = nb.propagation.current_strategy()

    async def both():
        results = {}
        await asyncio.gather(task("a", "basic", results), task("b", "aggressive", results))
        return results

    assert asyncio.run(both()) == {"a": "basic", "b": "aggressive"}


def test_abbreviate_keeps_the_first_names_that_fit_then_counts_the_rest():
    names = [f"grad of p['layers'][{i}]['w{j}']" for i in range(2) for j in range(5)]
    text = C.abbreviate(names, 60)
    assert len(text) <= 60
    kept = text.split(" and ")[0].split(", ")
    assert kept == names[:len(kept)] and len(kept) >= 1
    assert text.endswith(f" and {len(names) - len(kept)} more")
    assert C.abbreviate(["a", "b", "a"], 60) == "a, b"  # each name once, in order
    assert C.abbreviate(["x" * 100], 20) == "x" * 17 + "..."
    long = C.abbreviate(["x" * 100, "y"], 30)
    assert len(long) <= 30 and long.endswith(" and 1 more")


def test_the_during_column_of_a_two_layer_step_is_bounded():
    """examples/train_llama.py's 2-layer step (DP x TP x SP): 21 gradients share one dp all_reduce row, which
    printed 670 characters; every "during" cell now fits in NAMES_WIDTH and counts the names it leaves out, in
    log.summary() and in nb.explain's copy of it."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import train_llama as L

    layout = L.Layout("dp_tp_sp")
    params = L.init(L.CONFIG)
    placed = L._tree_map2(lambda a, s: nb.abstract(a.shape).shard(layout.mesh, s), params,
                          layout.param_specs(params))
    ids = nb.abstract((L.CONFIG["batch"], L.CONFIG["seq"]), "int64").shard(layout.mesh, ["dp", None])
    step = nb.value_and_grad(lambda p, x, y: L.loss_fn(p, x, y, L.CONFIG, layout))
    with nb.comm_log() as log:
        step(placed, ids, ids)
    lines = log.summary().splitlines()
    start = lines[0].index("during")
    cells = [line[start:] for line in lines[2:-1]]
    assert max(len(c) for c in cells) <= C.NAMES_WIDTH, cells
    assert max(len(line) for line in lines) <= start + C.NAMES_WIDTH
    grads = [e for e in log.events if e.phase == "backward" and e.kind == "all_reduce" and e.axes == ("dp",)]
    users = list(dict.fromkeys(e.op for e in grads))
    assert len(users) > 10
    row = next(c for line, c in zip(lines[2:], cells) if line.startswith("backward  all_reduce") and " dp " in line)
    shown = row.split(" and ")[0].split(", ")
    assert shown == users[:len(shown)] and row.endswith(f" and {len(users) - len(shown)} more")
    with contextlib.redirect_stdout(None):
        text = nb.explain(step, placed, ids, ids)
    table = text[text.index("comm log of the run:"):].splitlines()[1:]
    assert max(len(line) for line in table) <= start + C.NAMES_WIDTH


# ---- one registry: every kind of communication is an entry, and only the registry makes events ----------------


def test_no_module_outside_the_registry_makes_a_comm_event_and_every_kind_named_is_registered():
    # read from the source: CommEvent(...) is called in collectives.py only; every event(...)/sent_event(...)
    # with a literal kind names a registry entry (halos, mirrors, exchanges, buckets and nb.lax included)
    import ast
    from pathlib import Path

    import nabla

    root = Path(nabla.__file__).parent
    made, named = [], set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name == "CommEvent" and path.name != "collectives.py":
                made.append(f"{path.relative_to(root)}:{node.lineno}")
            if name in ("event", "sent_event") and node.args and isinstance(node.args[0], ast.Constant):
                named.add(node.args[0].value)
    assert made == []
    assert {"halo", "mirror", "bucket"} <= named  # (nb.lax names its entries through lax.KINDS)
    assert named <= set(C.REGISTRY), named - set(C.REGISTRY)
    for kind in ("halo", "mirror", "exchange", "bucket", "lax.all_gather", "lax.psum_scatter"):
        c = C.REGISTRY[kind]
        assert c.logs_as in C.kinds() and c.lower is not None and c.transpose in C.REGISTRY, kind
    assert C.REGISTRY["lax.all_gather"].transpose == "lax.psum_scatter"


def test_a_kind_replaced_from_outside_is_used_priced_and_logged():
    # the halo entry swapped for one that counts its moves and prices twice the bytes: a sliced sharded vector
    # runs through it (same values), its events carry its bytes under the kind it logs as, and they are priced
    import dataclasses

    halo = C.REGISTRY["halo"]
    calls = []

    def counting(x, G, moves, reduce_op):
        calls.append(len(moves))
        return halo.move(x, G, moves, reduce_op)

    m = nb.DeviceMesh("m", (4,), ("x",))
    v = np.arange(16.0, dtype=np.float32)
    with nb.comm_log() as before:
        nb.tensor(v).shard(m, ["x"])[4:12]
    C.register(dataclasses.replace(halo, ring_bytes=lambda B, k: 2 * B, move=counting))
    try:
        with nb.comm_log() as log:
            out = nb.tensor(v).shard(m, ["x"])[4:12]
        np.testing.assert_array_equal(out.numpy(), v[4:12])
    finally:
        C.register(halo)
    assert calls and log.counts == before.counts == {"collective_permute": len(before.events)}
    assert [e.bytes for e in log.events] == [2 * e.bytes for e in before.events]
    assert all(e.seconds > 0 and e.steps == 1 for e in log.events)
    with nb.comm_log() as after:  # the entry back: plans made afresh, the log as before
        nb.tensor(v).shard(m, ["x"])[4:12]
    assert [e.bytes for e in after.events] == [e.bytes for e in before.events]


def test_one_registration_reaches_eager_the_estimator_nb_lax_and_nb_jit():
    """A kind registered once is what every reader uses: here all_gather replaced by a tree (log2 k latency
    steps, its moves and lowerings counted). Eager runs its move, nb.lax's all_gather (logged as all_gather on
    the wire) and the eager gather are priced by its steps, the estimator prices both so, nb.jit lowers through
    it. Expected times: alpha-beta by hand from the A100 preset (NVLink 3.4 us per step, 300 GB/s x 0.775)."""
    import dataclasses

    jax = pytest.importorskip("jax")
    ring = C.REGISTRY["all_gather"]
    moved, lowered = [], []

    def move(*a):
        moved.append(1)
        return ring.move(*a)

    def lower(*a):
        lowered.append(1)
        return ring.lower(*a)

    cl = nb.Cluster(nb.Hardware.preset("a100-sxm-80gb"), nodes=1, devices_per_node=8)
    m = cl.mesh("m", (8,), ("x",))
    v = np.arange(64.0, dtype=np.float32)  # 8 floats a device: 32 bytes, 7 x 32 sent in a ring of 8
    eager = lambda t: t.with_sharding(m, [None]) * 2  # noqa: E731
    manual = nb.shard_map(lambda b: nb.lax.all_gather(b, "x", tiled=True) * 2, m, [["x"]], [None])
    one = 3 * 3.4e-6 + 7 * 32 / (300e9 * 0.775)  # the tree: log2(8) = 3 steps (the ring: 7)
    C.register(dataclasses.replace(ring, ring_steps=lambda k: max(1, (k - 1).bit_length()), move=move,
                                   lower=lower))
    try:
        for fn in (eager, manual):
            x = nb.tensor(v).shard(m, ["x"])
            with nb.comm_log() as log:
                out = fn(x)
            np.testing.assert_array_equal(out.numpy(), v * 2)
            assert log.counts == {"all_gather": 1} and log.events[0].bytes == 7 * 32 and log.events[0].steps == 3
            assert nb.estimate(fn, cl)(x).comm_time == pytest.approx(one)
        assert moved == [1]  # the eager gather ran the entry's move (nb.lax's own simulation is its entry's)
        if len(jax.devices()) >= 8:
            np.testing.assert_array_equal(nb.jit(eager)(nb.tensor(v).shard(m, ["x"])).numpy(), v * 2)
            assert lowered
    finally:
        C.register(ring)
    x = nb.tensor(v).shard(m, ["x"])
    assert nb.estimate(eager, cl)(x).comm_time == pytest.approx(7 * 3.4e-6 + 7 * 32 / (300e9 * 0.775))
    assert nb.estimate(manual, cl)(x).comm_time == pytest.approx(7 * 3.4e-6 + 7 * 32 / (300e9 * 0.775))
