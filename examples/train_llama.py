"""Train a small Llama-style language model on a device mesh, the way large ones are laid out.

    python examples/train_llama.py [--layout dp_tp_sp] [--steps 60] [--bf16] [--show-log]

A decoder of RMSNorm, rotary attention with a causal mask and SwiGLU, characters of Shakespeare's sonnets as
tokens (examples/data/sonnets.txt). Layouts (`--layout`):

- `single`: no mesh, the reference;
- `dp_tp`: Megatron-LM on a 2 x 4 mesh: batch over dp; attention heads and the MLP's hidden dim over tp
  (column-parallel wq/wk/wv/w1/w3, row-parallel wo/w2); the embedding table and the output head split over
  the vocabulary (vocabulary-parallel lookup and cross-entropy);
- `dp_tp_sp`: the same with sequence parallelism: between the blocks, the residual stream's sequence dim is
  split over tp (norms run on a quarter of it); an all_gather before attention and the MLP, a reduce_scatter
  after, in place of dp_tp's all_reduces;
- `fsdp`: ZeRO-3 on 8 devices: every parameter split over dp, gathered while it is used.

Every layout's losses equal the single run's. `--bf16`: bfloat16 parameters and activations, a float32
master copy in Adam; reductions accumulate in float32 and round once on every layout, as JAX's do, so the
layouts' bf16 losses agree too (within one bf16 ulp: a bf16 matmul's partial sums are summed in bf16).
`--show-log` prints one step's comm log.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

import nabla as nb  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "sonnets.txt"
CONFIG = dict(vocab=64, dim=64, heads=4, layers=2, hidden=128, seq=32, batch=8)


# ---- data ------------------------------------------------------------------------------------------------------


def tokens(path: Path = TEXT, vocab: int = 64) -> tuple[np.ndarray, list[str]]:
    """The text as character ids (the alphabet padded to ``vocab`` symbols, divisible by the mesh)."""
    text = path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    if len(chars) > vocab:
        raise ValueError(f"the text has {len(chars)} symbols, more than the vocabulary of {vocab}")
    index = {c: i for i, c in enumerate(chars)}
    return np.array([index[c] for c in text], dtype=np.int64), chars


def batches(ids: np.ndarray, batch: int, seq: int, seed: int = 0):
    """Random windows of ``seq + 1`` tokens: inputs and the next-token targets."""
    rng = np.random.default_rng(seed)
    while True:
        start = rng.integers(0, len(ids) - seq - 1, batch)
        window = np.stack([ids[s:s + seq + 1] for s in start])
        yield window[:, :-1], window[:, 1:]


# ---- the model ---------------------------------------------------------------------------------------------------


def init(cfg: dict = CONFIG, seed: int = 0) -> dict:
    """Parameters as numpy float32 arrays (the layouts place them)."""
    rng = np.random.default_rng(seed)
    D, F, V = cfg["dim"], cfg["hidden"], cfg["vocab"]

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    layers = [{"norm1": np.ones(D, np.float32), "wq": w(D, D), "wk": w(D, D), "wv": w(D, D), "wo": w(D, D),
               "norm2": np.ones(D, np.float32), "w1": w(D, F), "w3": w(D, F), "w2": w(F, D)}
              for _ in range(cfg["layers"])]
    return {"embed": (rng.standard_normal((V, D)) * 0.02).astype(np.float32), "layers": layers,
            "norm": np.ones(D, np.float32), "head": w(D, V)}


def rms_norm(x, g, eps: float = 1e-5):
    return x / nb.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def rotary_tables(seq: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotary embedding (Su et al., 2021), (seq, 1, dim) to broadcast over heads."""
    freq = 1.0 / 10000 ** (np.arange(0, dim, 2) / dim)
    angle = np.arange(seq)[:, None] * freq[None, :]
    angle = np.concatenate([angle, angle], -1)[:, None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = nb.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + turned * sin


def attention(h, p, cfg: dict, cos, sin):
    B, S, D = h.shape
    H = cfg["heads"]
    q = rotate((h @ p["wq"]).reshape(B, S, H, D // H), cos, sin)
    k = rotate((h @ p["wk"]).reshape(B, S, H, D // H), cos, sin)
    v = (h @ p["wv"]).reshape(B, S, H, D // H)
    out = nb.dot_product_attention(q, k, v, is_causal=True).reshape(B, S, D)  # FlashAttention: no scores kept
    return out @ p["wo"]


def mlp(h, p):
    return (nb.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]


def loss_fn(params: dict, ids, targets, cfg: dict = CONFIG, layout: "Layout | None" = None):
    """Mean next-token cross-entropy. ``layout`` says where the sequence-parallel moves go (None: none)."""
    S = ids.shape[1]
    cos, sin = rotary_tables(S, cfg["dim"] // cfg["heads"])
    dtype = params["embed"].dtype
    cos, sin = cos.astype(dtype), sin.astype(dtype)
    x = nb.take(params["embed"], ids, axis=0)
    x = layout.between(x) if layout else x
    for i, p in enumerate(params["layers"]):
        with nb.named_scope(f"layer{i}"):
            h = rms_norm(x, p["norm1"])
            h = layout.into_block(h) if layout else h
            x = x + (layout.out_of_block(attention(h, p, cfg, cos, sin)) if layout else attention(h, p, cfg, cos, sin))
            h = rms_norm(x, p["norm2"])
            h = layout.into_block(h) if layout else h
            x = x + (layout.out_of_block(mlp(h, p)) if layout else mlp(h, p))
    h = rms_norm(x, params["norm"])
    h = layout.into_block(h) if layout else h
    return nb.cross_entropy(h @ params["head"], targets)


# ---- layouts -----------------------------------------------------------------------------------------------------


class Layout:
    """Where a layout puts parameters and data, and (sequence parallelism) the residual stream's moves."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "fsdp":
            self.mesh = nb.DeviceMesh("cluster", (8,), ("dp",))
        elif name in ("dp_tp", "dp_tp_sp"):
            self.mesh = nb.DeviceMesh("cluster", (2, 4), ("dp", "tp"))
        elif name != "single":
            raise ValueError(f"unknown layout {name!r}")
        self.sp = name == "dp_tp_sp"

    def param_specs(self, params: dict) -> dict:
        """Megatron's tensor parallelism (column- then row-parallel, vocabulary-parallel ends); or FSDP's rows."""
        if self.name == "fsdp":
            shard = lambda a: ["dp"] + [None] * (a.ndim - 1)  # noqa: E731
            return {"embed": shard(params["embed"]), "norm": shard(params["norm"]), "head": shard(params["head"]),
                    "layers": [{k: shard(v) for k, v in p.items()} for p in params["layers"]]}
        col, row, rep = [None, "tp"], ["tp", None], [None]
        layer = {"norm1": rep, "wq": col, "wk": col, "wv": col, "wo": row, "norm2": rep, "w1": col, "w3": col,
                 "w2": row}
        return {"embed": ["tp", None], "norm": rep, "head": col, "layers": [dict(layer) for _ in params["layers"]]}

    def place(self, params: dict, dtype=np.float32) -> dict:
        if self.name == "single":
            return _tree_map(lambda a: nb.tensor(a.astype(dtype)), params)
        specs = self.param_specs(params)
        return _tree_map2(lambda a, s: nb.tensor(a.astype(dtype)).shard(self.mesh, s), params, specs)

    def data(self, ids: np.ndarray, targets: np.ndarray):
        if self.name == "single":
            return nb.tensor(ids), nb.tensor(targets)
        return (nb.tensor(ids).shard(self.mesh, ["dp", None]), nb.tensor(targets).shard(self.mesh, ["dp", None]))

    # sequence parallelism: the residual stream [dp, tp, -] between blocks
    def between(self, x):
        return x.with_sharding(self.mesh, ["dp", "tp", None]) if self.sp else x

    def into_block(self, h):
        return h.with_sharding(self.mesh, ["dp", None, None]) if self.sp else h

    def out_of_block(self, y):
        return y.with_sharding(self.mesh, ["dp", "tp", None]) if self.sp else y


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tree_map(fn, v) for v in tree]
    return fn(tree)


def _tree_map2(fn, tree, other):
    if isinstance(tree, dict):
        return {k: _tree_map2(fn, v, other[k]) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tree_map2(fn, v, o) for v, o in zip(tree, other)]
    return fn(tree, other)


# ---- training ----------------------------------------------------------------------------------------------------


def train(layout_name: str = "dp_tp", steps: int = 60, bf16: bool = False, lr: float = 3e-3, seed: int = 0,
          show_log: bool = False, cfg: dict = CONFIG) -> list[float]:
    """Train for ``steps`` Adam steps; returns the losses. Every layout sees the same batches."""
    ids, _ = tokens(vocab=cfg["vocab"])
    layout = Layout(layout_name)
    dtype = "bfloat16" if bf16 else np.float32
    if bf16:
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    params = layout.place(init(cfg, seed), dtype)
    opt = nb.optim.Adam(lr, master_dtype="float32" if bf16 else None)
    state = opt.init(params)
    step_fn = nb.value_and_grad(lambda p, x, y: loss_fn(p, x, y, cfg, layout if layout.sp else None))
    losses = []
    data = batches(ids, cfg["batch"], cfg["seq"], seed)
    for step in range(steps):
        x, y = layout.data(*next(data))
        if show_log and step == 0:
            with nb.comm_log() as log:
                loss, grads = step_fn(params, x, y)
            print(log.summary())
        else:
            loss, grads = step_fn(params, x, y)
        params, state = opt.update(grads, state, params)
        losses.append(float(loss.numpy()))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", default="dp_tp_sp", choices=["single", "dp_tp", "dp_tp_sp", "fsdp"],
                    help="single: one device; dp_tp: batch over dp, Megatron tensor parallelism over tp; dp_tp_sp: "
                         "and sequence parallelism around the norms; fsdp: every parameter split over dp (ZeRO-3) "
                         "(default: %(default)s)")
    ap.add_argument("--steps", type=int, default=60, help="training steps (default: %(default)s)")
    ap.add_argument("--bf16", action="store_true",
                    help="bfloat16 parameters and activations, Adam with a float32 master copy")
    ap.add_argument("--show-log", action="store_true", help="print the first step's comm log summary")
    args = ap.parse_args()
    losses = train(args.layout, args.steps, args.bf16, show_log=args.show_log)
    shown = list(range(0, len(losses), max(1, len(losses) // 10)))
    if losses and shown[-1] != len(losses) - 1:
        shown.append(len(losses) - 1)
    for i in shown:
        print(f"step {i:4d}  loss {losses[i]:.4f}")

if __name__ == "__main__":
    main()
