"""Run ONNX's node tests through nox.Backend (tests/integration/test_onnx_backend.py) and write how many pass,
per op group (seed 001's unary elementwise, broadcast n-ary, reduction, matmul/gemm/einsum; conv/pool/norm;
other) and per input placement, to tests/integration/onnx_backend_counts.json:

    python -m tests.integration.onnx_backend_counts [--out PATH]

A test's group is its op's (``nabla.onnx.ops.group_of``); a function-expanded test (``*_expanded``) counts
for the op it expands; a test of several op types otherwise is "other". Tests the suite leaves out (element
types nabla cannot hold, ops it does not claim) are not counted.
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

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            else:
                outcome = report.outcome
            if report.nodeid not in self.outcomes or outcome != "passed":
                self.outcomes[report.nodeid] = outcome


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "onnx_backend_counts.json")
    args = ap.parse_args()
    rec = _Recorder()
    start = time.perf_counter()
    code = pytest.main([str(TEST_FILE), "-q", "-p", "no:cacheprovider"], plugins=[rec])
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
        "pytest_exit_code": int(code),
        "seconds": round(seconds, 1),
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["counts"], indent=1))
    print(f"written to {args.out}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
