"""The README's Python examples run as written (a new user's first contact must not be stale)."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3, "the README has Python examples"
    for code in blocks:  # each in a fresh interpreter, as a reader would run it
        if "@given" in code:
            code += "\ntest_double()\n"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"README block failed:\n{code}\n{out.stderr[-2000:]}"


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
