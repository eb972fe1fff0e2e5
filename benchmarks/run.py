"""nabla against numpy, JAX and PyTorch DTensor: one command, a table, optional JSON.

    python benchmarks/run.py [--quick] [--json results.json] [--no-peers]

Each figure is the median of calibrated repeats (see _timing.py). Peers run in child processes:
JAX with 8/64/256 forced host CPU devices, DTensor under LocalTensorMode on a fake process group.
A peer that is not installed is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import nabla as nb  # noqa: E402
from nabla import DeviceMesh  # noqa: E402
from _timing import measure  # noqa: E402

SCALING = (8, 64, 256)


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def nabla_side(quick: bool) -> dict:
    out: dict[str, float] = {}
    mesh = DeviceMesh("cluster", (2, 4), ("dp", "tp"))
    A = nb.tensor(rnd(64, 64)).shard(mesh, ["dp", None])
    B = nb.tensor(rnd(64, 64, seed=1)).shard(mesh, [None, "tp"])
    out["a_add"] = measure(lambda: A + B, quick)
    out["a_matmul"] = measure(lambda: A @ B, quick)
    with nb.strategy("aggressive"):
        out["a_add_aggressive"] = measure(lambda: A + B, quick)
    C = nb.tensor(rnd(64, 64)).shard(mesh, ["dp", "tp"])
    out["a_add_same_spec"] = measure(lambda: C + C, quick)
    na, nb_ = rnd(64, 64), rnd(64, 64, seed=1)
    out["a_numpy_add"] = measure(lambda: na + nb_, quick)

    a, b = rnd(2048, 2048), rnd(2048, 2048, seed=1)
    BA = nb.tensor(a).shard(mesh, ["dp", None])
    BB = nb.tensor(b).shard(mesh, [None, "tp"])
    out["b_matmul"] = measure(lambda: BA @ BB, quick)
    out["b_numpy_matmul"] = measure(lambda: a @ b, quick)

    x = rnd(1024, 1024)
    X = nb.tensor(x).shard(mesh, [("dp", "tp"), None])
    out["c_reshard"] = measure(lambda: X.with_sharding(mesh, [None, ("dp", "tp")]), quick)
    out["c_numpy_copy"] = measure(lambda: x.copy(), quick)

    k1, k2 = rnd(256, 1024), rnd(1024, 256, seed=1)
    K1 = nb.tensor(k1).shard(mesh, [None, "tp"])
    K2 = nb.tensor(k2).shard(mesh, ["tp", None])
    out["d_contract"] = measure(lambda: (K1 @ K2).with_sharding(mesh, [None, None]), quick)
    out["d_numpy_matmul"] = measure(lambda: k1 @ k2, quick)

    for n in SCALING:
        m1 = DeviceMesh(f"line{n}", (n,), ("x",))
        e1 = nb.tensor(rnd(1024, 1024)).shard(m1, ["x", None])
        e2 = nb.tensor(rnd(1024, 1024, seed=1)).shard(m1, ["x", None])
        out[f"e_add_{n}"] = measure(lambda: e1 + e2, quick)
    e, f = rnd(1024, 1024), rnd(1024, 1024, seed=1)
    out["e_numpy_add"] = measure(lambda: e + f, quick)
    # uneven dims are stored padded to the ceil-rule block: 1021 rows over 8 devices is 128 x 7 + 125
    m8 = DeviceMesh("line8", (8,), ("x",))
    u1 = nb.tensor(rnd(1021, 1024)).shard(m8, ["x", None])
    u2 = nb.tensor(rnd(1021, 1024, seed=1)).shard(m8, ["x", None])
    out["e_add_uneven"] = measure(lambda: u1 + u2, quick)
    out["e_sum_uneven"] = measure(lambda: u1.sum(0), quick)
    g1, g2 = rnd(1021, 1024), rnd(1021, 1024, seed=1)
    out["e_numpy_add_uneven"] = measure(lambda: g1 + g2, quick)
    out["e_numpy_sum_uneven"] = measure(lambda: g1.sum(0), quick)

    xm, w1, w2 = rnd(64, 256), rnd(256, 1024, seed=1), rnd(1024, 256, seed=2)
    XM = nb.tensor(xm).shard(mesh, ["dp", None])
    W1 = nb.tensor(w1).shard(mesh, [None, "tp"])
    W2 = nb.tensor(w2).shard(mesh, ["tp", None])
    out["f_mlp"] = measure(lambda: (nb.relu(XM @ W1) @ W2).with_sharding(mesh, ["dp", None]), quick)
    out["f_numpy_mlp"] = measure(lambda: np.maximum(xm @ w1, 0) @ w2, quick)
    return {k: v * 1e6 for k, v in out.items()}


def transformer_plan(layers: int = 24) -> dict:
    """Plan (no data) a Megatron-style stack on a (64, 16) mesh: heads and MLP sharded over tp."""
    mesh = DeviceMesh("pod", (64, 16), ("dp", "tp"))
    Bt, S, D, H, F = 256, 2048, 4096, 32, 16384
    Dh = D // H

    def w(shape, spec):
        return nb.abstract(shape).shard(mesh, spec)

    x = nb.abstract((Bt, S, D)).shard(mesh, ["dp", None, None])
    weights = [dict(wq=w((D, D), [None, "tp"]), wk=w((D, D), [None, "tp"]), wv=w((D, D), [None, "tp"]),
                    wo=w((D, D), ["tp", None]), w1=w((D, F), [None, "tp"]), w2=w((F, D), ["tp", None]))
               for _ in range(layers)]
    t0 = time.perf_counter()
    first = None
    with nb.comm_log() as log:
        for i, p in enumerate(weights):
            q = (x @ p["wq"]).reshape(Bt, S, H, Dh)
            k = (x @ p["wk"]).reshape(Bt, S, H, Dh)
            v = (x @ p["wv"]).reshape(Bt, S, H, Dh)
            s = nb.softmax(nb.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / Dh ** 0.5), axis=-1)
            o = nb.einsum("bhqk,bkhd->bqhd", s, v).reshape(Bt, S, D) @ p["wo"]
            y = (o + x).with_sharding(mesh, ["dp", None, None])
            h = nb.relu(y @ p["w1"]) @ p["w2"]
            x = (h + y).with_sharding(mesh, ["dp", None, None])
            if i == 0:
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {"layers": layers, "mesh": repr(mesh), "seconds": total, "first_layer_seconds": first,
            "per_cached_layer_us": (total - first) / max(1, layers - 1) * 1e6,
            "counts": log.counts, "total_bytes": log.total_bytes, "est_comm_seconds": log.total_cost,
            "per_layer": [(e.kind, e.axes, e.bytes, e.op) for e in log.events[:len(log.events) // layers]]}


def peer(script: str, devices: int, quick: bool) -> dict | str:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(HERE))
    try:
        r = subprocess.run([sys.executable, str(HERE / script), str(devices), "quick" if quick else "full"],
                           env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return f"timed out with {devices} devices"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"unavailable ({last[:120]})"
    return json.loads(r.stdout.strip().splitlines()[-1])


def fmt(us: float | None) -> str:
    if us is None:
        return "-"
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.1f} us"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short calibration (all sections, < 5 minutes)")
    ap.add_argument("--json", metavar="PATH", help="also write all numbers as JSON")
    ap.add_argument("--no-peers", action="store_true", help="skip JAX and DTensor")
    args = ap.parse_args()

    started = time.perf_counter()
    ours = nabla_side(args.quick)
    jax_r: dict = {}
    dt_r: dict = {}
    notes = []
    if not args.no_peers:
        for n in SCALING:
            for name, script, store in (("jax", "_jax_peer.py", jax_r), ("dtensor", "_dtensor_peer.py", dt_r)):
                r = peer(script, n, args.quick)
                if isinstance(r, str):
                    notes.append(f"{name} with {n} devices: {r}")
                else:
                    store.update(r)
    plan = transformer_plan()

    j, d = jax_r.get, dt_r.get
    rows = [
        ("a", "add 64x64, A[dp|-] + B[-|tp] (basic: both gathered)", ours["a_add"], j("a_add"), d("a_add"), None),
        ("a", "add 64x64, same, nb.strategy('aggressive'): no comm", ours["a_add_aggressive"], j("a_add"), d("a_add"), None),
        ("a", "add 64x64, both [dp|tp]", ours["a_add_same_spec"], None, None, ours["a_numpy_add"]),
        ("a", "matmul 64x64, A[dp|-] @ B[-|tp]", ours["a_matmul"], j("a_matmul"), d("a_matmul"), None),
        ("b", "matmul 2048^3 on 2x4 vs unsharded numpy", ours["b_matmul"], j("b_matmul"), None, ours["b_numpy_matmul"]),
        ("c", "reshard 1024^2 dim0(dp,tp) -> dim1(dp,tp) vs copy", ours["c_reshard"], j("c_reshard"), d("c_reshard"),
         ours["c_numpy_copy"]),
        ("d", "[256,1024]@[1024,256], K on tp, then replicated", ours["d_contract"], j("d_contract"), d("d_contract"),
         ours["d_numpy_matmul"]),
    ]
    for n in SCALING:
        rows.append(("e", f"add 1024^2 on {n} devices", ours[f"e_add_{n}"], j(f"e_add_{n}"), d(f"e_add_{n}"),
                     ours["e_numpy_add"]))
    rows.append(("e", "add 1021x1024 on 8 devices (uneven: padded blocks)", ours["e_add_uneven"], None, None,
                 ours["e_numpy_add_uneven"]))
    rows.append(("e", "sum over the uneven sharded dim (padding neutralised; partial sums)", ours["e_sum_uneven"], None, None,
                 ours["e_numpy_sum_uneven"]))
    rows.append(("f", "MLP relu(x@w1)@w2, x[dp|-] w1[-|tp] w2[tp|-]", ours["f_mlp"], j("f_mlp"), d("f_mlp"),
                 ours["f_numpy_mlp"]))

    header = ("", "case", "nabla", "jax", "dtensor", "numpy", "jax/nabla", "dtensor/nabla", "nabla/numpy")
    table = [header] + [(s, c, fmt(n), fmt(jx), fmt(dx), fmt(npy), ratio(jx, n), ratio(dx, n), ratio(n, npy))
                        for s, c, n, jx, dx, npy in rows]
    _print_table(table)
    print(f"\ne: 256 devices take {ours['e_add_256'] / ours['e_add_8']:.2f}x the time of 8 (target <= 3x)")
    print(f"\ng: planned {plan['layers']} transformer layers on {plan['mesh']} with nb.abstract in "
          f"{plan['seconds'] * 1e3:.1f} ms (first layer {plan['first_layer_seconds'] * 1e3:.1f} ms, then "
          f"{plan['per_cached_layer_us']:.0f} us per layer)")
    print(f"   collectives: {plan['counts']}, {plan['total_bytes'] / 2**30:.1f} GiB sent per device, "
          f"est. {plan['est_comm_seconds'] * 1e3:.1f} ms on a 25 GB/s ring")
    for kind, axes, nbytes, op in plan["per_layer"]:
        print(f"   per layer: {kind} over {','.join(axes)}: {nbytes / 2**20:.0f} MiB/device (in {op})")
    for n in notes:
        print("note:", n)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}"
    print(f"\nmachine: {machine}; total benchmark time {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"nabla": ours, "jax": jax_r, "dtensor": dt_r, "plan": plan,
                                               "notes": notes, "machine": machine,
                                               "date": time.strftime("%Y-%m-%d")}, indent=1, default=str))


def _print_table(rows) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        for k, r in enumerate(rows):
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
            if k == 0:
                print("  ".join("-" * w for w in widths))
        return
    t = Table(*rows[0])
    for r in rows[1:]:
        t.add_row(*r)
    Console().print(t)


if __name__ == "__main__":
    main()
