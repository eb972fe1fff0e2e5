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
