"""Every Python snippet in README.md and docs/ runs, and the docs site builds with warnings as errors.

A page's ```python blocks run in order, in one fresh interpreter and one namespace, as a reader pasting them
would run them. The child gets 8 forced jax CPU devices (``XLA_FLAGS``, set before anything imports jax), so
blocks that use ``nb.jit``, ``nb.backend("jax")`` or ``to_jax`` run as written. A block is left out only when
the line before it is ``<!-- skip-test: reason -->`` (for things like multi-process launch commands).
Line numbers in a failing block's traceback are the page's own: the script keeps every line in place.
A ```text block that follows a tested ```python block (nothing but blank lines between) is what that block
prints, or a run of its lines: the test compares them, so no output shown in the docs can go stale.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
SKIP = re.compile(r"^<!--\s*skip-test:\s*(?P<reason>\S.*?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")


def blocks(page: Path) -> tuple[list[tuple[int, list[str]]], list[str]]:
    """The page's ```python blocks as (first code line number, lines), and the skip reasons met."""
    found, skipped, _ = _scan(page)
    return found, skipped


def outputs(page: Path) -> dict[int, list[str]]:
    """For each tested ```python block (by its first code line) followed by a ```text block: that text."""
    return _scan(page)[2]


def _scan(page: Path):
    lines = page.read_text(encoding="utf-8").splitlines()
    out, skipped, shown, i = [], [], {}, 0
    last_python_end = None  # the fence line closing the last tested python block
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        lang, start = m.group("lang"), i + 1
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert lang not in ("py", "python3", "pycon", "ipython"), \
            f"{page.name}:{i + 1}: write ```python so the block is tested (found ```{lang})"
        if lang == "python":
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = SKIP.match(before)
            if skip:
                skipped.append(skip.group("reason"))
                last_python_end = None
            else:
                out.append((start + 1, lines[start:end]))
                last_python_end = end
        elif lang == "text" and last_python_end is not None and \
                all(not x.strip() for x in lines[last_python_end + 1:i]):
            shown[out[-1][0]] = lines[start:end]
            last_python_end = None
        else:
            last_python_end = None
        i = end + 1
    return out, skipped, shown


def script(page: Path) -> str:
    """The page with everything but its tested Python blocks blanked, so tracebacks give the page's lines."""
    n = len(page.read_text(encoding="utf-8").splitlines())
    text = [""] * n
    for first, code in blocks(page)[0]:
        text[first - 1:first - 1 + len(code)] = code
        text[first - 2] = f"print({MARK!r} + '{first}', flush=True)"  # on the fence line: where its output starts
    return "\n".join(text) + "\n"


MARK = "\x00block at line "


def printed(stdout: str) -> dict[int, list[str]]:
    """What each block printed, by its first code line."""
    out: dict[int, list[str]] = {}
    for part in stdout.split(MARK)[1:]:
        first, _, rest = part.partition("\n")
        out[int(first)] = rest.splitlines()
    return out


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


TESTED = [p for p in PAGES if blocks(p)[0]]


@pytest.mark.parametrize("page", TESTED, ids=_rel)
def test_page_snippets_run(page: Path, tmp_path: Path) -> None:
    path = tmp_path / (page.stem.replace("-", "_") + "_snippets.py")
    path.write_text(script(page), encoding="utf-8")
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (f"a Python block of {_rel(page)} failed (line numbers are the page's):\n"
                                 f"{out.stderr[-3000:]}")
    got = printed(out.stdout)
    for first, want in outputs(page).items():
        have = [line.rstrip() for line in got.get(first, [])]
        want = [line.rstrip() for line in want]
        shown = any(have[k:k + len(want)] == want for k in range(len(have) - len(want) + 1))
        assert shown, (
            f"{_rel(page)}: the ```text block after the Python block at line {first} is not (a run of the lines) "
            f"what it prints:\n" + "\n".join(difflib.unified_diff(want, have, "page", "printed", lineterm="")))


def test_readme_and_docs_have_snippets() -> None:
    assert ROOT / "README.md" in TESTED, "the README shows runnable Python"
    assert len(TESTED) >= 5, [_rel(p) for p in TESTED]


def test_skips_are_rare_and_say_why() -> None:
    reasons = [r for p in PAGES for r in blocks(p)[1]]
    assert len(reasons) <= 6, reasons


def test_skip_marker_is_recognised(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n<!-- skip-test: needs two processes -->\n```python\n"
                    "raise SystemExit(1)\n```\n\n```python\nassert x == 1\n```\n", encoding="utf-8")
    found, skipped = blocks(page)
    assert [first for first, _ in found] == [4, 13] and skipped == ["needs two processes"]
    assert script(page).splitlines()[12] == "assert x == 1" and "SystemExit" not in script(page)


def test_text_after_a_block_is_its_output(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("```python\nprint(1 + 1)\n```\n\n```text\n2\n```\n\nprose\n\n```text\nnot an output\n```\n"
                    "```python\nx = 3\n```\nprose\n```text\nnot one either\n```\n", encoding="utf-8")
    assert outputs(page) == {2: ["2"]}
    done = subprocess.run([sys.executable, "-c", script(page)], capture_output=True, text=True)
    assert printed(done.stdout) == {2: ["2"], 15: []}
    page.write_text("```python\nprint(1)\nprint(2)\nprint(3)\n```\n```text\n2\n3\n```\n", encoding="utf-8")
    assert outputs(page) == {2: ["2", "3"]}


def test_mkdocs_build_is_strict_and_clean(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{log[-4000:]}"
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "api" / "mesh-specs" / "index.html").exists()
