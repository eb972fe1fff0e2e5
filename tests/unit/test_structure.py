"""tools/structure.py: it runs on this checkout, and each of its counts is what a small tree built here holds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "structure.py"

FIXTURE = {
    "__init__.py": "",
    "services.py": "def get(name):\n    return name\n",
    "value.py": '''
class Value:
    __slots__ = ("_data", "_node", "__weakref__")

    def __init__(self, data):
        self._data = data  # its own module: not counted
        self._node = None
''',
    "tensor.py": '''
from .value import Value


class Tensor(Value):
    def keep(self, node):
        self._node = node  # a Value's attribute, set from outside value.py: 1
''',
    "other.py": '''
from . import collectives as C
from .collectives import _op  # same package: not counted


class Holder:
    def __init__(self):
        self._node = None  # Holder's own attribute: not counted


def rewire(x, y, a, b):
    x._node, y._data = a, b  # 2
    setattr(x, "_node", a)  # 1
    object.__setattr__(y, "_data", b)  # 1
    x.data = a  # not a Value attribute
    return C._logs, _op  # same package: not counted
''',
    "step.py": "class Step:\n    pass\n",
    "collectives.py": '''
from typing import NamedTuple


class Collective:
    pass


class CommEvent(NamedTuple):
    kind: str


def event(kind):
    return CommEvent(kind)  # the registry: not counted
''',
    "pkg/__init__.py": "",
    "pkg/a.py": '''
from typing import NamedTuple

from .. import collectives as C
from ..collectives import CommEvent, _op  # another package's private name: 1
from .b import _helper  # same package: not counted


class Step(NamedTuple):
    n: int


def make():
    return C.CommEvent("x"), CommEvent("y"), C._logs, _op, _helper  # 2 calls in 1 module; C._logs: 1
''',
    "pkg/b.py": '''
from collections import namedtuple

Step = namedtuple("Step", "a")


def _helper():
    return 1
''',
    "long.py": "x = 1\n" * 601,
    "just_fits.py": "x = 1\n" * 600,
}


def _fixture(root: Path) -> Path:
    for rel, text in FIXTURE.items():
        p = root / "nabla" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text.lstrip("\n"), encoding="utf-8")
    return root


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=REPO)


def test_it_runs_on_this_checkout_and_prints_integer_counts():
    out = _run()
    assert out.returncode == 0, out.stderr
    counts = re.findall(r"^(\S[^\[\n]*?): (?:yes |no )?\(?(\d+)\)? \[(\d+)\]", out.stdout, re.M)
    assert len(counts) == 7, out.stdout  # every count the issue names, each with its goal
    data = json.loads(_run("--json").stdout)
    assert set(data["counts"]) == {"step_classes", "comm_event_modules", "long_modules", "private_imports",
                                   "private_attributes", "services_module", "value_writes"}
    assert all(isinstance(v, int) and v >= 0 for v in data["counts"].values())


def test_its_counts_are_those_of_a_tree_built_for_them(tmp_path):
    out = _run("--root", str(_fixture(tmp_path)), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["counts"] == {"step_classes": 3, "comm_event_modules": 1, "long_modules": 1, "private_imports": 1,
                              "private_attributes": 1, "services_module": 1, "value_writes": 5}
    assert data["info"]["comm_event_calls"] == 2
    assert data["info"]["private_names_any_module"] == 5  # the same-package ones too
    assert [s[:2] for s in data["sites"]["long_modules"]] == [["nabla/long.py", 601]]
    assert sorted(s[0] for s in data["sites"]["value_writes"]) == ["nabla/other.py"] * 4 + ["nabla/tensor.py"]
    assert data["sites"]["private_attributes"][0][2] == "nabla.collectives._logs"
    text = _run("--root", str(tmp_path)).stdout
    assert "classes named Step: 3 [1]" in text and "services module: yes (1) [0]" in text


def test_check_fails_while_a_count_is_above_its_goal(tmp_path):
    assert _run("--root", str(_fixture(tmp_path)), "--check").returncode == 1
    clean = tmp_path / "clean"
    (clean / "nabla").mkdir(parents=True)
    (clean / "nabla" / "__init__.py").write_text("")
    (clean / "nabla" / "step.py").write_text("class Step:\n    pass\n")
    assert _run("--root", str(clean), "--check").returncode == 0
