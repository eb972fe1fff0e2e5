"""A/B: run.py's per-op dispatch benchmark and its eager MLP training step, two source trees of nabla, alternating.

    python benchmarks/ab.py OLD_TREE NEW_TREE [--samples 15] [--json PATH]

Why: "no target gets slower by more than 10%" across a change is a ratio between two versions of nabla, and on a
shared machine only fine alternation makes it fair. Two long-lived worker processes, one per tree, each import
their tree's nabla and the same benchmark code (OLD_TREE's ``benchmarks/run.py``, copied aside; its ``dispatch``
and ``training`` build the operands, and the calls they would time are taken from them). The parent then asks
the workers in turn for one sample of one call (about 30 ms of repeated calls): old, new, new, old, ... on one
pinned CPU, so load from other processes lands on both alike. Each row: the median per call on each side, new / old, and the
quartiles of the per-sample-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median, quantiles

WORKER = r"""
import json, sys, time
sys.path[:0] = [{bench!r}, {tree!r}]
import nabla, run
assert nabla.__file__.startswith({tree!r}), nabla.__file__
calls, kept = {{}}, []

def keep(fns, *a, **k):  # the calls run.py would time, kept instead of timed
    kept.append(fns)
    return {{name: 1.0 for name in fns}}

class Kept:  # what run.py reads of a timing it asked for
    median = 1.0


def keep_all(fns, *a, **k):  # run.py's alternating timings (the training steps), kept instead of timed
    kept.append(fns)
    return {{name: Kept for name in fns}}


run.interleaved = keep
run.alternating = keep_all
for r, fns in zip(run.dispatch(True)["rows"], kept):
    calls[f"dispatch: {{r['op']}}"] = fns["nabla"]
kept.clear()
run.training(True)
calls.update({{f"training: {{name}}": f for name, f in kept[0].items()}})
print(json.dumps(list(calls)), flush=True)
for line in sys.stdin:
    name, n = line.rsplit(" ", 1)
    f, n = calls[name], int(n)
    t = time.perf_counter()
    for _ in range(n):
        f()
    print((time.perf_counter() - t) / n, flush=True)
"""


class Worker:
    """One tree's nabla in its own process, timing one named call on request."""

    def __init__(self, tree: str, bench: str, cpu: int | None) -> None:
        env = dict(os.environ, PYTHONPATH=tree, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
        self.p = subprocess.Popen([sys.executable, "-c", WORKER.format(tree=tree, bench=bench)], env=env, cwd=tree,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=pin)
        self.names = json.loads(self.p.stdout.readline())

    def sample(self, name: str, calls: int) -> float:
        self.p.stdin.write(f"{name} {calls}\n")
        self.p.stdin.flush()
        return float(self.p.stdout.readline())

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--samples", type=int, default=15, help="samples of each call on each side")
    ap.add_argument("--budget", type=float, default=0.03, help="seconds per sample")
    ap.add_argument("--cpu", type=int, default=0, help="pin both workers to this CPU (-1: no pinning), so "
                    "they share one core's load from other processes rather than each getting a core of its own")
    ap.add_argument("--only", default="", help="only the calls whose names contain this")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.cpu = None if a.cpu < 0 else a.cpu
    old, new = str(Path(a.old).resolve()), str(Path(a.new).resolve())
    with tempfile.TemporaryDirectory() as d:  # no nabla beside the copy: each worker imports its tree's
        bench = str(shutil.copytree(Path(old) / "benchmarks", Path(d) / "benchmarks"))
        w = {"old": Worker(old, bench, a.cpu), "new": Worker(new, bench, a.cpu)}
        rows = {}
        try:
            for name in [n for n in w["old"].names if a.only in n]:
                once = w["old"].sample(name, 1) + w["new"].sample(name, 1)  # warm both, size the samples
                calls = max(1, int(2 * a.budget / once))
                got: dict[str, list[float]] = {"old": [], "new": []}
                for i in range(a.samples):
                    for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
                        got[side].append(w[side].sample(name, calls))
                o, n = got["old"], got["new"]
                q = quantiles([y / x for x, y in zip(o, n)], n=4, method="inclusive")
                rows[name] = {"old_us": median(o) * 1e6, "new_us": median(n) * 1e6,
                              "ratio": median(n) / median(o), "pair_ratio_q1": q[0], "pair_ratio_q3": q[2],
                              "calls_per_sample": calls}
                r = rows[name]
                print(f"{name:48s} old {r['old_us']:10.1f} µs new {r['new_us']:10.1f} µs  new/old {r['ratio']:.3f} "
                      f"[{q[0]:.3f}, {q[2]:.3f}]{'  SLOWER >10%' if r['ratio'] > 1.10 else ''}", flush=True)
        finally:
            for x in w.values():
                x.close()
    res = {"old": old, "new": new, "samples": a.samples, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
