"""Run ONNX's node tests through nox.Backend (tests/integration/test_onnx_backend.py) and write how many pass,
per op group (seed 001's unary elementwise, broadcast n-ary, reduction, matmul/gemm/einsum; conv/pool/norm;
other) and per input placement, to tests/integration/onnx_backend_counts.json:

    python -m tests.integration.onnx_backend_counts [--out PATH]

A test's group is its op's (``nabla.onnx.ops.group_of``); a function-expanded test (``*_expanded``) counts
for the op it expands; a test of several op types otherwise is "other". Tests the suite leaves out (element
types nabla cannot hold, ops it does not claim) are not counted as outcomes; they are counted under
"skipped", by why ONNX's runner skipped them (it makes a cpu and a cuda test of every test case of every
suite, and skips those the file does not select).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TEST_FILE = HERE / "test_onnx_backend.py"


class _Recorder:
    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.skip_reasons: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            else:
                outcome = report.outcome
            if report.nodeid not in self.outcomes or outcome != "passed":
                self.outcomes[report.nodeid] = outcome
            if outcome == "skipped" and isinstance(report.longrepr, tuple):
                self.skip_reasons[report.nodeid] = report.longrepr[2]


def _main_op(name: str, tests: dict) -> str | None:
    ops = {n.op_type for n in tests[name].model.graph.node}
    if len(ops) == 1:
        return next(iter(ops))
    base = re.sub(r"_expanded(_ver\d+)?$", "", name)
    if base != name and base in tests:
        ops = {n.op_type for n in tests[base].model.graph.node}
        if len(ops) == 1:
            return next(iter(ops))
    return None


SKIP_KINDS = {
    "cuda": "cuda copies of node tests (the backend runs on cpu)",
    "op": "node tests of ops nabla.onnx does not claim (or of other domains)",
    "model": "model suites (PyTorch-converted, PyTorch operator, simple and real models): node tests only here",
    "dtype": "node tests of claimed ops in element types nabla cannot hold (float8 e8m0, int4, int2, float4, strings...)",
    "placement": "spatial copies of tests whose inputs spatial places as batch does (run once)",
    "scope": "out of scope: training-mode Dropout and BatchNormalization, sequences, MaxPool's Indices",
}


def _skip_kind(nodeid: str, reason: str, module) -> str:
    """Why ONNX's runner skipped a test, the first of SKIP_KINDS that applies (a cuda copy of a bfloat16 test
    is a cuda copy)."""
    m = re.match(r".*::OnnxBackend(\w+?)ModelTest(?:_(\w+))?::(test_\w+)_(cpu|cuda)$", nodeid)
    if m is None or m.group(1) != "Node":
        return "model"
    if m.group(4) == "cuda":
        return "cuda"
    name = m.group(3)
    if "exclude" in reason:
        if module.UNHOLDABLE not in reason:
            return "scope"
        return "dtype" if name in module.NAMES else "op"
    return "placement" if m.group(2) and name in module.NAMES else "op"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "onnx_backend_counts.json")
    args = ap.parse_args()
    rec = _Recorder()
    start = time.perf_counter()
    # in this process (-n 0: not in xdist workers), where the recorder reads the test module
    code = pytest.main([str(TEST_FILE), "-q", "-n", "0", "-p", "no:cacheprovider"], plugins=[rec])
    seconds = time.perf_counter() - start
    module = next(m for m in list(sys.modules.values())
                  if getattr(m, "__file__", None) and Path(m.__file__).resolve() == TEST_FILE)
    import onnx

    from nabla.onnx.ops import GROUPS, group_of

    counts: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for nodeid, outcome in rec.outcomes.items():
        m = re.match(r".*::(OnnxBackendNodeModelTest(?:_(\w+))?)::(test_\w+)_cpu$", nodeid)
        if m is None or outcome == "skipped":
            continue
        placement = (m.group(2) or "batch").lower()
        op = _main_op(m.group(3), module.TESTS)
        counts[placement][group_of(op) if op else "other"][outcome] += 1
    groups = list(GROUPS) + ["other"]
    out = {
        "what": "ONNX backend node tests (onnx.backend.test) run through nabla.onnx.Backend on a 2-device mesh",
        "command": "python -m tests.integration.onnx_backend_counts",
        "onnx": onnx.__version__,
        "placements": {"batch": "every input sharded on dim 0 (when it has at least 2 elements)",
                       "spatial": "inputs of rank >= 3 sharded on dim 2 (the first spatial dim), rank-2 inputs "
                                  "on the last dim; only tests with such an input run under it"},
        "counts": {p: {g: dict(sorted(counts[p][g].items())) for g in groups if counts[p][g]}
                   for p in ("batch", "spatial")},
        "totals": {p: dict(sorted(sum(counts[p].values(), Counter()).items())) for p in ("batch", "spatial")},
        "skipped": {kind: sum(_skip_kind(n, r, module) == kind for n, r in rec.skip_reasons.items())
                    for kind in SKIP_KINDS},
        "skip_kinds": SKIP_KINDS,
        "pytest_exit_code": int(code),
    }  # (no timing: a run that counts the same leaves the tracked file as it was)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["counts"], indent=1))
    print(json.dumps(out["skipped"], indent=1), sum(out["skipped"].values()), "skipped")
    print(f"written to {args.out} ({seconds:.1f} s)")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
