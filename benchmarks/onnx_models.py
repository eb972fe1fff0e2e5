"""ResNet-50 inference through nabla.onnx against onnxruntime, and every light model on a 4-device mesh.

    python benchmarks/onnx_models.py [--threads 1] [--rounds 5] [--batch 8] [--json PATH]
    python benchmarks/onnx_models.py --models [--json ...]   # all nine light models, rows and channels sharded

``benchmarks/run.py`` runs the ResNet-50 part in a child process and folds it into ``results.json``.

The model is onnx's light ResNet-50 (``onnx/backend/test/data/light``: the real architecture, 224x224 input)
with seeded random weights (``nabla.onnx.zoo``), its batch widened to ``--batch`` and its final softmax
dropped. One forward pass is timed, warm (after one untimed run: nabla's plans are cached by then, and its
weights placed and batch norms folded into the convs are kept for the next run, as ``nox.Backend.prepare``'s rep
keeps them and onnxruntime's session is built), in four ways: onnxruntime (CPU provider, ``--threads`` intra-op
threads, sequential executor), nabla unsharded (host arrays, no mesh), and nabla on 8 simulated devices with the
batch sharded and with the image rows sharded (spatial partitioning: halo exchange only). Rounds interleave
the four, so a busy machine slows them alike; the table gives medians. BLAS (numpy's) and onnxruntime get
the same thread count, set before numpy loads. onnxruntime keeps the memory it frees in its own arena; nabla
gets the same from glibc by ``NABLA_KEEP_FREED_MEMORY=1`` (set here; off by default, since it changes malloc
for the whole process), so neither side pays the kernel for fresh zeroed pages on every activation.
"""

from __future__ import annotations

import argparse
import os
import sys


def _threads() -> int:
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return 1


os.environ.setdefault("NABLA_KEEP_FREED_MEMORY", "1")  # as onnxruntime's arena (see the docstring)
THREADS = _threads()  # 0: the libraries' defaults
if THREADS > 0:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(THREADS)  # before numpy loads its BLAS

import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from statistics import median  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

import nabla as nb  # noqa: E402
import nabla.onnx as nox  # noqa: E402
from nabla.onnx.graph import run_kept  # noqa: E402
from nabla import DeviceMesh  # noqa: E402
from nabla.onnx import zoo  # noqa: E402


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                                text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = "unknown"
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine(),
            "cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__,
            "nabla": nb.__version__, "commit": commit, "threads": THREADS,
            "load_average_at_start": [round(v, 2) for v in os.getloadavg()]}


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def summarize(log) -> str:
    if not log.events:
        return "none"
    by: dict[str, list[int]] = {}
    for e in log.events:
        by.setdefault(e.kind, []).append(e.bytes)
    return ", ".join(f"{k} x{len(v)} {sum(v) / 1e6:.2f} MB" for k, v in sorted(by.items()))


# ---- ResNet-50 ---------------------------------------------------------------------------------------------


def resnet(batch: int, rounds: int) -> dict:
    model = zoo.light_model("resnet50", seed=0, batch=batch)
    inp, out = model.graph.input[0].name, model.graph.output[0].name
    x = np.random.default_rng(1).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    sess = session(model)
    mesh = DeviceMesh("eight", (8,), ("d",))
    xb = nb.tensor(x).shard(mesh, ["d", None, None, None])
    xr = nb.tensor(x).shard(mesh, [None, None, "d", None])
    kept: list[dict] = [{}, {}, {}]  # each nabla run's session: its placed weights and folded norms
    runs = {
        "onnxruntime": lambda: sess.run(None, {inp: x})[0],
        "nabla unsharded": lambda: run_kept(model, {inp: x}, None, kept[0])[out].numpy(),
        "nabla 8 devices, batch sharded": lambda: run_kept(model, {inp: xb}, None, kept[1])[out].numpy(),
        "nabla 8 devices, rows sharded": lambda: run_kept(model, {inp: xr}, None, kept[2])[out].numpy(),
    }
    want = runs["onnxruntime"]()
    first, errors, comm = {}, {}, {}
    for name, fn in runs.items():  # the untimed first run: plans, caches, the session's first call
        with nb.comm_log() as log:
            t = time.perf_counter()
            got = fn()
            first[name] = time.perf_counter() - t
        errors[name] = float(np.abs(got - want).max() / np.abs(want).max())
        comm[name] = summarize(log) if name != "onnxruntime" else ""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: median(v) for k, v in times.items()}
    split = {"nabla 8 devices, batch sharded": conv_split(model, mesh, inp, ["d", None, None, None]),
             "nabla 8 devices, rows sharded": conv_split(model, mesh, inp, [None, None, "d", None])}
    base = med["onnxruntime"]
    print(f"\nResNet-50 (onnx light model, random weights), batch {batch}, 3x224x224, float32; "
          f"{THREADS} thread(s) for onnxruntime and BLAS; median of {rounds} interleaved rounds\n")
    print("| run | median s | vs onnxruntime | first run s | max rel. error | collectives | devices used |")
    print("|---|---:|---:|---:|---:|---|---|")
    for k in runs:
        print(f"| {k} | {med[k]:.3f} | {med[k] / base:.2f}x | {first[k]:.2f} | {errors[k]:.1e} | {comm[k]} | "
              f"{split.get(k, '')} |")
    return {"model": "light_resnet50 (random weights)", "batch": batch, "input": [batch, 3, 224, 224],
            "rounds": rounds, "median_s": med, "ratio_to_onnxruntime": {k: med[k] / base for k in med},
            "first_run_s": first, "max_rel_error": errors, "collectives": comm, "mesh": repr(mesh),
            "conv_outputs_split": split, "all_s": times}


def conv_split(model, mesh: DeviceMesh, inp: str, dims: list) -> str:
    """How many Conv outputs nabla's propagation splits over all of ``mesh``'s devices (nox.annotate walks
    the graph on abstract inputs with the specs ``nox.run`` applies): evidence the run uses every device."""
    annotated = nox.annotate(model, mesh, {inp: dims})
    convs = [n for n in annotated.graph.node if n.op_type == "Conv"]
    split = 0
    for n in convs:
        conf = [c for c in n.device_configurations if c.configuration_id == mesh.name][0]
        spec = [s for s in conf.sharding_spec if s.tensor_name == n.output[0]][0]
        shards = 1
        for sd in spec.sharded_dim:
            for ss in sd.simple_sharding:
                shards *= ss.num_shards
        split += shards == mesh.size
    return f"{split}/{len(convs)} Conv outputs split {mesh.size} ways"


# ---- every light model on 4 devices ----------------------------------------------------------------------------


def models() -> list[dict]:
    mesh = DeviceMesh("quad", (4,), ("d",))
    rows = []
    print("\nonnx light models (224x224, batch 1, random weights), 4 devices; logits against onnxruntime\n")
    print("| model | placement | max rel. error | collectives (count, MB sent per device) | "
          "first run s | second run s | onnxruntime s |")
    print("|---|---|---:|---|---:|---:|---:|")
    for name in zoo.LIGHT_MODELS:
        m = zoo.light_model(name, seed=0)
        inp, out = m.graph.input[0].name, m.graph.output[0].name
        x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
        sess = session(m)
        want = sess.run(None, {inp: x})[0]
        t = time.perf_counter()
        sess.run(None, {inp: x})
        t_ort = time.perf_counter() - t
        placements = {
            "rows (input dim 2)": (m, [None, None, "d", None]),
            "channels (input dim 1, every Conv output on C)": (zoo.shard_channels(m, 4, config=mesh.name),
                                                               [None, "d", None, None]),
        }
        for pname, (model, dims) in placements.items():
            xs = nb.tensor(x).shard(mesh, dims)
            with nb.comm_log() as log:
                t = time.perf_counter()
                got = nox.run(model, {inp: xs}, mesh=mesh)[out]
                t1 = time.perf_counter() - t
            got = got.numpy()
            t = time.perf_counter()
            nox.run(model, {inp: xs}, mesh=mesh)[out].numpy()
            t2 = time.perf_counter() - t
            err = float(np.abs(got - want).max() / np.abs(want).max())
            print(f"| {name} | {pname} | {err:.1e} | {summarize(log)} | {t1:.2f} | {t2:.2f} | {t_ort:.3f} |",
                  flush=True)
            rows.append({"model": name, "placement": pname, "max_rel_error": err, "collectives": log.counts,
                         "bytes_per_device": log.total_bytes, "first_run_s": t1, "second_run_s": t2,
                         "onnxruntime_s": t_ort})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads and BLAS threads")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--models", action="store_true", help="also run every light model on 4 devices")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = ap.parse_args()
    info = machine()
    print(f"{info['date']}  {info['cpu']} ({info['cores']} cores)  numpy {info['numpy']}  onnxruntime "
          f"{info['onnxruntime']}  nabla {info['nabla']} @ {info['commit']}")
    print(f"load average {info['load_average_at_start']} (other processes slow both sides alike: rounds "
          f"interleave)")
    result = {"env": info, "resnet50": resnet(args.batch, args.rounds)}
    if args.models:
        result["light_models"] = models()
    info["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
