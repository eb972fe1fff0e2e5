"""What the README promises beyond its snippets: the demo and the examples run. (The README's and the docs'
Python blocks are run by ``test_docs.py``.)"""

import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_demo_runs():
    out = subprocess.run([sys.executable, "-m", "nabla"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "all values equal numpy: True" in out.stdout
    assert "all_to_all" in out.stdout and "all_reduce" in out.stdout


def test_examples_run():
    examples = sorted((README.parent / "examples").glob("*.py"))
    assert len(examples) >= 2
    for path in examples:
        out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{path.name} failed:\n{out.stderr[-2000:]}"
