"""Running a jaxpr as nabla ops: each equation compiled once (its handler from the primitive table, its operands,
where it came from) and run in order over an environment of tensors. Every op an equation runs is labelled with
the source line of the program it came from (the comm log's "during", ``nb.explain``), runs in the scope of the
Flax/Haiku module path JAX's name stack gives (``nb.named_scope``'s label: the estimate's layers), and in phase
"backward" when JAX's name stack says it is a transpose (the backward pass of a ``jax.grad`` in the program)."""

from __future__ import annotations

import functools
import os
import re
from typing import Any, NamedTuple, Sequence

import numpy as np

from .. import collectives as C
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..ops import astype
from ..tensor import Tensor
from ..trace import one_program
from . import sums
from .table import CALLS, KEYED, TABLE, as_tensor

#: directories of libraries whose frames are not "the program's line" (the first frame outside them is)
_LIBRARY_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep,
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


class Site(NamedTuple):
    """Where an equation came from: ``user`` (``file.py:12``, the label of its steps), ``where`` (for errors: the
    program's frame, and the library frame inside it when there is one), the module path, whether JAX's name stack
    marks it as part of a backward pass (a transpose), and as part of a differentiated function (a jvp)."""

    user: str
    where: str
    path: tuple[str, ...]
    backward: bool
    differentiated: bool = False


ROOT = Site("", "an unknown line", (), False)
#: a name-stack scope that names a module (Flax's ``Block_0``, a ``jax.named_scope``), not an op's detail
_MODULE = re.compile(r"^[A-Za-z_][\w.\-]*$")


class Lit:
    """A literal operand: its value as a numpy scalar of the equation's dtype."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class Instr:
    """One compiled equation."""

    __slots__ = ("fn", "name", "ins", "outs", "params", "out_avals", "multi", "eqn", "site", "scope", "subs", "is_call",
                 "settle", "meets", "types")

    def __init__(self, fn, name, ins, outs, params, out_avals, multi, eqn, site, scope, is_call) -> None:
        self.fn, self.name, self.ins, self.outs, self.params = fn, name, ins, outs, params
        self.out_avals, self.multi, self.eqn, self.site, self.scope = out_avals, multi, eqn, site, scope
        # per result: (shape, dtype) as JAX typed it, None for a PRNG key
        self.types = tuple(None if is_key(a) else (tuple(a.shape), np.dtype(a.dtype)) for a in out_avals)
        self.subs: dict = {}  # sub-programs the handler compiled, by key
        self.is_call = is_call
        self.settle: tuple = ()  # (gradient var, var whose layout it is summed into, label): see sums.py
        self.meets: tuple = ()  # (result var, the vars of its shape a join meets it with): see sums.py


class Compiled:
    """A jaxpr ready to run: its equations in order, with the site of each, cut into blocks that run under one label
    (consecutive equations of one line, module path and phase: the labelling contexts are entered once per block),
    and what its inputs are to a training step (``kinds``: input var -> "params" or "optimizer", see sums.py)."""

    __slots__ = ("jaxpr", "instrs", "site", "kinds", "blocks", "outs", "returned")

    def __init__(self, jaxpr: Any, instrs: list[Instr], site: Site) -> None:
        self.jaxpr, self.instrs, self.site = jaxpr, instrs, site
        self.kinds: dict = {}
        self.returned: tuple = ()  # (result var, the input it is the gradient of, label): see sums.py
        self.blocks: list[tuple[tuple, list[Instr]]] = []
        self.outs = tuple(Lit(_literal(v)) if _is_literal(v) else v for v in jaxpr.outvars)

    def cut(self) -> None:
        """The blocks: a call (its body labels its own ops) and an equation whose results are gradients to sum
        (summed under their own label, outside the block's) end one."""
        for ins in self.instrs:
            key = (None if ins.is_call else (ins.site.user or ins.name), ins.scope, ins.site.backward)
            if self.blocks and self.blocks[-1][0] == key and key[0] is not None and not self.blocks[-1][1][-1].settle:
                self.blocks[-1][1].append(ins)
            else:
                self.blocks.append((key, [ins]))


def _frames(eqn: Any) -> tuple:
    """The innermost frame outside jax, and the innermost outside every library too (None where there is none)."""
    from jax._src import source_info_util as siu  # (jax is installed whenever a jaxpr exists)
    tb = eqn.source_info.traceback
    first = None
    for f in (siu.user_frames(tb) if tb is not None else ()):  # (converted one by one: stop at the program's)
        first = first or f
        if not _is_library(f.file_name):
            return first, f
    return first, None


@functools.lru_cache(maxsize=4096)
def _is_library(path: str) -> bool:
    return any(m in path for m in _LIBRARY_MARKERS)


def site_of(eqn: Any, parent: Site) -> Site:
    """The equation's source line (the innermost frame of the program itself, outside jax and other libraries),
    its module path (the name stack's scopes under the parent's) and whether it is a transpose."""
    lib, own = _frames(eqn)
    if own is None:
        user, where = parent.user, parent.where
    else:
        user = f"{os.path.basename(own.file_name)}:{own.start_line}"
        where = f"{own.file_name}:{own.start_line} (in {own.function_name})"
        if lib is not own:
            where += f", at {_short(lib.file_name)}:{lib.start_line} (in {lib.function_name})"
    path, backward, diff = list(parent.path), parent.backward, parent.differentiated
    for item in getattr(eqn.source_info.name_stack, "stack", ()):
        if type(item).__name__ == "Transform":
            backward = backward or item.name == "transpose"
            diff = diff or item.name in ("jvp", "transpose")
        elif _MODULE.match(item.name):  # (jnp.einsum scopes its equations with its subscripts: not a module)
            path.append(item.name)
    return Site(user, where, tuple(path), backward, diff)


def _short(path: str) -> str:
    """A library file as ``package/module.py``."""
    for m in _LIBRARY_MARKERS[:2]:
        if m in path:
            return path.split(m, 1)[1]
    return os.path.basename(path)


def unsupported(name: str, site: Site, detail: str = "") -> ShardingError:
    return ShardingError(f"import_jax: primitive {name!r} at {site.where} is not supported by nabla"
                         f"{': ' + detail if detail else ''} (nothing was run)")


def is_key(aval: Any) -> bool:
    """Whether ``aval`` is a PRNG key array's (a ``key<impl>`` dtype)."""
    return type(getattr(aval, "dtype", None)).__name__ == "KeyTy"


def compile_jaxpr(jaxpr: Any, parent: Site = ROOT, top: bool = False) -> Compiled:
    """Compile ``jaxpr`` (an open Jaxpr) and, eagerly, every sub-program its equations hold, so an unsupported
    primitive anywhere is reported before anything runs. ``top``: it is the traced function's own (the gradients
    it returns are summed as nabla's autodiff returns them)."""
    instrs = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        site = site_of(eqn, parent)
        keyed = any(is_key(v.aval) for v in eqn.invars)
        fn = KEYED.get(name) if keyed and name not in CALLS else TABLE.get(name)
        if fn is None:
            raise unsupported(name, site, "no handler for PRNG key operands" if keyed and name in TABLE else "")
        ins = tuple(Lit(_literal(v)) if _is_literal(v) else v for v in eqn.invars)
        outs = tuple(None if type(v).__name__ == "DropVar" else v for v in eqn.outvars)
        scope = "/".join(site.path)
        ins_ = Instr(fn, name, ins, outs, eqn.params, tuple(v.aval for v in eqn.outvars),
                     eqn.primitive.multiple_results, eqn, site, scope, name in CALLS)
        prepare = getattr(fn, "prepare", None)
        if prepare is not None:
            prepare(ins_)  # a call compiles its sub-programs now
        instrs.append(ins_)
    prog = Compiled(jaxpr, instrs, parent)
    sums.find(prog)
    if top:
        sums.find_returned(prog)
    prog.cut()
    return prog


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _literal(v: Any) -> Any:
    aval = v.aval
    if is_key(aval):
        raise ShardingError("import_jax: a PRNG key literal is not supported")
    val = np.asarray(v.val, dtype=aval.dtype)
    return val[()] if val.ndim == 0 else val


class Eval:
    """The context of one call of an imported program: whether it runs abstractly (no data), its mesh, and the
    scope it was called in."""

    __slots__ = ("abstract", "mesh", "outer_scope")

    def __init__(self, abstract: bool, mesh: DeviceMesh | None, outer_scope: str) -> None:
        self.abstract, self.mesh, self.outer_scope = abstract, mesh, outer_scope

    def run(self, prog: Compiled, consts: Sequence[Any], args: Sequence[Any]) -> list:
        """Run ``prog`` on ``consts`` and ``args`` (values for its constvars and invars); its outputs."""
        jaxpr = prog.jaxpr
        env: dict = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for v, kind in prog.kinds.items():
            if isinstance(env[v], Tensor):
                C.tag([env[v]], kind)  # a memory log (and autoshard) counts parameters and optimizer state as such
        # (XLA's float arithmetic is IEEE's, an overflow or an invalid operation a value, never a warning: numpy's
        # floating-point warnings (exp(1000), log(0), inf - inf) are not raised for a JAX program)
        with one_program(env[v] for v in prog.kinds if isinstance(env[v], Tensor)), np.errstate(all="ignore"):
            self._blocks(prog, env)
            for v, like, label in prog.returned:
                env[v] = sums.settle(env[v], env[like] if like is not None else None, label)
        return [v.value if type(v) is Lit else env[v] for v in prog.outs]

    def _blocks(self, prog: Compiled, env: dict) -> None:
        for (user, scope, backward), block in prog.blocks:
            with (C.user_op(user) if user is not None else _NOTHING), C.in_scope(self.scope(scope)), \
                    _phase(backward):
                for ins in block:
                    self._one(ins, env)
            for v, like, label in block[-1].settle:
                env[v] = sums.settle(env[v], env[like], label)

    def _one(self, ins: Instr, env: dict) -> None:
        """One equation: its handler on its operands, its results checked against JAX's types."""
        try:
            out = ins.fn(self, ins, *[a.value if type(a) is Lit else env[a] for a in ins.ins])
        except ShardingError as e:
            if getattr(e, "_import_jax", False):
                raise
            err = ShardingError(f"import_jax: primitive {ins.name!r} at {ins.site.where}: {e}")
            err._import_jax = True
            raise err from e
        if not ins.multi:
            out = (out,)
        for v, o, t in zip(ins.outs, out, ins.types):
            if v is not None:
                env[v] = o if t is None else _checked(o, t, ins)
        for v, partners in ins.meets:
            env[v] = sums.early(env[v], partners, env)

    def scope(self, own: str) -> str:
        if not own:
            return self.outer_scope
        return f"{self.outer_scope}/{own}" if self.outer_scope else own


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NOTHING = _Nothing()


def _phase(backward: bool):
    """Phase "backward" for a transpose's equations (leaving the caller's phase otherwise)."""
    return C.phase("backward") if backward and C.current_phase() == "forward" else _NOTHING


def _checked(out: Any, t: tuple, ins: Instr) -> Any:
    """The result as JAX typed it: numpy's promotion may differ from the jaxpr's explicit types (a cast then)."""
    shape, dtype = t
    if not isinstance(out, Tensor):
        out = as_tensor(np.asarray(out, dtype=dtype))
    if out.shape != shape:
        raise ShardingError(f"import_jax: primitive {ins.name!r} at {ins.site.where} gave shape {out.shape}, "
                            f"JAX's is {shape} (a bug in nabla's mapping of it)")
    return out if out.dtype == dtype else astype(out, dtype)
