"""Train a Flax GPT written for JAX, on nabla: the model and its optax AdamW step are plain JAX; nb.import_jax runs
them as nabla ops on a 2 x 4 mesh, laid out as Megatron-LM lays a transformer out.

    python examples/import_flax_gpt.py [--layout tp|dp|fsdp] [--steps 30] [--show-log]

Characters of Shakespeare's sonnets (examples/data/sonnets.txt) are the tokens. The first step is checked
against ``jax.jit`` of the same function on the same values (loss and every updated parameter); then the loss
falls as training goes on. ``--show-log`` prints one step's comm log: each collective with the line of this file
(or the Flax module, for a gradient's sum) it came from.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import nabla as nb  # noqa: E402
from train_llama import batches, tokens  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 64, 4, 2, 32, 8


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        y = nn.LayerNorm(name="ln1")(x)
        q, k, v = (nn.Dense(d, use_bias=False, name=n)(y).reshape(b, t, HEADS, d // HEADS) for n in "qkv")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
        x = x + nn.Dense(d, name="proj")(o)
        return x + nn.Dense(d, name="fc2")(nn.gelu(nn.Dense(4 * d, name="fc1")(nn.LayerNorm(name="ln2")(x))))


class GPT(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, DIM, name="wte")(ids) + nn.Embed(SEQ, DIM, name="wpe")(jnp.arange(ids.shape[1]))
        for i in range(LAYERS):
            x = Block(name=f"h{i}")(x)
        return nn.Dense(VOCAB, use_bias=False, name="head")(nn.LayerNorm(name="lnf")(x))


model = GPT()
opt = optax.adamw(3e-3, eps=1e-3)


def loss_fn(params, ids, targets):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, ids), targets).mean()


def train_step(params, opt_state, ids, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, ids, targets)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# ---- layouts: the dims of each parameter (and its Adam moments) from its path ------------------------------------


def dims(layout: str, path, ndim: int) -> list:
    name = jax.tree_util.keystr(path)
    if layout == "fsdp":
        return [("dp", "tp")] + [None] * (ndim - 1) if ndim and not re.search(r"wpe|ln|count", name) else \
            [None] * ndim
    if layout == "dp" or not ndim:
        return [None] * ndim
    if re.search(r"\['[qkv]'\]|fc1|head", name):  # column-parallel: output features over tp
        return [None] * (ndim - 1) + ["tp"]
    if re.search(r"proj|fc2|wte", name) and ndim == 2:  # row-parallel (vocabulary-parallel for the embedding)
        return ["tp", None]
    return [None] * ndim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default="tp", choices=["tp", "dp", "fsdp"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--show-log", action="store_true")
    a = ap.parse_args()

    mesh = nb.DeviceMesh("cluster", (2, 4), ("dp", "tp"))
    ids, _ = tokens(vocab=VOCAB)
    data = batches(ids, BATCH, SEQ)
    x0, y0 = (t.astype(np.int32) for t in next(data))
    params = jax.tree_util.tree_map(np.asarray, model.init(jax.random.PRNGKey(0), x0))
    state = jax.tree_util.tree_map(np.asarray, opt.init(params))

    def place(tree):
        return jax.tree_util.tree_map_with_path(
            lambda p, v: nb.tensor(v).shard(mesh, dims(a.layout, p, np.ndim(v))), tree)
    rows = ["dp", None] if a.layout == "tp" else [("dp", "tp"), None]

    def batch(x, y):
        return nb.tensor(x.astype(np.int32)).shard(mesh, rows), nb.tensor(y.astype(np.int32)).shard(mesh, rows)

    step = nb.import_jax(train_step)
    p, s = place(params), place(state)
    with nb.comm_log() as log:
        p, s, loss = step(p, s, *batch(x0, y0))

    # the first step, checked against jax.jit of the same function on the same values
    want_p, _, want_loss = jax.jit(train_step)(params, state, x0, y0)
    np.testing.assert_allclose(loss.numpy(), want_loss, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(want_p)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    print(f"layout {a.layout}: step 1 equals jax.jit (loss {float(loss.numpy()):.4f}); "
          f"{len(log.events)} collectives, {log.total_bytes:,} bytes per device")
    if a.show_log:
        print(log.summary())

    losses = [float(loss.numpy())]
    for i in range(1, a.steps):
        p, s, loss = step(p, s, *batch(*next(data)))
        losses.append(float(loss.numpy()))
        if (i + 1) % 10 == 0:
            print(f"step {i + 1:3d}  loss {np.mean(losses[-10:]):.4f}")
    if len(losses) < 2:
        print("one step: no later loss to compare with the first (run with --steps 2 or more to check it falls)")
    else:  # the mean of the last (up to) five losses after the first
        later = losses[1:][-5:]
        assert np.mean(later) < losses[0], f"the loss did not fall: {losses[0]:.4f} -> {later}"
    print(f"the kernel of h0/fc1 stays laid out as {p['params']['h0']['fc1']['kernel'].sharding}")


if __name__ == "__main__":
    main()
