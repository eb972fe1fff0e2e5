"""Every nabla benchmark in one command: results.json and the README's benchmark section.

    python benchmarks/run.py            # full run (a quiet machine: about 10 minutes)
    python benchmarks/run.py --quick    # the same rows with short timings (about 3 minutes)
    python benchmarks/report.py         # rewrite README's section from benchmarks/results.json

Sections (each row is the same work on every side, labelled with what each side does):

* dispatch: nabla's cached time per op on small sharded operands against numpy on the global array;
* cases: nabla against numpy, JAX (eager on N forced CPU devices, eager on one device, jax.jit on N) and
  PyTorch DTensor (LocalTensorMode on a fake process group of N ranks);
* training: a DP x TP MLP step (forward, backward, SGD update) on 2x4 devices against the same step
  unsharded, JAX eager and jitted, DTensor and plain torch;
* jit: ``jit_training.py`` (nb.jit against jax.jit, compiled on both sides);
* onnx: ``onnx_models.py`` (ResNet-50 batch 8 on 8 simulated devices against onnxruntime);
* llama: ``llama.py`` (the Llama step of examples/train_llama.py: eager sharded against unsharded, nb.jit
  against jax.jit, bf16 against float32 memory);
* plan: a 24-layer transformer's communication planned on 1,024 abstract devices;
* autoshard: ``autoshard.py`` (nb.autoshard on Llama 1B/8B/70B shapes, 8 to 512 H100s, against the standard
  layouts).

Peers, jit and onnx run in child processes; a missing one is skipped with a note. Timings are medians of
calibrated repeats (``_timing.py``); where a ratio is a target, its sides run interleaved, best round kept
(training steps, nb.jit and the Llama step: sides alternate sample by sample, medians of as many samples each).
"""

from __future__ import annotations

import os
import sys


def _threads() -> int:
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return 1


# Kernel threads for every side, fixed before numpy (and its BLAS) loads and passed to every child: numpy's
# BLAS, torch, onnxruntime and XLA's Eigen pool. 1 by default: a fair, repeatable comparison on a shared
# machine (a multi-threaded BLAS whose threads get descheduled by other processes can run 10x slower).
THREADS = _threads()
THREAD_ENV = {} if THREADS <= 0 else {v: str(THREADS) for v in
                                      ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
os.environ.update(THREAD_ENV)

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import nabla as nb  # noqa: E402
from nabla import DeviceMesh  # noqa: E402
from _env import environment, load_average  # noqa: E402
from _timing import alternating, interleaved  # noqa: E402
import report  # noqa: E402

SCALING = (8, 64, 256)
JAX_DEVICES = (1, 8) + SCALING[1:]
# the training step (issue 12): batch, in, hidden, out; float32; SGD
TRAIN = dict(batch=256, din=512, hidden=2048, dout=512, lr=0.01)
TRAIN_REPEATS = {False: 21, True: 5}  # samples of every side of the training step (quick or not); peers alike


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def comm(fn) -> str:
    """What nabla sends when ``fn`` runs: kind[axes] xcount, bytes per device."""
    with nb.comm_log() as log:
        fn()
    return summarize(log)


def summarize(log) -> str:
    if not log.events:
        return "none"
    by: dict[tuple, list[int]] = {}
    for e in log.events:
        by.setdefault((e.kind, e.axes), []).append(e.bytes)
    return ", ".join(f"{k}[{','.join(a)}] x{len(v)} {_bytes(sum(v))}" for (k, a), v in by.items())


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


# ---- dispatch overhead ---------------------------------------------------------------------------------


def dispatch(quick: bool) -> dict:
    """Cached nabla ops on 64x64 float32 sharded over a 2x4 mesh against numpy on the 64x64 global array."""
    mesh = DeviceMesh("cluster", (2, 4), ("dp", "tp"))
    c, a, b = rnd(64, 64), rnd(64, 64, seed=1), rnd(64, 64, seed=2)
    C = nb.tensor(c).shard(mesh, ["dp", "tp"])
    A = nb.tensor(a).shard(mesh, ["dp", None])
    B = nb.tensor(b).shard(mesh, [None, "tp"])

    def np_softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    ops = [  # op, elementwise?, nabla call, nabla fn, numpy fn
        ("add", True, "C + C, both [dp,tp]", lambda: C + C, lambda: c + c),
        ("add, mixed specs", True, "A[dp,-] + B[-,tp] -> [dp,tp] (each operand sliced locally)", lambda: A + B,
         lambda: a + b),
        ("mul by scalar", True, "C * 2.0", lambda: C * 2.0, lambda: c * 2.0),
        ("exp", True, "nb.exp(C)", lambda: nb.exp(C), lambda: np.exp(c)),
        ("relu", True, "nb.relu(C)", lambda: nb.relu(C), lambda: np.maximum(c, 0)),
        ("matmul", False, "A[dp,-] @ B[-,tp] -> [dp,tp]", lambda: A @ B, lambda: a @ b),
        ("sum over a sharded dim", False, "C.sum(0) -> partial over dp", lambda: C.sum(0), lambda: c.sum(0)),
        ("transpose", False, "C.T", lambda: C.T, lambda: c.T),
        ("reshape", False, "C.reshape(2, 32, 64)", lambda: C.reshape(2, 32, 64), lambda: c.reshape(2, 32, 64)),
        ("basic slice", False, "A[:, 8:40] (unsharded dim)", lambda: A[:, 8:40], lambda: a[:, 8:40]),
        ("max over a sharded dim", False, "C.max(0) (max is not deferred)", lambda: C.max(0), lambda: c.max(0)),
        ("softmax", False, "nb.softmax(A, axis=-1) (unsharded dim)", lambda: nb.softmax(A, axis=-1),
         lambda: np_softmax(a)),
    ]
    # the mixed add's kernel as nabla runs it: numpy's add on what the devices hold (A's rows of dp, B's columns of
    # tp), in the order of B's blocks: A's rows first copied into that order as one 64-byte item per 16-element run
    # (a pack: the held rows read as 64-byte items, one transpose, one copy), then the add written into that copy,
    # the output's grid axes transposed to the result's [dp,tp] order (each device's block contiguous)
    a_held = np.ascontiguousarray(a.reshape(2, 1, 32, 64))  # (dp's blocks, stored once for tp's 4 replicas)
    b_held = np.ascontiguousarray(b.reshape(64, 4, 16).transpose(1, 0, 2))
    run64, f32 = np.dtype("V64"), np.dtype(np.float32)

    def blocks():
        packed = a_held.view(run64).transpose(3, 0, 2, 1).copy().view(f32)
        return np.add(packed, b_held.reshape(4, 2, 32, 16), out=packed).transpose(1, 0, 2, 3)

    np.testing.assert_array_equal(blocks().transpose(0, 2, 1, 3).reshape(64, 64), a + b)
    same_blocks = {"add, mixed specs": blocks}
    rows = []
    for op, elementwise, call, f, g in ops:
        sides = {"nabla": f, "numpy": g}
        if op in same_blocks:
            sides["blocks"] = same_blocks[op]
        t = interleaved(sides, quick)
        rows.append({"op": op, "call": call, "comm": comm(f), "nabla_us": t["nabla"] * 1e6,
                     "numpy_us": t["numpy"] * 1e6, "target_us": 5.0 if elementwise else 10.0})
        if "blocks" in t:
            rows[-1]["numpy_same_blocks_us"] = t["blocks"] * 1e6
    return {"setup": "64x64 float32 on a 2x4 mesh (dp, tp); C is [dp,tp], A [dp,-], B [-,tp]", "rows": rows}


# ---- cases against the peers -----------------------------------------------------------------------------


def cases(quick: bool) -> dict:
    """nabla and numpy for every row of the peers' table (the peers measure the same ids)."""
    out: dict[str, dict] = {}
    mesh = DeviceMesh("cluster", (2, 4), ("dp", "tp"))

    def case(cid, f, g=None):
        fns = {"nabla": f} | ({"numpy": g} if g is not None else {})
        t = interleaved(fns, quick, rounds=2 if quick else 3)
        out[cid] = {"nabla_us": t["nabla"] * 1e6, "numpy_us": t["numpy"] * 1e6 if g is not None else None,
                    "nabla_comm": comm(f)}

    a, b = rnd(64, 64), rnd(64, 64, seed=1)
    A = nb.tensor(a).shard(mesh, ["dp", None])
    B = nb.tensor(b).shard(mesh, [None, "tp"])
    case("add_64", lambda: A + B, lambda: a + b)
    case("matmul_64", lambda: A @ B, lambda: a @ b)

    a, b = rnd(2048, 2048), rnd(2048, 2048, seed=1)
    BA = nb.tensor(a).shard(mesh, ["dp", None])
    BB = nb.tensor(b).shard(mesh, [None, "tp"])
    case("matmul_2048", lambda: BA @ BB, lambda: a @ b)

    x = rnd(1024, 1024)
    X = nb.tensor(x).shard(mesh, [("dp", "tp"), None])
    case("reshard_lazy", lambda: X.with_sharding(mesh, [None, ("dp", "tp")]), lambda: x.copy())
    # what the devices hold after a real all_to_all: every block contiguous. nabla stores all blocks as one
    # array (*grid, *block), so one contiguous copy of it is every device's block materialised.
    case("reshard_materialised", lambda: np.ascontiguousarray(X.with_sharding(mesh, [None, ("dp", "tp")])._data),
         lambda: x.copy())

    k1, k2 = rnd(256, 1024), rnd(1024, 256, seed=1)
    K1 = nb.tensor(k1).shard(mesh, [None, "tp"])
    K2 = nb.tensor(k2).shard(mesh, ["tp", None])
    case("contract", lambda: (K1 @ K2).with_sharding(mesh, [None, None]), lambda: k1 @ k2)

    e, f = rnd(1024, 1024), rnd(1024, 1024, seed=1)
    for n in SCALING:
        m1 = DeviceMesh(f"line{n}", (n,), ("x",))
        e1 = nb.tensor(e).shard(m1, ["x", None])
        e2 = nb.tensor(f).shard(m1, ["x", None])
        case(f"add_1024_{n}", lambda: e1 + e2, lambda: e + f)

    # uneven dims are stored padded to the ceil-rule block: 1021 rows over 8 devices is 128 x 7 + 125
    m8 = DeviceMesh("line8", (8,), ("x",))
    g1, g2 = rnd(1021, 1024), rnd(1021, 1024, seed=1)
    u1 = nb.tensor(g1).shard(m8, ["x", None])
    u2 = nb.tensor(g2).shard(m8, ["x", None])
    case("add_uneven", lambda: u1 + u2, lambda: g1 + g2)
    case("sum_uneven_partial", lambda: u1.sum(0), lambda: g1.sum(0))
    case("sum_uneven", lambda: u1.sum(0).with_sharding(m8, [None]), lambda: g1.sum(0))

    xm, w1, w2 = rnd(64, 256), rnd(256, 1024, seed=1), rnd(1024, 256, seed=2)
    XM = nb.tensor(xm).shard(mesh, ["dp", None])
    W1 = nb.tensor(w1).shard(mesh, [None, "tp"])
    W2 = nb.tensor(w2).shard(mesh, ["tp", None])
    case("mlp", lambda: (nb.relu(XM @ W1) @ W2).with_sharding(mesh, ["dp", None]),
         lambda: np.maximum(xm @ w1, 0) @ w2)
    return out


# what each case is; `devices` is what the JAX-eager, jax.jit and DTensor columns run on
CASES = [
    ("add_64", 8, "add 64x64, A[dp,-] + B[-,tp] -> [dp,tp] (no communication on any side)"),
    ("matmul_64", 8, "matmul 64x64, A[dp,-] @ B[-,tp] -> [dp,tp] (no communication)"),
    ("matmul_2048", 8, "matmul 2048^3, A[dp,-] @ B[-,tp] -> [dp,tp] (no communication)"),
    ("reshard_lazy", 8, "reshard 1024^2 [(dp,tp),-] -> [-,(dp,tp)], nabla lazy: a strided view, nothing moves "
                        "(numpy: a copy)"),
    ("reshard_materialised", 8, "same reshard, materialised: every device's block contiguous (nabla: one "
                                "contiguous copy of all blocks; JAX: device_put; DTensor: redistribute)"),
    ("contract", 8, "[256,1024] @ [1024,256], K on tp, all_reduced to replicated"),
] + [(f"add_1024_{n}", n, f"add 1024^2, [x,-] on a 1-d mesh of {n}") for n in SCALING] + [
    ("add_uneven", 8, "add 1021x1024, [x,-] on 8 (uneven: nabla pads blocks; JAX cannot place uneven shards)"),
    ("sum_uneven_partial", 8, "sum over that uneven sharded dim, left as partial sums (no all_reduce; "
                              "DTensor: Partial)"),
    ("sum_uneven", 8, "sum over that uneven sharded dim, all_reduced to replicated"),
    ("mlp", 8, "MLP relu(x@w1)@w2, 64x256x1024x256, x[dp,-] w1[-,tp] w2[tp,-], all_reduced to [dp,-]"),
]


# ---- the training step -----------------------------------------------------------------------------------


def train_data() -> tuple[np.ndarray, ...]:
    r = np.random.default_rng(0)
    B, I, H, O = TRAIN["batch"], TRAIN["din"], TRAIN["hidden"], TRAIN["dout"]
    w1 = (r.standard_normal((I, H)) * 0.02).astype(np.float32)
    w2 = (r.standard_normal((H, O)) * 0.02).astype(np.float32)
    x = r.standard_normal((B, I)).astype(np.float32)
    y = r.standard_normal((B, O)).astype(np.float32)
    return w1, w2, x, y


def training(quick: bool) -> dict:
    """Forward (loss), forward+backward (value_and_grad) and a step (+ SGD update), sharded and unsharded."""
    w1, w2, x, y = train_data()
    mesh = DeviceMesh("cluster", (2, 4), ("dp", "tp"))
    opt = nb.optim.SGD(TRAIN["lr"])

    def loss(p, x, y):
        return ((nb.relu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    vg = nb.value_and_grad(loss)

    def replicated(v):  # the loss as a host float on every side (peers: jax P() then float, DTensor Replicate)
        return float((v.with_sharding(mesh, []) if v.sharding is not None else v).numpy())

    fns, comms = {}, {}
    for name, sharded in (("sharded", True), ("unsharded", False)):
        if sharded:
            p = {"w1": nb.tensor(w1).shard(mesh, [None, "tp"]), "w2": nb.tensor(w2).shard(mesh, ["tp", None])}
            xb, yb = nb.tensor(x).shard(mesh, ["dp", None]), nb.tensor(y).shard(mesh, ["dp", None])
        else:
            p = {"w1": nb.tensor(w1), "w2": nb.tensor(w2)}
            xb, yb = nb.tensor(x), nb.tensor(y)
        state = opt.init(p)

        def fwd(p=p, xb=xb, yb=yb):
            return replicated(loss(p, xb, yb))

        def fwd_bwd(p=p, xb=xb, yb=yb):
            v, g = vg(p, xb, yb)
            return replicated(v), g

        def step(p=p, xb=xb, yb=yb, state=state):
            v, g = vg(p, xb, yb)
            return replicated(v), opt.update(g, state, p)

        fns[(name, "forward")], fns[(name, "forward_backward")], fns[(name, "step")] = fwd, fwd_bwd, step
        if sharded:
            with nb.comm_log() as log:
                step()
            comms = {"summary": summarize(log),
                     "by_phase": {ph: sum(e.bytes for e in log.events if e.phase == ph)
                                  for ph in sorted({e.phase for e in log.events})}}
    t = alternating({f"{k[0]}/{k[1]}": f for k, f in fns.items()}, TRAIN_REPEATS[quick])
    rows = {name: {part: t[f"{name}/{part}"].median * 1e3 for part in ("forward", "forward_backward", "step")}
            for name in ("sharded", "unsharded")}
    return {"nabla_sharded": rows["sharded"], "nabla_unsharded": rows["unsharded"], "nabla_comm": comms}


# ---- planning with no data ---------------------------------------------------------------------------------


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
            o = nb.dot_product_attention(q, k, v).reshape(Bt, S, D) @ p["wo"]
            y = (o + x).with_sharding(mesh, ["dp", None, None])
            h = nb.relu(y @ p["w1"]) @ p["w2"]
            x = (h + y).with_sharding(mesh, ["dp", None, None])
            if i == 0:
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {"layers": layers, "mesh": "(64, 16) dp x tp, 1,024 devices", "seconds": total,
            "first_layer_seconds": first, "per_cached_layer_us": (total - first) / max(1, layers - 1) * 1e6,
            "counts": log.counts, "total_bytes": log.total_bytes, "est_comm_seconds": log.total_cost,
            "per_layer": [[e.kind, list(e.axes), e.bytes, e.op] for e in log.events[:len(log.events) // layers]]}


# ---- child processes ---------------------------------------------------------------------------------------


def child(argv: list[str], env: dict | None = None, timeout: float = 1800) -> tuple[dict | None, str]:
    """Run a benchmark script in its own process; its JSON comes back through a temporary file."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        path = [str(HERE.parent), str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(path),
                        NABLA_BENCH_THREADS=str(THREADS), **THREAD_ENV, **(env or {}))
        try:
            r = subprocess.run([sys.executable, *argv, "--json", str(out)], env=full_env, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout:.0f} s"
        if r.returncode != 0 or not out.exists():
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"failed ({last[:160]})"
        return json.loads(out.read_text()), ""


def have(*modules: str) -> str:
    """'' when every module is importable, else the names of the missing ones."""
    def missing(m: str) -> bool:
        try:
            return importlib.util.find_spec(m) is None
        except (ImportError, ValueError):
            return True

    return ", ".join(m for m in modules if missing(m))


def jax_env(devices: int) -> dict:
    flags = f"--xla_force_host_platform_device_count={devices}"
    if THREADS == 1:  # XLA's CPU kernels single-threaded (each forced device still runs on its own thread)
        flags += " --xla_cpu_multi_thread_eigen=false"
    return {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def peers(quick: bool, notes: list[str], log) -> dict:
    mode = ["--quick"] if quick else []
    out: dict[str, dict] = {"jax": {}, "dtensor": {}}
    missing = have("jax")
    if missing:
        notes.append(f"JAX columns skipped: {missing} not installed (pip install -e '.[bench]')")
    else:
        for n in JAX_DEVICES:
            log(f"jax peer, {n} device(s)")
            r, err = child([str(HERE / "_jax_peer.py"), str(n), *mode], jax_env(n))
            if r is None:
                notes.append(f"JAX with {n} device(s) skipped: {err}")
            else:
                out["jax"][str(n)] = r
    missing = have("torch")
    if missing:
        notes.append("DTensor and torch columns skipped: torch not installed (pip install torch==2.13.0, CPU)")
    else:
        for n in SCALING:
            log(f"dtensor peer, {n} ranks")
            r, err = child([str(HERE / "_dtensor_peer.py"), str(n), *mode])
            if r is None:
                notes.append(f"DTensor with {n} ranks skipped: {err}")
            else:
                out["dtensor"][str(n)] = r
    return out


def assemble_cases(ours: dict, peer: dict) -> list[dict]:
    jax, dt = peer["jax"], peer["dtensor"]
    rows = []
    for cid, devices, label in CASES:
        jn, j1, dn = jax.get(str(devices), {}), jax.get("1", {}), dt.get(str(devices), {})
        rows.append({"id": cid, "case": label, "devices": devices, **ours[cid],
                     "jax_eager_us": jn.get("eager", {}).get(cid), "jax_1dev_us": j1.get("eager", {}).get(cid),
                     "jax_jit_us": jn.get("jit", {}).get(cid), "dtensor_us": dn.get("eager", {}).get(cid)})
    return rows


def assemble_training(ours: dict, peer: dict) -> dict:
    j8, j1, d8 = peer["jax"].get("8", {}), peer["jax"].get("1", {}), peer["dtensor"].get("8", {})
    rows = [
        {"side": "nabla, 2x4 mesh (8 simulated devices), eager numpy", "devices": 8, "group": "nabla",
         **ours["nabla_sharded"]},
        {"side": "nabla unsharded (host arrays, no mesh)", "devices": 1, "group": "nabla", "baseline": True,
         **ours["nabla_unsharded"]},
        {"side": "JAX eager (op by op), 2x4 mesh on 8 forced CPU devices", "devices": 8, "group": "jax eager",
         **j8.get("train_eager", {})},
        {"side": "JAX eager (op by op), 1 device", "devices": 1, "group": "jax eager", "baseline": True,
         **j1.get("train_eager", {})},
        {"side": "jax.jit, NamedSharding 2x4 on 8 forced CPU devices", "devices": 8, "group": "jax.jit",
         **j8.get("train_jit", {})},
        {"side": "jax.jit, 1 device", "devices": 1, "group": "jax.jit", "baseline": True,
         **j1.get("train_jit", {})},
        {"side": "DTensor under LocalTensorMode, 2x4 mesh of 8 fake ranks", "devices": 8, "group": "torch",
         **d8.get("train_dtensor", {})},
        {"side": "torch eager, plain tensors (unsharded)", "devices": 1, "group": "torch", "baseline": True,
         **d8.get("train_torch", {})},
    ]
    return {"setup": dict(TRAIN, dtype="float32", mesh="2x4 (dp, tp)", layout="x, y [dp,-]; w1 [-,tp]; w2 [tp,-]",
                          optimizer="SGD", loss="mean squared error, read on the host each step (DTensor: replicated)"),
            "rows": rows, "nabla_comm": ours["nabla_comm"]}


# ---- main ----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short timings, every row (about 3 minutes)")
    ap.add_argument("--out", type=Path, default=HERE / "results.json", help="where to write the numbers")
    ap.add_argument("--no-peers", action="store_true", help="skip JAX, DTensor, nb.jit and ONNX")
    ap.add_argument("--no-readme", action="store_true", help="do not rewrite README.md's benchmark section")
    ap.add_argument("--threads", type=int, default=1,
                    help="kernel threads for every side (numpy's BLAS, XLA, torch, onnxruntime); 0: their defaults")
    ap.add_argument("--only", choices=["dispatch"],
                    help="re-measure one section alone (stamped with its own commit and load); keep the rest")
    args = ap.parse_args()
    started = time.perf_counter()
    if args.only == "dispatch":
        only_dispatch(args)
        return

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f} s] {msg}", file=sys.stderr, flush=True)

    res: dict = {"env": dict(environment(HERE), threads=THREADS), "mode": "quick" if args.quick else "full",
                 "notes": []}
    notes = res["notes"]
    log("nabla: dispatch")
    res["dispatch"] = dispatch(args.quick)
    log("nabla: cases")
    ours = cases(args.quick)
    log("nabla: training step")
    train = training(args.quick)
    log("nabla: planning")
    res["plan"] = transformer_plan()
    missing = have("scipy")
    if missing:
        res["autoshard"] = None
        notes.append(f"nb.autoshard skipped: {missing} not installed (pip install -e '.[plan]')")
    else:
        log("nb.autoshard on Llama shapes")
        res["autoshard"], err = child([str(HERE / "autoshard.py")] + (["--quick"] if args.quick else []))
        if err:
            notes.append(f"nb.autoshard skipped: {err}")
    peer = {"jax": {}, "dtensor": {}}
    res["jit"] = res["onnx"] = None
    if args.no_peers:
        notes.append("peers, nb.jit and ONNX skipped (--no-peers)")
    else:
        peer = peers(args.quick, notes, log)
        missing = have("jax")
        if missing:
            notes.append(f"nb.jit vs jax.jit skipped: {missing} not installed")
        else:
            log("nb.jit against jax.jit")
            res["jit"], err = child([str(HERE / "jit_training.py")] + (["--quick"] if args.quick else []),
                                    jax_env(8))
            if err:
                notes.append(f"nb.jit vs jax.jit skipped: {err}")
        missing = have("onnx", "onnxruntime")
        if missing:
            notes.append(f"ResNet-50 skipped: {missing} not installed (pip install -e '.[onnx]')")
        else:
            log("ResNet-50 against onnxruntime")
            res["onnx"], err = child([str(HERE / "onnx_models.py"), "--rounds", "2" if args.quick else "7",
                                      "--threads", str(THREADS)])
            if err:
                notes.append(f"ResNet-50 skipped: {err}")
    parts = ["eager", "memory"] + ([] if args.no_peers or have("jax") else ["jit"])
    log(f"the Llama step ({', '.join(parts)})")
    res["llama"], err = child([str(HERE / "llama.py"), "--parts", ",".join(parts)] +
                              (["--quick"] if args.quick else []), jax_env(8))
    if err:
        notes.append(f"the Llama step skipped: {err}")
    res["cases"] = assemble_cases(ours, peer)
    res["training"] = assemble_training(train, peer)
    if args.out.exists():  # what other scripts wrote there (megatron_table1.py: megatron, estimate_scale) stays
        old = json.loads(args.out.read_text())
        keep_other_cpus(res.get("onnx"), old.get("onnx"))
        for k, v in old.items():
            res.setdefault(k, v)
    res["env"]["load_average_at_end"] = load_average()
    res["env"]["seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    report.show(res)
    log(f"written {args.out}")
    if not args.no_readme and args.out.resolve() == (HERE / "results.json").resolve():
        report.update_readme(res)
        log("README.md's benchmark section regenerated")


def only_dispatch(args: argparse.Namespace) -> None:
    """The dispatch rows measured again on their own (a quiet moment is shorter than the whole run), stamped with
    the commit and the load they were measured at; every other section of the results file is kept."""
    env = environment(HERE)
    d = dispatch(args.quick)
    d["measured"] = {"commit": env["commit"], "date": env["date"], "load": env["load_average_at_start"][:1] +
                     load_average()[:1], "mode": "quick" if args.quick else "full", "threads": THREADS}
    res = json.loads(args.out.read_text()) if args.out.exists() else {}
    res["dispatch"] = d
    args.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    report.show(res)
    if not args.no_readme and args.out.resolve() == (HERE / "results.json").resolve():
        report.update_readme(res)


def keep_other_cpus(new: dict | None, old: dict | None) -> None:
    """ResNet-50's ratio to onnxruntime depends on the CPU (at one commit 2.06x on an Intel Xeon, 2.64x on an AMD
    EPYC): the ratios measured on other CPUs stay in the new record, under ``other_cpus``, and the previous run's
    join them when it ran on another CPU, so the README says which CPU each number came from."""
    if not new or not old:
        return

    def cpu(o: dict) -> tuple:
        env = o.get("env", o)
        return env.get("cpu"), env.get("cores")

    others = [x for x in old.get("other_cpus", []) if cpu(x) != cpu(new)]
    if cpu(old) != cpu(new) and "resnet50" in old:
        env, rn = old["env"], old["resnet50"]
        others = [x for x in others if cpu(x) != cpu(old)] + [{
            "cpu": env.get("cpu"), "cores": env.get("cores"), "rounds": rn.get("rounds"),
            "ratio_to_onnxruntime": rn["ratio_to_onnxruntime"],
            "source": f"benchmarks/run.py on {env.get('date', '?')[:10]} at {env.get('commit', '?')}"}]
    if others:
        new["other_cpus"] = others


if __name__ == "__main__":
    main()
