"""nb.import_jax (issue 29): a JAX program run as nabla ops, timed against the same program written in nabla.

    python benchmarks/import_jax.py [--quick] [--json PATH] [--parts eager,estimate,import]

* eager: the Llama training step of ``benchmarks/llama.py`` (RMSNorm, rotary attention, SwiGLU, cross-entropy,
  value_and_grad and Adam) on the 2 x 4 DP x TP mesh: the step written in ``jax.numpy`` (``llama.jax_step``)
  imported with ``nb.import_jax``, against the step written in nabla (``llama.eager_step``), same parameters,
  layouts and batch. Sides alternate sample by sample (``_timing.alternating``). Target: imported / native <= 1.3.
* estimate: ``nb.estimate`` of a 32-layer Llama-style training step on 1,024 simulated H100s (128 x 8, dp x tp,
  abstract tensors): the JAX step with its layers in one ``jax.lax.scan`` (stacked parameters), imported,
  against the same model written in nabla (``train_llama.loss_fn``, a Python loop over 32 layers). The wall
  time of the estimate call; the imported side's first call includes tracing. Target: imported / native <= 2.
* import: the Flax linen GPT + optax AdamW step of ``tests/integration/test_import_jax_models.py``, at a larger
  size: ``nb.import_jax(step)(...)`` from nothing to the first result (tracing, compiling the jaxpr, running it
  eagerly on 8 devices). Target: < 2 s.

The machine is reported with its load (``uptime``): the numbers are from a shared 2-core machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import llama as LB  # noqa: E402 - first: it sets XLA_FLAGS and one kernel thread before jax loads, and the paths

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from _env import write_results  # noqa: E402
import nabla as nb  # noqa: E402
import train_llama as L  # noqa: E402
from _timing import alternating, paired  # noqa: E402

EAGER_TARGET, ESTIMATE_TARGET, IMPORT_TARGET = 1.3, 2.0, 2.0


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# ---- eager: the imported Llama step against the nabla one ----------------------------------------------------


def imported_step():
    """The Llama step in jax.numpy, imported, on the native step's parameters, Adam state and batch."""
    layout = L.Layout("dp_tp")
    host = L.init(LB.CONFIG)
    params = layout.place(host)
    zeros = layout.place(L._tree_map(np.zeros_like, host))
    state = {"count": nb.tensor(np.int32(0)), "mu": zeros, "nu": zeros}
    x, y = LB.batch(layout)
    x, y = x.astype("int32"), y.astype("int32")
    step = nb.import_jax(LB.jax_step(jax, jnp, LB.jax_loss(jax, jnp, lambda v, where: v)))

    def run() -> float:
        loss, _, _ = step(params, state, x, y)
        return float(loss.numpy())
    return run


def eager(repeats: int) -> dict:
    native, _ = LB.eager_step("dp_tp")
    imported = imported_step()
    losses = {"native": native(), "imported": imported()}
    np.testing.assert_allclose(losses["imported"], losses["native"], rtol=1e-5)
    t = alternating({"native": native, "imported": imported}, repeats, calls=1)
    return {"unit": "ms", "layout": "dp_tp (2 x 4)", "config": LB.CONFIG, "loss": losses,
            "native": t["native"].as_dict(1e3), "imported": t["imported"].as_dict(1e3),
            "ratio": t["imported"].median / t["native"].median, "ratio_spread": paired(t["imported"], t["native"]),
            "target": EAGER_TARGET}


# ---- estimate: a 32-layer scanned JAX model against the nabla one on 1,024 devices ---------------------------

BIG = dict(vocab=32000, dim=2048, heads=16, layers=32, hidden=5632, seq=2048, batch=128)


def _abstract(tree, specs, mesh):
    return L._tree_map2(lambda a, s: nb.abstract(a.shape).shard(mesh, s), tree, specs)


class _Shape:
    """A parameter's shape, as ``train_llama.init`` lays them out, without its values."""

    def __init__(self, *shape):
        self.shape, self.ndim = shape, len(shape)


def _shapes(cfg: dict) -> dict:
    D, F, V = cfg["dim"], cfg["hidden"], cfg["vocab"]
    layer = {"norm1": _Shape(D), "wq": _Shape(D, D), "wk": _Shape(D, D), "wv": _Shape(D, D), "wo": _Shape(D, D),
             "norm2": _Shape(D), "w1": _Shape(D, F), "w3": _Shape(D, F), "w2": _Shape(F, D)}
    return {"embed": _Shape(V, D), "layers": [dict(layer) for _ in range(cfg["layers"])], "norm": _Shape(D),
            "head": _Shape(D, V)}


def scanned_loss(cfg: dict):
    """The Llama loss in jax.numpy with its layers in one lax.scan over stacked parameters."""
    cos, sin = L.rotary_tables(cfg["seq"], cfg["dim"] // cfg["heads"])
    H = cfg["heads"]

    def rms(x, g):
        return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    def block(x, q):
        B, S, D = x.shape
        heads = lambda h, w: (h @ w).reshape(B, S, H, D // H)  # noqa: E731
        h = rms(x, q["norm1"])
        s = jnp.einsum("bqhd,bkhd->bhqk", rotate(heads(h, q["wq"])), rotate(heads(h, q["wk"]))) / np.sqrt(D // H)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), heads(h, q["wv"])).reshape(B, S, D) @ q["wo"]
        h = rms(x, q["norm2"])
        return x + (jax.nn.silu(h @ q["w1"]) * (h @ q["w3"])) @ q["w2"], None

    def loss(p, ids, targets):
        x, _ = jax.lax.scan(block, jnp.take(p["embed"], ids, axis=0), p["layers"])
        logits = rms(x, p["norm"]) @ p["head"]
        picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
        return (jax.scipy.special.logsumexp(logits, -1) - picked).mean()
    return loss


def estimate(runs: int) -> dict:
    cluster = nb.Cluster(nb.Hardware.preset("h100-sxm-80gb"), nodes=128, devices_per_node=8)
    mesh = cluster.mesh("m", (128, 8), ("dp", "tp"))
    layout = L.Layout("dp_tp")
    shapes = _shapes(BIG)
    specs = layout.param_specs(shapes)
    params = _abstract(shapes, specs, mesh)
    ids = nb.abstract((BIG["batch"], BIG["seq"]), "int32").shard(mesh, ["dp", None])
    tgt = nb.abstract((BIG["batch"], BIG["seq"]), "int32").shard(mesh, ["dp", None])
    vg = nb.value_and_grad(lambda p, x, y: L.loss_fn(p, x, y, BIG))

    def native():
        return nb.estimate(vg, cluster)(params, ids, tgt)

    stacked = dict(params, layers={k: nb.abstract((BIG["layers"],) + shapes["layers"][0][k].shape).shard(
        mesh, [None] + specs["layers"][0][k]) for k in shapes["layers"][0]})
    loss = scanned_loss(BIG)

    def imported():
        g = nb.import_jax(jax.value_and_grad(loss))  # a new import each call: its first call traces
        return nb.estimate(g, cluster)(stacked, ids, tgt)

    iterations = scan_iterations(stacked, ids, tgt, loss)  # first: nothing is planned yet
    times: dict[str, list] = {"native": [], "imported": []}
    reports = {}
    for _ in range(runs):
        for name, fn in (("native", native), ("imported", imported)):
            t0 = time.perf_counter()
            reports[name] = fn()
            times[name].append(time.perf_counter() - t0)
    g = nb.import_jax(jax.value_and_grad(loss))
    g(stacked, ids, tgt)  # traced
    t0 = time.perf_counter()
    nb.estimate(g, cluster)(stacked, ids, tgt)
    warm = time.perf_counter() - t0
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"model": f"Llama-style, {BIG}", "mesh": "(128, 8) dp x tp, 1,024 H100s", "unit": "s",
            "native_s": med["native"], "imported_s": med["imported"], "imported_traced_s": warm,
            "all": times, "ratio": med["imported"] / med["native"], "ratio_traced": warm / med["native"],
            "step_time_ms": {k: r.step_time * 1e3 for k, r in reports.items()},
            "scan_iterations_ms": iterations,
            "target": ESTIMATE_TARGET}


def scan_iterations(stacked, ids, tgt, loss) -> dict:
    """Milliseconds of the first and of the other runs of each program run once per layer (the scan's bodies,
    forward and transposed, and the calls inside them), in the process's first abstract call: the first iteration
    plans every op, the others reuse the executor's plans."""
    from nabla.jax_import import interpreter as I
    runs: dict = {}
    run = I.Eval.run

    def timed(self, prog, consts, args):
        t0 = time.perf_counter()
        out = run(self, prog, consts, args)
        runs.setdefault(id(prog), []).append(time.perf_counter() - t0)
        return out
    I.Eval.run = timed
    try:
        nb.import_jax(jax.value_and_grad(loss))(stacked, ids, tgt)
    finally:
        I.Eval.run = run
    bodies = [v for v in runs.values() if len(v) == BIG["layers"]]
    return {"first": [round(b[0] * 1e3, 2) for b in bodies],
            "median_of_rest": [round(float(np.median(b[1:])) * 1e3, 2) for b in bodies]}


# ---- import: a Flax GPT + AdamW step, from nothing to its first result ----------------------------------------


def import_time(runs: int) -> dict:
    import test_import_jax_models as M
    M.V, M.D, M.HEADS, M.L, M.T, M.B = 512, 128, 4, 4, 64, 16
    step, args = M._lm(M.GPT())
    placed = M._placed(args, "tp")
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = nb.import_jax(step)(*placed)
        float(out[2].numpy())
        times.append(time.perf_counter() - t0)
    g = nb.import_jax(step)
    g(*placed)
    t0 = time.perf_counter()
    float(g(*placed)[2].numpy())
    again = time.perf_counter() - t0
    return {"model": "Flax linen GPT (vocab 512, dim 128, 4 heads, 4 layers, seq 64, batch 16) + optax AdamW, "
                     "Megatron TP on 2 x 4", "unit": "s",
            "first_call_s": times[0],  # the process's first: tracing, compiling, and every op planned cold
            "again_first_call_s": float(np.median(times[1:])) if len(times) > 1 else None,  # a new import: traced
            # and compiled again, its ops' plans cached
            "all": times, "second_call_s": again, "target": IMPORT_TARGET}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="eager,estimate,import")
    ap.add_argument("--json", type=Path, default=None, help="write here (default: benchmarks/results.json's "
                    "import_jax key, read by report.py for the README)")
    a = ap.parse_args()
    parts = a.parts.split(",")
    res: dict = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "threads": os.environ["OPENBLAS_NUM_THREADS"],
                 "load_before": load()}
    if "eager" in parts:
        res["eager"] = eager(5 if a.quick else 15)
        print("eager imported/native", round(res["eager"]["ratio"], 3), res["eager"]["ratio_spread"], flush=True)
    if "estimate" in parts:
        res["estimate"] = estimate(1 if a.quick else 3)
        print("estimate imported/native", round(res["estimate"]["ratio"], 3), "traced",
              round(res["estimate"]["ratio_traced"], 3), flush=True)
    if "import" in parts:
        res["import"] = import_time(1 if a.quick else 3)
        print("import first call s", round(res["import"]["first_call_s"], 3), "(a new import of it:",
              res["import"]["again_first_call_s"], ")", flush=True)
    res["load_after"] = load()
    write_results({"import_jax": res}, a.json)
    return res


if __name__ == "__main__":
    main()
