"""Where an imported training step sums its gradients. nabla's own autodiff hands back a gradient with no pending
sum, reduced into its parameter's layout; a JAX program's backward pass instead hands its partial sums straight
to the code after it (an optimizer), where a sum that stays pending spreads into every value made from it and is
made once per output (three all_reduces per gradient through AdamW, where XLA makes one). So each value the
backward pass hands on is reduced as it leaves it, as nabla's autodiff would: into the layout of the value of its
shape it first meets (the optimizer state or the parameter it updates: a reduce_scatter where that is sharded on
the summed axes, an all_reduce where it is not). The steps are labelled ``grad of <module path>``, phase
"backward", as nabla's gradient sums are (``nb.estimate``'s ``overlap="grads"`` hides them)."""

from __future__ import annotations

from typing import Any

from .. import collectives as C
from ..spec import DimSpec
from ..tensor import Tensor
from .table import ELEMENTWISE


def _shape(v: Any) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _is_var(v: Any) -> bool:
    return v is not None and type(v).__name__ not in ("Lit", "Literal", "DropVar")


def find(prog: Any) -> None:
    """Mark on each backward equation (``ins.settle``) the values it hands to forward code, with the variable whose
    layout each is to be reduced into (available when it is made) and its label; and in ``prog.kinds`` the inputs
    those values meet on the way: "params" where the differentiated code reads them, else "optimizer"."""
    instrs = prog.instrs
    made: dict = {}  # var -> index of the equation making it
    readers: dict = {}
    for i, ins in enumerate(instrs):
        for v in ins.outs:
            if v is not None:
                made[v] = i
        for a in ins.ins:
            if _is_var(a):
                readers.setdefault(a, []).append(i)
    inputs = set(prog.jaxpr.invars) | set(prog.jaxpr.constvars)
    for i, ins in enumerate(instrs):
        if not ins.site.backward:
            continue
        out = []
        for v in ins.outs:
            if v is None or not _shape(v) or not any(not instrs[j].site.backward for j in readers.get(v, ())):
                continue
            met = _met(instrs, v, i, made)
            if met:
                out.append((v, met[0], f"grad of {'/'.join(ins.site.path) or ins.site.user or 'a parameter'}"))
            for w in met:
                if w in inputs and w not in prog.kinds:
                    read = any(instrs[j].site.differentiated and not instrs[j].site.backward for j in readers[w])
                    prog.kinds[w] = "params" if read else "optimizer"
        ins.settle = tuple(out)


def _met(instrs: list, v: Any, at: int, made: dict) -> list:
    """The values of ``v``'s shape that ``v``, and what elementwise forward code makes of it, meets, in order, each
    followed back through elementwise code to one that exists when ``v`` is made (an input: the optimizer's state,
    the parameter); the first is the one ``v`` is summed into."""
    shape = _shape(v)
    derived, met = {v}, []
    for j in range(at + 1, len(instrs)):
        ins = instrs[j]
        if ins.site.backward or ins.name not in ELEMENTWISE or not any(a in derived for a in ins.ins if _is_var(a)):
            continue
        for a in ins.ins:
            if _is_var(a) and a not in derived and _shape(a) == shape:
                w = _available(instrs, a, at, made)
                if w is not None and w not in met:
                    met.append(w)
        for o in ins.outs:
            if o is not None and _shape(o) == shape:
                derived.add(o)
    return met


def _available(instrs: list, w: Any, at: int, made: dict) -> Any:
    """``w``, or the value of its shape it is made from elementwise, back to one made before equation ``at``."""
    shape = _shape(w)
    while made.get(w, -1) > at:
        ins = instrs[made[w]]
        if ins.name not in ELEMENTWISE:
            return None
        same = [a for a in ins.ins if _is_var(a) and _shape(a) == shape]
        if len(same) != 1:
            return None
        w = same[0]
    return w


def settle(g: Any, like: Any, label: str | None) -> Any:
    """``g`` with its pending sums made, laid out as ``like`` is (where ``like`` is on its mesh and of its shape).
    With a ``label``: a gradient, told to the memory log as one, summed in phase "backward" under that label;
    without: a value summed under the running op's label."""
    if not isinstance(g, Tensor):
        return g
    if label is not None:
        C.tag([g], "grads")
    spec = g.sharding
    if spec is None or not getattr(spec, "partial_axes", ()):
        return g
    own = like.sharding if isinstance(like, Tensor) else None
    if own is not None and hasattr(own, "dim_specs") and own.mesh == spec.mesh and like.shape == g.shape:
        dims = [DimSpec(d.axes) for d in own.dim_specs]
    else:
        dims = [DimSpec(d.axes) for d in spec.dim_specs]
    if label is None:
        return g.with_sharding(spec.mesh, dims)
    with C.user_op(label), C.phase("backward"):
        out = g.with_sharding(spec.mesh, dims)
    C.tag([out], "grads")
    return out
