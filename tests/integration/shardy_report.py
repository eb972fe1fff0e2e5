"""Renders docs/shardy-agreement.md from the tests, so the page cannot drift from them.

Every row of the page is a test function of one of Shardy's propagation lit files (``shardy_catalog.CASES``,
in file order). A row eager execution can express is replayed by a test of
``test_shardy_agreement.py`` whose docstring names the file and ``func.func @case``; it agrees when that test
has no xfail mark (the marks are strict, so a green suite means exactly that), and differs for the reason its
mark gives otherwise. ``test_shardy_agreement.py::test_the_agreement_page_is_rendered_from_the_tests`` fails
when the page is out of date.

    python tests/integration/shardy_report.py           # print the page
    python tests/integration/shardy_report.py --write   # write docs/shardy-agreement.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOC = HERE.parent.parent / "docs" / "shardy-agreement.md"
sys.path.insert(0, str(HERE))

REVISIONS = {"basic_propagation.mlir": "05e26bc", "aggressive_propagation.mlir": "7c7aec8",
             "user_priority_propagation.mlir": "1a30b2b", "op_priority_propagation.mlir": "5dd93f8",
             "op_sharding_rule_registry.mlir": "009a911"}
STRATEGY = {"basic_propagation.mlir": "BASIC", "aggressive_propagation.mlir": "AGGRESSIVE",
            "user_priority_propagation.mlir": "AGGRESSIVE", "op_priority_propagation.mlir": "AGGRESSIVE",
            "op_sharding_rule_registry.mlir": "BASIC"}
REF = re.compile(r"(\w+\.mlir)[^,]*, func\.func\s+@(\w+)")


def outcomes() -> dict[tuple[str, str], list[tuple[str, str | None]]]:
    """(file, case) -> [(test name, xfail reason or None)] for every test of test_shardy_agreement.py."""
    import test_shardy_agreement as T

    out: dict[tuple[str, str], list[tuple[str, str | None]]] = {}
    for name, fn in vars(T).items():
        if not name.startswith("test_") or not callable(fn) or name == "test_registry_rule":
            continue
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "xfail"]
        reason = marks[0].kwargs.get("reason", "") if marks else None
        for f, case in REF.findall(fn.__doc__ or ""):
            out.setdefault((f, case), []).append((name, reason))
    for case in T.REGISTRY_CASES:
        out.setdefault(("op_sharding_rule_registry.mlir", case[0]), []).append(
            (f"test_registry_rule[{case[0]}]", T.REGISTRY_XFAIL.get(case[0])))
    return out


def _count(case: str) -> int:
    m = re.search(r"\((\d+)\)$", case)
    return int(m.group(1)) if m else 1


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    from shardy_catalog import CASES

    results = outcomes()
    used: set[tuple[str, str]] = set()
    summary = []
    tables = []
    unread = []
    for f, rows in CASES.items():
        lines = ["| case | expressible | nabla |", "|---|---|---|"]
        n = expressible = agree = 0
        for case, note in rows:
            if note.startswith("unread"):
                unread.append((f, case, note.split(":", 1)[1].strip()))
                continue
            n += _count(case)
            if not note.startswith("yes"):
                lines.append(f"| {_cell(case)} | {_cell(note)} | |")
                continue
            tests = results.get((f, case))
            if not tests:
                raise AssertionError(f"{f} @{case} is marked expressible but no test replays it")
            used.add((f, case))
            expressible += 1
            reasons = [r for _, r in tests if r is not None]
            if reasons:
                verdict = "**differs**: " + "; ".join(reasons)
            else:
                agree += 1
                verdict = "agrees"
            names = ", ".join(f"`{t}`" for t, _ in tests)
            lines.append(f"| {_cell(case)} | {_cell(note)} | {_cell(verdict)} ({names}) |")
        summary.append((f, n, expressible, agree))
        tables.append((f, lines))
    missing = sorted(set(results) - used)
    if missing:
        raise AssertionError(f"tests replay cases the catalog does not list as expressible: {missing}")
    return _page(summary, tables, unread)


def _page(summary, tables, unread) -> str:
    tot = [sum(s[i] for s in summary) for i in (1, 2, 3)]
    rate = 100 * tot[2] / tot[1]
    out = [
        "# Agreement with Shardy's propagation lit tests",
        "",
        "<!-- Rendered by tests/integration/shardy_report.py from tests/integration/shardy_catalog.py and the xfail",
        "     marks of tests/integration/test_shardy_agreement.py; do not edit by hand: run",
        "     `python tests/integration/shardy_report.py --write`. -->",
        "",
        "`tests/integration/test_shardy_agreement.py` replays openxla/shardy's propagation lit tests",
        "(`shardy/dialect/sdy/transforms/propagation/test/`) through nabla's public API, as an outside",
        "reference for nabla's propagation. This page lists every test function of the files read, says",
        "whether an eager forward run can express it, and for those that it can, whether nabla agrees, with the",
        "nabla test that replays it. It is rendered from the tests, so it says what the suite checks.",
        "",
        "Revisions read (the stored copies; the newest of each that was available):",
        "",
        "| file | revision | strategy replayed under |",
        "|---|---|---|",
    ]
    out += [f"| `{f}` | {REVISIONS[f]} | {STRATEGY[f]} |" for f, *_ in summary]
    out += [
        "",
        "## What \"expressible\" means",
        "",
        "nabla is eager: an op's result sharding is decided from its operands' shardings when it runs, and",
        "nothing after it can change it. A Shardy case is expressible when the CHECK lines of the op under",
        "test follow from the annotations of its operands alone:",
        "",
        "* function arguments with `sdy.sharding` become `t.shard(mesh, dims)`; unannotated arguments become",
        "  host arrays (placed open, `{?}`, by the op that meets them); `sdy.sharding_constraint` becomes",
        "  `shard`/`with_sharding`; a sharding on the empty mesh `<@empty_mesh, [...]>` becomes that layout",
        "  (no axes) on the other operand's mesh, as Shardy reads it;",
        "* not expressible: anything whose result comes from *later* uses (function result shardings,",
        "  constraints after the op, backward or sideways propagation into a value already computed), ops",
        "  that carry a sharding of their own before propagation (nabla results are always computed fresh;",
        "  an all-open, axis-free annotation such as `[{?}]` carries nothing and is allowed), propagation",
        "  barriers, `manual_computation`, `data_flow_edge`, custom calls and custom rules, maximal",
        "  (single-device) shardings, and ops nabla does not have.",
        "",
        "The strategy is pinned per file (table above; Shardy's `passes.td`: op-priority propagation runs a full",
        "aggressive propagation per iteration, user-priority propagation extends op-priority propagation).",
        "",
        "Representation differences that are *not* counted as disagreement:",
        "",
        "* A contracting factor that Shardy shards (visible in the operands' updated shardings) is",
        "  all-reduced by Shardy's partitioner right after the op; nabla keeps the sum pending as",
        "  `partial_axes` (Shardy's `unreduced`). The tests assert those partial axes: same factor decision,",
        "  later collective.",
        "* nabla keeps priorities on result dims (`{?}p1`) so that later eager ops still see them; Shardy's",
        "  final output has none. The tests do not compare priorities.",
        "",
        "## Summary",
        "",
        "| file | cases | expressible | agree | differ (xfail) |",
        "|---|---|---|---|---|",
    ]
    out += [f"| {f.removesuffix('.mlir')} | {n} | {e} | {a} | {e - a} |" for f, n, e, a in summary]
    out += [f"| **total** | **{tot[0]}** | **{tot[1]}** | **{tot[2]}** | **{tot[1] - tot[2]}** |", "",
            f"Agreement rate on expressible cases: **{tot[2]} / {tot[1]} = {rate:.0f} %**.", ""]
    if unread:
        out += ["Not counted (no stored copy holds them, so they could not be read):", ""]
        out += [f"* `{f}` `@{case}`: {why}" for f, case, why in unread]
        out += [""]
    for f, lines in tables:
        out += [f"## {f} ({STRATEGY[f]})", ""]
        if f == "op_sharding_rule_registry.mlir":
            out += ["These tests print each op's factor rule. Replayed eagerly: one mesh axis per factor (named after",
                    "it, size 2 unless the rule needs an axis to cover its factor exactly), every operand dim sharded on",
                    "its factors' axes, closed; the result must carry what the rule lets through (pass-through and",
                    "permutation factors keep their axis, reduction factors become pending sums, need-replication and",
                    "size-1 factors carry nothing).", ""]
        out += lines + [""]
    out += DIFFERENCES
    return "\n".join(out) + "\n"


DIFFERENCES = """## Where nabla differs, and why

**Meshes (deliberate).** nabla makes operands on different meshes a `ShardingError`: an eager
framework has no later pass to reconcile them, and silently replicating would hide a user error.
Shardy leaves such an op unsharded. Mesh identity includes the name in nabla (`DeviceMesh` is equal
by value, name included); Shardy's newest revision treats two meshes with the same axes and devices
as one ("shouldn't happen in practice, since we dedup meshes during import").

**Reshape: an uneven or overflowing minor-most factor (not deliberate; a known gap).** Like Shardy,
nabla lets the minor-most factor of a dim take the axes left over, unevenly or overflowing, and a
result dim that can hold a factor keeps it even when an operand's dim cannot (the kernel's output is
sliced locally: `minor_most_factor_non_divisible`, `reshape_swap_and_merge`, `reshape_split_and_swap`
agree). What nabla does not do is lay the *operand* out by such a factor: a reshape runs as a local
kernel on operand blocks laid out by the factors, and when the minor-most factor is uneven or
overflows, that factor layout is not the operand dim's ceil-rule tiling (8 over `a`=16 puts element
`d` on device `d`; the factors 2 x 4 on `a:(1)2, a:(2)8` put element `4i + c` on device `8i + c`),
which is all a nabla spec can name. So the factor is cut to what divides, and Shardy's layout, though
a valid nabla layout and cheaper to reach, would cost more through nabla's result (each xfail reason
gives the bytes). Closing it needs an in-op exchange from the dim tiling to the factor tiling, like
the window kind's halo exchange.

**Size-0 dims and size-1 axes.** Shardy gives a size-0 dim a factor (of size 0), so axes on it are
kept, and keeps size-1 axes with the axis before them; nabla treats a size-0 dim like a size-1 dim (no
factor) and assigns a size-1 axis to the next factor. Neither moves data (size-1 axes have one
device; a size-0 dim holds nothing).

## Shardy semantics worth knowing for nabla's design

* **BASIC and multi-axis lists.** Per factor, BASIC takes the longest list compatible with every
  tensor (a tensor's list must be a prefix of it, and only an open dim may be extended), falling
  back to the common prefix when lists diverge: closed `[b, a]` with closed `[b, c]` gives `[b]`;
  closed `[b, a]` with closed `[a, b]` gives nothing; closed `[b, a]` with open `[b]` gives
  `[b, a]` (the open operand grows, by a local slice).
* **AGGRESSIVE.** Closed dims no longer cap the result (`@empty_mesh_replaced_closed_dim_respected`
  gives `[a, b]` where BASIC gives `[a, -]`); an axis wanted by two factors goes to the factor of the
  larger tensor, then, in an elementwise op only, to the more sharded factor, then to the factor of
  the earlier tensor (the lhs of a dot), then to the first factor; a factor whose lists
  conflict outright (`[a]` vs `[b]`) gets nothing.
* **Priorities** are propagated round by round (p0 everywhere first) on top of op-priority and
  aggressive propagation, and are dropped from the final shardings; an eager framework must carry
  them on intermediate results instead, as nabla does.
* **Reshape sub-axes.** An axis straddling two factors splits into sub-axes (`a`=4 over
  `8 -> 2x4`: `a:(1)2, a:(2)2`), and chained reshapes keep splitting and re-merging them. The
  minor-most factor may be sharded unevenly or overflow; non-minor factors must divide.
* **`unreduced`** is Shardy's name for nabla's partial sums, but Shardy only keeps a sum pending when
  the op's sharding asks for it; otherwise the partitioner all-reduces right after the dot.
* **Rules.** Reverse is pointwise in Shardy's registry (no permutation factor); slice, pad,
  concatenate, reduce_window and select_and_scatter windows are permutation factors; sort's dim and
  cholesky/triangular_solve's matrix dims need replication; a variadic reduce shares its factors
  across all operands, so an unannotated operand is sharded like its annotated sibling.""".splitlines()


if __name__ == "__main__":
    text = render()
    if "--write" in sys.argv:
        DOC.write_text(text)
        print(f"wrote {DOC}")
    else:
        print(text)
