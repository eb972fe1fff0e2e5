"""The hot path's kernel: a program's ``op.fast`` call on the blocks its operands hold, compiled once per program
to straight-line Python (each operand's chain of views or its pack, the call, the transpose to the result as
stored). A cached elementwise op then costs numpy's calls and little else: interpreting the chains on every call
cost as much as the views they make. A ``Kernel`` is data: it prints as the code it runs, and compares and
pickles as what it was compiled from (the program's chains, packs, order and dtype)."""

from __future__ import annotations

from functools import lru_cache
from types import CodeType
from typing import Any

import numpy as np

_NDARRAY, _ASARRAY, _ERRSTATE = np.ndarray, np.asarray, np.errstate
# numpy's warnings from a kernel are this module's (a ``module=`` filter on nabla catches them), and warned once
# for all kernels, not once per kernel (Python keeps what was warned in the warning code's globals)
__warningregistry__: dict = {}


class Kernel:
    """``op.fast`` compiled for one program. ``call(held)``: the kernel's output block array (read-only) from ``held``,
    each operand's stored blocks (a Python scalar as it is). ``chains``: per operand, None (as stored), False (a
    scalar), or its chain of views (``("reshape", shape)``, ``("transpose", axes)``, last a ``("pack", (void, dtype,
    void_chain))``: a contiguous copy of it, each run of its last dim one void item, read as ``void_chain`` of the
    stored blocks' void items when that holds, else after the views). ``into``: the operand copy the output is
    written to; ``reorder``: the output's transpose; ``quiet``: numpy's floating-point warnings are off (a summand
    may overflow where its sum does not: the executor checks); ``dtype``: the result's."""

    __slots__ = ("op", "chains", "into", "reorder", "quiet", "dtype", "call")

    def __init__(self, op: Any, chains: tuple, into: int | None, reorder: tuple[int, ...] | None, quiet: bool,
                 dtype: np.dtype) -> None:
        self.op, self.chains, self.into, self.reorder, self.quiet, self.dtype = op, chains, into, reorder, quiet, dtype
        self.call = self._compile_and_call  # (compiled on first call: programs planned on shapes never call it)

    def _compile_and_call(self, held: list) -> np.ndarray:
        source, names = _source(self.chains, self.into, self.reorder, self.quiet)
        scope = {"__name__": __name__, "__warningregistry__": __warningregistry__, "fast": self.op.fast,
                 "DTYPE": self.dtype, "ndarray": _NDARRAY, "asarray": _ASARRAY, "errstate": _ERRSTATE, **names}
        exec(_compiled(source, self.op.name), scope)  # noqa: S102 - the code _source made
        self.call = scope["kernel"]
        return self.call(held)

    @property
    def source(self) -> str:
        """The code ``call`` runs."""
        return _source(self.chains, self.into, self.reorder, self.quiet)[0]

    def _key(self) -> tuple:  # (the op, not its function: an op pickles by key)
        return self.op, self.chains, self.into, self.reorder, self.quiet, self.dtype

    def __reduce__(self) -> tuple:
        return Kernel, self._key()

    def __eq__(self, other: object) -> bool:
        return type(other) is Kernel and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Kernel({self.op.name}:\n{self.source})"


@lru_cache(maxsize=1024)
def _compiled(source: str, name: str) -> CodeType:
    """``source`` compiled, once per op and pattern, not once per program: every ``exp`` of blocks read as stored,
    whatever their shape or layout, runs one code object."""
    return compile(source, f"<nabla kernel {name}>", "exec")


def _source(chains: tuple, into: int | None, reorder: tuple[int, ...] | None, quiet: bool
            ) -> tuple[str, dict[str, Any]]:
    """The kernel's code, and the names it reads (the void dtypes of packs, the dtypes they are read back as)."""
    names: dict[str, Any] = {}
    held = [f"h{i}" for i in range(len(chains))]
    lines = [f"    {', '.join(held)}, = h"]
    for i, chain in enumerate(chains):
        if not chain:  # None: as stored; False: a scalar
            continue
        views = _calls(chain[:-1] if chain[-1][0] == "pack" else chain)
        if chain[-1][0] != "pack":
            lines.append(f"    h{i} = h{i}{views}")
            continue
        # a pack: a copy with each run of the last dim one void item; numpy 2 refuses the void view when the last
        # axis is strided (blocks held as a lazy transpose), and the operand is then copied as it is
        void, dtype, void_chain = chain[-1][1]
        names[f"V{i}"], names[f"D{i}"] = void, dtype
        if void_chain is None:  # the views, then their runs as void items
            lines += [f"    h{i} = h{i}{views}"] if views else []
            lines += ["    try:", f"        p = h{i}.view(V{i})", "    except ValueError:",
                      f"        h{i} = h{i}.copy()", "    else:", f"        h{i} = p.copy().view(D{i})"]
        else:  # the stored blocks' runs as void items first: the views on one item per run
            lines += ["    try:", f"        p = h{i}.view(V{i})", "    except ValueError:",
                      f"        h{i} = h{i}{views}.copy()", "    else:",
                      f"        h{i} = p{_calls(void_chain)}.copy().view(D{i})"]
    call = f"fast({', '.join(held)}" + (f", out=h{into})" if into is not None else ")")
    if quiet:
        lines += ["    with errstate(all='ignore'):", f"        out = {call}"]
    else:
        lines.append(f"    out = {call}")
    if into is None:  # (written into an operand's copy: an array of the result's dtype already)
        lines += ["    if type(out) is not ndarray:", "        out = asarray(out)",
                  "    if out.dtype is not DTYPE and out.dtype != DTYPE:", "        out = out.astype(DTYPE)"]
    lines.append("    out.setflags(False)")  # (write=False: positional is the cheaper call; a view is read-only too)
    lines.append(f"    return out.transpose({reorder!r})" if reorder is not None else "    return out")
    return "def kernel(h):\n" + "\n".join(lines) + "\n", names


def _calls(chain: tuple) -> str:
    """A chain of reshapes and transposes as the method calls that make it."""
    return "".join(f".{kind}({arg!r})" for kind, arg in chain)
