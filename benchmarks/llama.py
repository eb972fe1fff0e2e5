"""The language-model targets (issue 23): the Llama training step of ``examples/train_llama.py``, timed.

    python benchmarks/llama.py [--quick] [--json PATH] [--parts eager,jit,memory]

The model is ``train_llama``'s (RMSNorm, rotary attention with a causal mask, SwiGLU, vocabulary-parallel
embedding and cross-entropy) at ``CONFIG``; a step is the loss, its gradients (``nb.value_and_grad``) and an
Adam update, the loss reduced to a host float. Three parts:

* eager: the step sharded on 8 simulated devices (2 x 4 mesh; DP x TP and DP x TP + SP) against the same
  step unsharded (host arrays, no mesh). Every side runs nabla eagerly on numpy; a sharded value holds its
  distinct blocks materialised in one numpy array (grid x block, replicas held once), each op is one numpy
  call over all blocks, and collectives are summed over the grid.
  Target: sharded / unsharded <= 1.3x.
* jit: ``nb.jit`` of the step against ``jax.jit`` of the same step in ``jax.numpy`` (``NamedSharding`` in and
  out, ``with_sharding_constraint`` where nabla's sequence-parallel layout moves the residual stream), both
  on the same 8 XLA host devices. Target: time <= 1.1x, and collective bytes per device read from each
  compiled HLO (``tests/integration/xla_harness.py``) no more than XLA's.
* memory: ``nb.memory_log()`` of one DP x TP step, bf16 (float32 master copy in Adam) against float32. Target:
  bf16's parameters per device half of float32's, and its activations in the float dtype half of float32's
  (``activation_widths``): the integer token ids, targets and attention's query positions and FlashAttention's
  float32 log-sum-exp per query row keep their width in bf16, as they do in what JAX keeps for the same bf16
  step (``jax.ad_checkpoint.print_saved_residuals`` with JAX's Pallas FlashAttention: float32 only the
  log-sum-exp, int32 the ids and targets; ``tests/integration/test_llama.py``), so all activations can reach
  only 0.5x + those bytes / 2 / float32's.

Sides alternate sample by sample (``_timing.alternating``); times are medians with quartiles. ``run.py`` runs
this in a child process (key ``llama`` of ``results.json``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax loads
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one kernel thread (as run.py)
    os.environ.setdefault(_v, os.environ.get("NABLA_BENCH_THREADS", "1"))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
for _p in (HERE.parent / "tests" / "integration", HERE.parent / "examples", HERE, HERE.parent):
    sys.path.insert(0, str(_p))

import nabla as nb  # noqa: E402
from nabla.dtypes import is_inexact  # noqa: E402
import train_llama as L  # noqa: E402
from _timing import alternating, paired  # noqa: E402

# about 0.2 s per eager step on this machine (the example's own config takes 40 ms: mostly dispatch)
CONFIG = dict(vocab=64, dim=128, heads=4, layers=2, hidden=352, seq=64, batch=16)
LR = 3e-3
B1, B2, EPS = 0.9, 0.999, 1e-8  # nb.optim.Adam's defaults
EAGER_TARGET, JIT_TARGET, MEMORY_TARGET = 1.3, 1.1, 0.5
LAYOUTS = ("dp_tp", "dp_tp_sp")


def batch(layout: L.Layout):
    ids, _ = L.tokens(vocab=CONFIG["vocab"])
    return layout.data(*next(L.batches(ids, CONFIG["batch"], CONFIG["seq"])))


def loss_of(layout: L.Layout):
    return lambda p, x, y: L.loss_fn(p, x, y, CONFIG, layout if layout.sp else None)


def summarize(log) -> str:
    by: dict[tuple, list[int]] = {}
    for e in log.events:
        by.setdefault((e.kind, e.axes), []).append(e.bytes)
    return ", ".join(f"{k}[{','.join(a)}] x{len(v)} {sum(v):,} B" for (k, a), v in by.items()) or "none"


# ---- eager: sharded against unsharded ----------------------------------------------------------------------


def eager_step(layout_name: str, dtype=np.float32):
    """(one step returning the loss as a host float, the placed parameters); the update's result is dropped, so
    every call does the same work."""
    layout = L.Layout(layout_name)
    params = layout.place(L.init(CONFIG), dtype)
    opt = nb.optim.Adam(LR, master_dtype="float32" if dtype != np.float32 else None)
    state = opt.init(params)
    x, y = batch(layout)
    vg = nb.value_and_grad(loss_of(layout))

    def step() -> float:
        loss, grads = vg(params, x, y)
        opt.update(grads, state, params)
        return float(loss.numpy())

    return step, layout


def eager(repeats: int) -> dict:
    steps = {name: eager_step(name)[0] for name in ("single",) + LAYOUTS}
    losses = {name: s() for name, s in steps.items()}
    comm = {}
    for name in LAYOUTS:
        with nb.comm_log() as log:
            steps[name]()
        comm[name] = {"summary": summarize(log), "bytes_per_device": log.total_bytes}
    t = alternating(steps, repeats, calls=1)
    base = t["single"].median
    rows = {name: dict(t[name].as_dict(1e3), loss=losses[name]) for name in steps}
    ratios = {name: paired(t[name], t["single"]) for name in LAYOUTS}
    return {"unit": "ms", "rows": rows, "ratio": {k: t[k].median / base for k in LAYOUTS}, "ratio_spread": ratios,
            "comm": comm, "target": EAGER_TARGET}


# ---- jit: nb.jit against jax.jit -------------------------------------------------------------------------


def jax_loss(jax, jnp, constrain):
    """The model in jax.numpy; ``constrain(x, where)`` places the residual stream as nabla's layout does."""
    cos, sin = L.rotary_tables(CONFIG["seq"], CONFIG["dim"] // CONFIG["heads"])

    def rms(x, g):
        return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    def attention(h, q):
        B, S, D = h.shape
        H = CONFIG["heads"]
        heads = lambda w: (h @ w).reshape(B, S, H, D // H)  # noqa: E731
        out = jax.nn.dot_product_attention(rotate(heads(q["wq"])), rotate(heads(q["wk"])), heads(q["wv"]),
                                           is_causal=True)
        return out.reshape(B, S, D) @ q["wo"]

    def loss(p, ids, targets):
        x = constrain(jnp.take(p["embed"], ids, axis=0), "between")
        for q in p["layers"]:
            x = x + constrain(attention(constrain(rms(x, q["norm1"]), "into"), q), "out")
            h = constrain(rms(x, q["norm2"]), "into")
            x = x + constrain((jax.nn.silu(h @ q["w1"]) * (h @ q["w3"])) @ q["w2"], "out")
        logits = constrain(rms(x, p["norm"]), "into") @ p["head"]
        picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
        return (jax.scipy.special.logsumexp(logits, -1) - picked).mean()

    return loss


def jax_step(jax, jnp, loss):
    """value_and_grad and Adam as nb.optim.Adam computes it (bias-corrected, as optax.adam)."""
    tm = jax.tree_util.tree_map

    def step(p, s, ids, targets):
        v, g = jax.value_and_grad(loss)(p, ids, targets)
        t = s["count"] + 1
        mu = tm(lambda m, g: m * B1 + g * (1 - B1), s["mu"], g)
        nu = tm(lambda n, g: n * B2 + (g * g) * (1 - B2), s["nu"], g)
        c1, c2 = 1 - B1 ** t.astype(jnp.float32), 1 - B2 ** t.astype(jnp.float32)
        new = tm(lambda x, m, n: x - (m / c1) / (jnp.sqrt(n / c2) + EPS) * LR, p, mu, nu)
        return v, new, {"count": t, "mu": mu, "nu": nu}

    return step


def jit_layout(layout_name: str, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import xla_harness as H

    # nabla: the eager step, compiled
    layout = L.Layout(layout_name)
    host = L.init(CONFIG)
    params = layout.place(host)
    opt = nb.optim.Adam(LR)
    state = opt.init(params)
    x, y = batch(layout)
    vg = nb.value_and_grad(loss_of(layout))

    def step(p, s, x, y):
        v, g = vg(p, x, y)
        p, s = opt.update(g, s, p)
        return v, p, s

    lowered = nb.jit(step).lower(params, state, x, y)
    compiled, arrays = lowered.compiled((params, state, x, y))
    ours = H.collectives(compiled.as_text())

    # jax: the same step in jax.numpy, the same shardings
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    named = lambda s: NamedSharding(mesh, P(*s))  # noqa: E731
    specs = layout.param_specs(host)
    pshard = L._tree_map2(lambda a, s: named(s), host, specs)
    rep, data = named([]), named(["dp", None])
    sshard = {"count": rep, "mu": pshard, "nu": pshard}
    at = {"between": ["dp", "tp", None], "into": ["dp", None, None], "out": ["dp", "tp", None]}

    def constrain(v, where):
        return jax.lax.with_sharding_constraint(v, named(at[where])) if layout.sp else v

    jp = jax.device_put(host, pshard)
    zeros = jax.device_put(L._tree_map(np.zeros_like, host), pshard)
    js = {"count": jax.device_put(np.int32(0), rep), "mu": zeros, "nu": zeros}
    ids, targets = (jax.device_put(np.asarray(t.numpy()).astype(np.int32), data) for t in (x, y))
    jc = jax.jit(jax_step(jax, jnp, jax_loss(jax, jnp, constrain)), in_shardings=(pshard, sshard, data, data),
                 out_shardings=(rep, pshard, sshard)).lower(jp, js, ids, targets).compile()
    xla = H.collectives(jc.as_text())

    # the same values: loss and updated parameters
    v_nb, p_nb, _ = lowered(params, state, x, y)
    v_jax, p_jax, _ = jc(jp, js, ids, targets)
    np.testing.assert_allclose(float(v_nb), float(v_jax), rtol=1e-4)
    for a, b in zip(jax.tree_util.tree_leaves(L._tree_map(lambda t: t.numpy(), p_nb)),
                    jax.tree_util.tree_leaves(p_jax)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)

    def host_loss(out):  # every output ready, then device 0's copy of the loss to the host, on both sides
        return float(np.asarray(jax.block_until_ready(out)[0].addressable_data(0)).reshape(-1)[0])

    t = alternating({"nabla": lambda: host_loss(compiled(*arrays)), "jax": lambda: host_loss(jc(jp, js, ids, targets))},
                    repeats)
    return {"nabla": t["nabla"].as_dict(1e3), "jax": t["jax"].as_dict(1e3),
            "ratio": t["nabla"].median / t["jax"].median, "ratio_spread": paired(t["nabla"], t["jax"]),
            "nabla_bytes": H.bytes_per_device(ours), "xla_bytes": H.bytes_per_device(xla),
            "nabla_collectives": _kinds(ours), "xla_collectives": _kinds(xla), "loss": float(v_nb)}


def _kinds(colls) -> str:
    by: dict[str, list[int]] = {}
    for c in colls:
        by.setdefault(c.kind, []).append(c.bytes)
    return ", ".join(f"{k} x{len(v)} {sum(v):,} B" for k, v in sorted(by.items())) or "none"


def jitted(repeats: int) -> dict:
    import jax
    return {"unit": "ms", "devices": 8, "jax": jax.__version__, "target": JIT_TARGET,
            "layouts": {name: jit_layout(name, repeats) for name in LAYOUTS}}


# ---- memory: bf16 against float32 ---------------------------------------------------------------------------


def activation_widths(log) -> dict[str, int]:
    """One device's activations at their peak by what sets their width: ``float`` (the program's float dtype:
    what bf16 halves), ``integer`` (token ids and targets, attention's query positions: the same in any float
    dtype) and ``float32`` (statistics an op keeps in float32 whatever its dtype, its declared extra bytes:
    FlashAttention's log-sum-exp). Why: only ``float`` can halve; JAX keeps the other two too (its saved
    residuals of the same step, ``tests/integration/test_llama.py``)."""
    steps = log.steps
    dtypes = {u.value: u.dtype for st in steps for u in st.uses if u.value}
    dtypes.update((st.out, st.out_dtype) for st in steps)
    extra = {st.out: st.extra for st in steps if st.extra}
    acts = [b for b in log.buffers() if b.kind == "activations"]
    level = [sum(b.bytes for b in acts if b.made <= i <= b.freed) for i in range(-1, len(steps))]
    at = int(np.argmax(level)) - 1  # the first step at the activations' peak
    assert level[at + 1] == max(log.by_kind["activations"].values(), default=0)
    out = {"float": 0, "integer": 0, "float32": 0}
    for b in acts:
        if b.made <= at <= b.freed:
            stats = extra.get(b.value, 0)
            kind = "float" if is_inexact(dtypes[b.value]) else "integer"
            out[kind] += b.bytes - stats
            out["float32"] += stats
    return out


def memory() -> dict:
    """Per-device bytes of each kind over one DP x TP step (the most any device holds at once), and the
    activations at their peak by width (``activation_widths``)."""
    import ml_dtypes
    out, widths = {}, {}
    for name, dtype in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        with nb.memory_log() as log:
            step, _ = eager_step("dp_tp", dtype)
            step()
        out[name] = {k: max(v.values(), default=0) for k, v in log.by_kind.items()}
        out[name]["peak"] = max(log.peak.values(), default=0)
        widths[name] = activation_widths(log)
    ratio = {k: out["bfloat16"][k] / out["float32"][k] for k in out["float32"] if out["float32"][k]}
    ratio["float_activations"] = widths["bfloat16"]["float"] / widths["float32"]["float"]
    return {"layout": "dp_tp", "devices": 8, "bytes": out, "activation_widths": widths, "ratio": ratio,
            "target": MEMORY_TARGET}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="eager,jit,memory")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    parts = a.parts.split(",")
    res: dict = {"date": time.strftime("%Y-%m-%d"), "config": CONFIG, "optimizer": f"Adam({LR})",
                 "mesh": "2x4 (dp, tp)", "threads": os.environ["OPENBLAS_NUM_THREADS"]}
    if "eager" in parts:
        res["eager"] = eager(5 if a.quick else 21)
        print(json.dumps(res["eager"]["ratio"]), res["eager"]["ratio_spread"], flush=True)
    if "jit" in parts:
        res["jit"] = jitted(5 if a.quick else 21)
        print({k: (v["ratio"], v["nabla_bytes"], v["xla_bytes"]) for k, v in res["jit"]["layouts"].items()}, flush=True)
    if "memory" in parts:
        res["memory"] = memory()
        print(res["memory"]["ratio"], flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
