"""Whole JAX programs on nabla through nb.import_jax: a Flax linen transformer LM with an optax AdamW step, a Flax
NNX model, an Equinox model and an ``nn.scan``-over-layers model, each equal to ``jax.jit`` of the same function on
DP, Megatron TP and FSDP layouts, and sending no more bytes per device than XLA's SPMD partitioner for the same
input and output shardings (read from the compiled HLO by ``xla_harness``)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytestmark = pytest.mark.usefixtures("jax_x32")  # these programs are written for 32-bit jax
optax = pytest.importorskip("optax")
nn = pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402

import nabla as nb  # noqa: E402
import xla_harness as H  # noqa: E402

MESH = nb.DeviceMesh("m", (2, 4), ("dp", "tp"))
V, D, HEADS, L, T, B = 64, 32, 4, 2, 8, 8


class Block(nn.Module):
    """A pre-LN transformer block (no q/k/v bias: a key bias has an exactly-zero gradient, whose rounding noise Adam
    would turn into a full step of either sign)."""

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        y = nn.LayerNorm(name="ln1")(x)
        qkv = nn.Dense(3 * d, use_bias=False, name="qkv")(y).reshape(b, t, 3, HEADS, d // HEADS)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS).astype(x.dtype)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
        x = x + nn.Dense(d, name="proj")(o)
        y = nn.Dense(4 * d, name="fc1")(nn.LayerNorm(name="ln2")(x))
        return x + nn.Dense(d, name="fc2")(nn.gelu(y))


class GPT(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(V, D, name="wte")(ids) + nn.Embed(T, D, name="wpe")(jnp.arange(ids.shape[1]))
        for i in range(L):
            x = Block(name=f"h{i}")(x)
        return nn.Dense(V, use_bias=False, name="head")(nn.LayerNorm(name="lnf")(x))


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return Block()(x), None


class ScannedGPT(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(V, D, name="wte")(ids)
        x, _ = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)(
            name="layers")(x, None)
        return nn.Dense(V, use_bias=False, name="head")(nn.LayerNorm(name="lnf")(x))


def _adamw():
    """AdamW with eps 1e-3: Adam's step g / (|g| + eps) turns a rounding difference in a gradient element near eps
    into lr / (4 eps) times it; at the usual 1e-8 that is 25,000x, which no two float32 programs survive (XLA's
    tanh and exp are its own approximations: gradients agree with XLA's to about 1e-6 of their largest element)."""
    return optax.adamw(1e-3, eps=1e-3, weight_decay=0.1)


def _lm_step(model):
    opt = _adamw()

    def loss(p, ids, tgt):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, ids), tgt).mean()

    def step(p, s, ids, tgt):
        value, grads = jax.value_and_grad(loss)(p, ids, tgt)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value
    return step, opt


def _trained(params, seed: int = 3):
    """Parameters as after some training: the initial ones plus noise, so no bias is all zeros (a leaf whose every
    element is the first update is compared at the scale of the update, where float32's rounding shows)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda a: (np.asarray(a) + 0.02 * rng.standard_normal(np.shape(a))).astype(
        np.asarray(a).dtype), params)


def _lm(model):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    tgt = rng.integers(0, V, (B, T)).astype(np.int32)
    params = _trained(model.init(jax.random.PRNGKey(0), ids))
    step, opt = _lm_step(model)
    state = jax.tree_util.tree_map(np.asarray, opt.init(params))
    return step, (params, state, ids, tgt)


def _nnx():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(64, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.norm(self.l1(x))))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    opt = _adamw()

    def step(state, s, x, y):
        loss = lambda st: jnp.mean((nnx.merge(graphdef, st)(x) - y) ** 2)  # noqa: E731
        value, grads = jax.value_and_grad(loss)(state)
        updates, s = opt.update(grads, s, state)
        return optax.apply_updates(state, updates), s, value
    rng = np.random.default_rng(1)
    state = _trained(state)
    x, y = rng.standard_normal((B, 16)).astype(np.float32), rng.standard_normal((B, 8)).astype(np.float32)
    return step, (state, jax.tree_util.tree_map(np.asarray, opt.init(state)), x, y)


def _equinox():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(16, 8, 64, 2, key=jax.random.PRNGKey(2))
    arrays, static = eqx.partition(model, eqx.is_array)
    model = eqx.combine(_trained(arrays), static)
    opt = _adamw()

    def step(model, s, x, y):
        loss = lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)  # noqa: E731
        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, s = opt.update(eqx.filter(grads, eqx.is_array), s, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), s, value
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((B, 16)).astype(np.float32), rng.standard_normal((B, 8)).astype(np.float32)
    state = jax.tree_util.tree_map(np.asarray, opt.init(eqx.filter(model, eqx.is_array)))
    return step, (model, state, x, y)


MODELS = {
    "flax_gpt_adamw": lambda: _lm(GPT()),
    "flax_nnx_mlp": _nnx,
    "equinox_mlp": _equinox,
    "flax_scan_gpt": lambda: _lm(ScannedGPT()),
}


# ---- layouts: a dim-spec list for each argument leaf, from its path and shape ------------------------------------

_COLUMN = re.compile(r"qkv|fc1|l1|layers\[0\]|head|wte")  # Megatron: output features (or the vocabulary) cut
_ROW = re.compile(r"proj|fc2|l2|layers\[1\]")  # Megatron: input features cut (partial sums, one all_reduce)


def _layout(name: str, path: str, shape: tuple, arg: int) -> list:
    none = [None] * len(shape)
    if arg >= 2:  # the batch: on every device (DP, FSDP) or on dp (TP)
        return [("dp", "tp") if name != "tp" else "dp"] + none[1:]
    if name == "dp" or not shape:
        return none
    if name == "fsdp":  # ZeRO-3: each parameter cut on its first dim (the next one that divides, if not)
        for d in range(len(shape)):
            if shape[d] % MESH.size == 0:
                return none[:d] + [("dp", "tp")] + none[d + 1:]
        return none
    lead = 1 if "layers" in path and "Block" in path else 0  # scanned parameters: the layer dim first
    core = len(shape) - lead
    if "wte" in path and core == 2:  # vocabulary-parallel embedding
        return none[:lead] + ["tp", None]
    if _COLUMN.search(path) and core >= 1:
        return none[:-1] + ["tp"]
    if _ROW.search(path) and core == 2:
        return none[:lead] + ["tp", None]
    return none


def _paths(tree) -> list[tuple[str, object]]:
    return [(jax.tree_util.keystr(p), a) for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _placed(args, name):
    out = []
    for i, a in enumerate(args):
        def place(path, x, i=i):
            if not isinstance(x, np.ndarray):
                return x
            return nb.tensor(x).shard(MESH, _layout(name, jax.tree_util.keystr(path), x.shape, i))
        out.append(jax.tree_util.tree_map_with_path(place, a))
    return out


@functools.lru_cache(maxsize=None)
def _model(key: str):
    return MODELS[key]()


@functools.lru_cache(maxsize=None)
def _reference(key: str):
    step, args = _model(key)
    jit = pytest.importorskip("equinox").filter_jit if key == "equinox_mlp" else jax.jit  # (its model holds functions)
    return jax.tree_util.tree_leaves(jit(step)(*args))


def _arrays(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, (np.ndarray, nb.Tensor)) or hasattr(x, "shape")]


@functools.lru_cache(maxsize=None)
def _run(key: str, layout: str):
    """nabla's outputs (their pending sums made, as XLA's outputs are whole values) and its comm log."""
    step, args = _model(key)
    placed = _placed(args, layout)
    with nb.comm_log() as log:
        out = nb.import_jax(step)(*placed)
        leaves = [o.with_sharding(o.sharding.mesh, o.sharding.dim_specs) if o.sharding is not None and
                  o.sharding.partial_axes else o for o in _arrays(out)]
    return leaves, log, placed


LAYOUTS = ("dp", "tp", "fsdp")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("key", sorted(MODELS))
def test_model_step_equals_jax_jit(key, layout):
    got, _, _ = _run(key, layout)
    want = [np.asarray(w) for w in _reference(key) if hasattr(w, "shape")]
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        g = g.numpy()
        assert g.shape == w.shape and g.dtype == w.dtype, (k, g.shape, w.shape)
        scale = max(float(np.abs(w).max()), 1e-30) if w.dtype.kind == "f" else 1.0
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{key} {layout} output {k}")


#: where nabla sends more than XLA, measured (B/device, nabla vs XLA) and why; strict: a fix turns them into passes.
#: (Was: Equinox FSDP 11,011 vs 9,275, its input gathered again for the first weight's gradient; an imported
#: program now keeps an input's gathered copy for its later uses, as XLA does: ``trace.one_program``.)
MORE_THAN_XLA: dict = {}


def _bytes_cases():
    for key in sorted(set(MODELS) - {"flax_scan_gpt"}):  # (XLA keeps a scan a loop, whose collectives repeat)
        for layout in LAYOUTS:
            why = MORE_THAN_XLA.get((key, layout))
            yield pytest.param(key, layout, id=f"{key}-{layout}",
                               marks=[pytest.mark.xfail(strict=True, reason=why)] if why else [])


@pytest.mark.parametrize("key,layout", list(_bytes_cases()))
def test_model_step_sends_no_more_than_xla(key, layout):
    step, args = _model(key)
    got, log, placed = _run(key, layout)
    leaves, tree = jax.tree_util.tree_flatten(args)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray)]
    placed_leaves = jax.tree_util.tree_leaves(placed)

    def flat(*xs):
        full = list(leaves)
        for i, x in zip(arrays, xs):
            full[i] = x
        return tuple(_arrays(step(*jax.tree_util.tree_unflatten(tree, full))))

    in_specs = [H.partition_spec(placed_leaves[i].sharding) for i in arrays]
    out_specs = tuple(H.partition_spec(g.sharding) for g in got)
    colls, _, _ = H.run_xla(flat, [leaves[i] for i in arrays], in_specs, out_specs, MESH)
    xla = H.bytes_per_device(colls)
    assert log.total_bytes <= xla, f"{key} {layout}: nabla {log.total_bytes} B/device, XLA {xla}\n{log.summary()}\n" \
                                   + "\n".join(map(repr, colls))


class CNN(nn.Module):
    """Convolutions with Flax's max and average pools between them, and a dense head (NHWC, as Flax lays out)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), padding="SAME", name="conv1")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(8, (3, 3), padding="SAME", name="conv2")(x))
        x = nn.avg_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        return nn.Dense(10, name="head")(x.reshape(x.shape[0], -1))


#: the image batch's layout: data parallel, spatially cut (rows over dp, columns over tp), and both
CNN_LAYOUTS = {"dp": [("dp", "tp"), None, None, None], "spatial": [None, "dp", "tp", None],
               "dp_rows": ["dp", "tp", None, None]}


@pytest.mark.parametrize("layout", sorted(CNN_LAYOUTS))
def test_flax_cnn_with_pools_and_its_gradients_equal_jax_jit(layout):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16, 16, 3)).astype(np.float32)
    y = rng.integers(0, 10, (8,)).astype(np.int32)
    model = CNN()
    params = jax.tree_util.tree_map(np.asarray, model.init(jax.random.PRNGKey(0), x))

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    def step(p, x, y):
        return jax.value_and_grad(loss)(p, x, y)
    want = [np.asarray(w) for w in jax.tree_util.tree_leaves(jax.jit(step)(params, x, y))]
    p = jax.tree_util.tree_map(lambda a: nb.tensor(a).shard(MESH, [None] * a.ndim), params)
    rows = CNN_LAYOUTS[layout][0]
    got = nb.import_jax(step)(p, nb.tensor(x).shard(MESH, CNN_LAYOUTS[layout]),
                              nb.tensor(y).shard(MESH, [rows] if rows else [None]))
    got = [g.numpy() for g in jax.tree_util.tree_leaves(got)]
    assert len(got) == len(want) == 7  # the loss and six parameters
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=f"{layout} {k}")
