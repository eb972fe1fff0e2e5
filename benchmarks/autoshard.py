"""nb.autoshard on Llama-shaped training steps: 1B, 8B and 70B (Llama 3.2-1B, Llama 3-8B, Llama 2-70B: hidden
size, layers, heads, KV heads, MLP size) on 8, 64 and 512 H100s, 8 per node, as a (nodes, 8) ("dp", "tp") mesh.

    python benchmarks/autoshard.py [--quick] [--json PATH] [--cases 1B@8,8B@64]

Each case: the time autoshard takes to choose (this machine, one process: wall and CPU time), the chosen layout's
estimated step time and memory per device against the best standard layout (DP, FSDP, Megatron TP x DP / x FSDP,
with and without sequence parallelism), all priced by nb.estimate. The step starts from token ids (an embedding
lookup, ``nb.take``) and ends in the log-sum-exp loss against target ids (``nb.take_along_axis``), so three
arguments carry the batch: the activations, the ids and the targets. The vocabulary is Llama 2's 32,000. Memory
counts mixed-precision Adam's state (16 bytes per parameter). Where autoshard compared layouts stitched from
replayed layers (a program of more than 600 forward steps), every standard layout is also run in full, after the
timed search, and the row records how far each stitched step time was from its full run. ``run.py`` folds the JSON
into ``results.json`` under "autoshard"; run alone, this script updates that key only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import nabla as nb  # noqa: E402

#: name -> (hidden, layers, heads, kv heads, MLP hidden); sources: the models' config.json on their model cards
MODELS = {
    "1B": (2048, 16, 32, 8, 8192),  # Llama 3.2-1B
    "8B": (4096, 32, 32, 8, 14336),  # Llama 3-8B
    "70B": (8192, 80, 64, 8, 28672),  # Llama 2-70B
}
#: sequences per 8 devices in one step (chosen when attention materialised its scores: 70B's fit one per node)
PER_NODE = {"1B": 8, "8B": 4, "70B": 1}
VOCAB, SEQ = 32000, 2048
DEVICES = (8, 64, 512)
TARGET_SECONDS = 10.0


def rmsnorm(x, g, eps=1e-5):
    return (x / nb.sqrt(nb.mean(x * x, axis=-1, keepdims=True) + eps)).astype(x.dtype) * g


def block(x, p, heads, kv):
    """A Llama block: RMSNorm, grouped-query attention (``nb.dot_product_attention``, as FlashAttention runs it),
    RMSNorm, SwiGLU MLP, residuals."""
    B, S, h = x.shape
    d = h // heads
    y = rmsnorm(x, p["attn_norm"])
    q = (y @ p["wq"]).reshape(B, S, heads, d)
    k = (y @ p["wk"]).reshape(B, S, kv, d)
    v = (y @ p["wv"]).reshape(B, S, kv, d)
    o = nb.dot_product_attention(q, k, v).reshape(B, S, h)
    x = (x + o @ p["wo"]).astype(x.dtype)
    y = rmsnorm(x, p["mlp_norm"])
    u, w = y @ p["w1"], y @ p["w3"]
    return (x + ((u * nb.sigmoid(u)) * w) @ p["w2"]).astype(x.dtype)


def model(heads, kv):
    def loss(params, ids, targets):
        with nb.named_scope("embed"):
            x = nb.take(params["embed"], ids, axis=0)
        for i, p in enumerate(params["layers"]):
            with nb.named_scope(f"layer {i}"):
                x = block(x, p, heads, kv)
        with nb.named_scope("head"):
            logits = (rmsnorm(x, params["norm"]) @ params["head"]).astype("float32")
            picked = nb.take_along_axis(logits, nb.expand_dims(targets, -1), -1)
            return (nb.log(nb.exp(logits).sum(-1, keepdims=True)) - picked).mean()
    return nb.value_and_grad(loss)


def arguments(name: str, mesh, batch: int, seq: int = SEQ, vocab: int = VOCAB, layers: int | None = None):
    """Data-free parameters, token ids and targets, every dim open: autoshard chooses them all."""
    h, n, heads, kv, f = MODELS[name]
    n = layers or n
    d = h // heads

    def free(*shape):
        return nb.abstract(shape, "bfloat16").shard(mesh, [nb.DimSpec([], is_open=True)] * len(shape))

    layer = lambda: {"attn_norm": free(h), "wq": free(h, h), "wk": free(h, kv * d), "wv": free(h, kv * d),  # noqa: E731
                     "wo": free(h, h), "mlp_norm": free(h), "w1": free(h, f), "w3": free(h, f), "w2": free(f, h)}
    params = {"embed": free(vocab, h), "layers": [layer() for _ in range(n)], "norm": free(h), "head": free(h, vocab)}
    ids = nb.abstract((batch, seq), "int32").shard(mesh, [nb.DimSpec([], is_open=True)] * 2)
    targets = nb.abstract((batch, seq), "int32").shard(mesh, [nb.DimSpec([], is_open=True)] * 2)
    return params, (ids, targets), (heads, kv)


def case(name: str, devices: int) -> dict:
    hw = nb.Hardware.preset("h100-sxm-80gb")
    cluster = nb.Cluster(hw, nodes=devices // 8, devices_per_node=8)
    mesh = cluster.mesh("m", (devices // 8, 8), ("dp", "tp"))
    batch = devices // 8 * PER_NODE[name]
    params, data, (heads, kv) = arguments(name, mesh, batch=batch)
    fn = model(heads, kv)
    row = {"model": name, "devices": devices, "mesh": f"({devices // 8}, 8) dp x tp", "batch": batch, "seq": SEQ}
    t, cpu = time.perf_counter(), time.process_time()  # wall time, and this process's CPU time (other jobs
    # on a shared machine stretch the first, hardly the second)
    try:
        plan = nb.autoshard(fn, cluster, params, *data)
    except nb.ShardingError as e:
        row.update(seconds=time.perf_counter() - t, cpu_seconds=time.process_time() - cpu, infeasible=str(e))
        # the search itself, timed without the limit (what it would choose with HBM to spare)
        t, cpu = time.perf_counter(), time.process_time()
        plan = nb.autoshard(fn, cluster, params, *data, memory_limit=float("inf"))
        row["unlimited"] = summary(plan, time.perf_counter() - t, cluster, fn, params, data,
                                   time.process_time() - cpu)
        return row
    row.update(summary(plan, time.perf_counter() - t, cluster, fn, params, data, time.process_time() - cpu))
    return row


def summary(plan, seconds, cluster, fn, params, data, cpu_seconds=None) -> dict:
    """The choice against the best standard layout that fits: both as autoshard compared them, and both run in
    full through nb.estimate (the best baseline is run here, outside the timed search). Where the comparison was
    stitched, every standard layout is run in full too: ``stitched``, name -> (stitched ms, full ms)."""
    base = {k: {"step_ms": r.step_time * 1e3, "memory_gib": m / 2**30, "fits": m <= plan.memory_limit}
            for k, (r, m) in plan.baselines.items()}
    fitting = {k: v for k, v in base.items() if v["fits"]}
    best = min(fitting, key=lambda k: fitting[k]["step_ms"]) if fitting else None
    full = {}
    for k in base if not plan.exact else [best] if best is not None else []:
        full[k] = plan.report.step_time * 1e3 if k in plan.same else \
            nb.estimate(fn, cluster)(*_laid(plan.layouts[k], params, data)).step_time * 1e3
    stitched = {k: (base[k]["step_ms"], full[k]) for k in full} if not plan.exact else {}
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "step_ms": plan.report.step_time * 1e3,
            "compared_ms": plan.compared.step_time * 1e3,
            "memory_gib": plan.memory / 2**30, "mfu": plan.report.mfu, "exact": plan.exact, "source": plan.source,
            "same_as": list(plan.same), "baselines": base, "best_baseline": best,
            "best_baseline_ms": fitting[best]["step_ms"] if best else None,
            "best_baseline_full_ms": full.get(best), "stitched": stitched,
            "stitched_error": max((abs(a / b - 1) for a, b in stitched.values()), default=None),
            "words": str(plan).splitlines()}


def _laid(specs, params, data):
    """The arguments laid out as ``specs`` (a pytree like (params, ids, targets))."""
    flat_s, flat_a = _leaves(specs), _leaves((params,) + tuple(data))
    it = iter([nb.abstract(a.shape, a.dtype).shard(s) for a, s in zip(flat_a, flat_s)])
    return (_rebuild(params, it),) + tuple(next(it) for _ in data)


def _leaves(tree):
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return [tree]


def _rebuild(tree, it):
    if isinstance(tree, dict):
        return {k: _rebuild(v, it) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_rebuild(v, it) for v in tree]
    return next(it)


def line(r: dict) -> str:
    err = f"; stitched within {r['stitched_error'] * 100:.2f}% of full" if r.get("stitched_error") is not None else ""
    return (f"{r['seconds']:.2f} s (CPU {r.get('cpu_seconds') or 0:.2f} s), chosen {r['step_ms']:.1f} ms in full "
            f"({r['source']}; compared "
            f"{r['compared_ms']:.1f} ms), {r['memory_gib']:.1f} GiB; best baseline {r['best_baseline']} "
            f"{r['best_baseline_ms'] or 0:.1f} ms compared, {r['best_baseline_full_ms'] or 0:.1f} ms in full{err}")


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here (run.py); default: update results.json's 'autoshard' key")
    ap.add_argument("--quick", action="store_true", help="the 1B and 8B cases only")
    ap.add_argument("--cases", help="e.g. 1B@8,70B@512")
    a = ap.parse_args()
    if a.cases:
        cases = [(c.split("@")[0], int(c.split("@")[1])) for c in a.cases.split(",")]
    else:
        cases = [(m, n) for m in MODELS for n in DEVICES if not (a.quick and m == "70B")]
    import scipy.optimize  # noqa: F401 - loaded once per process, like nabla itself, before any case is timed
    load = [os.getloadavg()[0]]  # a shared machine's other jobs show in wall times: the load says how much
    rows = []
    for m, n in cases:
        r = case(m, n)
        rows.append(r)
        if "infeasible" in r:
            print(f"{m}@{n}: no layout fits ({r['seconds']:.2f} s, CPU {r['cpu_seconds']:.2f} s): {r['infeasible']}",
                  flush=True)
            r = r["unlimited"]
            print(f"   without a limit: {line(r)}", flush=True)
        else:
            print(f"{m}@{n}: {line(r)}", flush=True)
    load.append(os.getloadavg()[0])
    res = {"rows": rows, "target_seconds": TARGET_SECONDS, "vocab": VOCAB, "seq": SEQ,
           "hardware": "h100-sxm-80gb, 8 per node", "load": load, "cpus": os.cpu_count()}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    else:
        path = HERE / "results.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data["autoshard"] = res
        path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return res


if __name__ == "__main__":
    main()
