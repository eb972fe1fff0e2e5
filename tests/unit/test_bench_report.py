"""The README's benchmark section is exactly what benchmarks/report.py makes of benchmarks/results.json
(no benchmark runs here: only the generator)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


report = _report()


def test_readme_section_is_generated_from_results_json():
    res = report.load(ROOT / "benchmarks" / "results.json")
    readme = (ROOT / "README.md").read_text()
    assert readme.count(report.BEGIN) == 1 and readme.count(report.END) == 1
    assert report.current(readme) == report.markdown(res), (
        "README.md's benchmark section is stale: run `python benchmarks/report.py` to regenerate it from "
        "benchmarks/results.json")


def test_results_record_where_and_with_what():
    res = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    env = res["env"]
    for key in ("date", "machine", "cpu", "cpu_count", "load_average_at_start", "python", "versions"):
        assert key in env, key
    for pkg in ("numpy", "jax", "jaxlib", "torch", "onnx", "onnxruntime"):
        assert pkg in env["versions"], pkg
    assert res["mode"] in ("quick", "full")


def test_splice_changes_only_between_the_markers():
    readme = f"# title\n\nbefore\n{report.BEGIN}\nold\n{report.END}\nafter\n"
    out = report.splice(readme, "new\n")
    assert out == f"# title\n\nbefore\n{report.BEGIN}\nnew\n{report.END}\nafter\n"
    assert report.current(out) == "new\n"
    with pytest.raises(ValueError):
        report.splice("no markers", "x")


def test_missing_peers_render_without_crashing():
    res = report.load(ROOT / "benchmarks" / "results.json")
    res = dict(res, jit=None, onnx=None, notes=["JAX columns skipped: jax not installed"])
    if res.get("llama"):  # without jax, benchmarks/llama.py runs its eager and memory parts only
        res["llama"] = {k: v for k, v in res["llama"].items() if k != "jit"}
    res["cases"] = [dict(r, jax_eager_us=None, jax_1dev_us=None, jax_jit_us=None, dtensor_us=None)
                    for r in res["cases"]]
    res["training"] = dict(res["training"], rows=[r if r["group"] == "nabla" else
                                                  {k: r[k] for k in ("side", "devices", "group")}
                                                  for r in res["training"]["rows"]])
    md = report.markdown(res)
    assert "JAX columns skipped" in md and "nb.jit against jax.jit" not in md


class _Pipe:
    def __init__(self):
        self.parts = []

    def isatty(self):
        return False

    def write(self, s):
        self.parts.append(s)


def test_plain_markdown_when_not_a_terminal():
    res = report.load(ROOT / "benchmarks" / "results.json")
    out = _Pipe()
    report.show(res, out)
    text = "".join(out.parts)
    assert text == report.markdown(res)
    assert "| op | nabla call |" in text  # a markdown table, unsqueezed


def test_each_resnet_ratio_says_which_cpu_it_came_from():
    """The ratio to onnxruntime depends on the CPU (2.06x / 2.22x on an Intel Xeon, 2.64x / 2.76x on an AMD
    EPYC, both 2 cores): every ResNet-50 row and the table name the CPU each number was measured on."""
    res = report.load(ROOT / "benchmarks" / "results.json")
    md = report.markdown(res)
    rows = [line for line in md.splitlines() if line.startswith("| ResNet-50 batch")]
    cpus = [report.onnx_cpu(res["onnx"])] + [report.onnx_cpu(x) for x in res["onnx"].get("other_cpus", [])]
    assert len(cpus) >= 2 and len(set(cpus)) == len(cpus)
    for cpu in cpus:
        assert sum(f"on {cpu} |" in r for r in rows) == 2, (cpu, rows)  # batch sharded, rows sharded
    assert all(any(f"on {cpu} |" in r for cpu in cpus) for r in rows)
    assert f"Measured on {cpus[0]}: the ratio to onnxruntime depends on the CPU" in md


def _run():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_run_on_another_cpu_keeps_the_previous_cpu_s_ratios():
    keep = _run().keep_other_cpus
    ratios = {"onnxruntime": 1.0, "nabla 8 devices, batch sharded": 2.06}
    old = {"env": {"cpu": "Xeon", "cores": 2, "date": "2026-11-26T00:00", "commit": "abc"},
           "resnet50": {"rounds": 7, "ratio_to_onnxruntime": ratios},
           "other_cpus": [{"cpu": "EPYC", "cores": 2, "ratio_to_onnxruntime": {}, "source": "issue"}]}
    new = {"env": {"cpu": "EPYC", "cores": 2}, "resnet50": {}}
    keep(new, old)  # the EPYC entry is replaced by the new run; the Xeon run joins the others
    assert [(x["cpu"], x["ratio_to_onnxruntime"]) for x in new["other_cpus"]] == [("Xeon", ratios)]
    same = {"env": {"cpu": "Xeon", "cores": 2}, "resnet50": {}}
    keep(same, old)
    assert [x["cpu"] for x in same["other_cpus"]] == ["EPYC"]
