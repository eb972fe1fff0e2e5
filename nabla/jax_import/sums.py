"""Where an imported program makes its pending sums. nabla makes a sum as late as possible, and its own ops come
with VJPs that place them well; a JAX program spells its backward pass out, and left to the rule a sum placed late
spreads: every op after it works on one partial block per device of the group, and each value made from it is
summed on its own. So, as XLA and Megatron place them:

- a pending sum met by a whole value of its shape in ``add``/``sub``/``mul``/``div`` (the residual stream; a norm's
  cotangent and its input) is made there, into that value's layout (``joined``), and at once where that value
  exists already when the sum is made (``find`` marks them; ``early``), so no other reader sees it pending;
- a gradient, a value the backward pass hands to the code after it (an optimizer), is reduced as it leaves, as
  nabla's autodiff reduces one: into the layout of the value of its shape it first meets (the optimizer state or
  the parameter it updates: a reduce_scatter where that is cut on the summed axes, else an all_reduce). Left
  pending, AdamW sums it three times where XLA sums it once. A gradient the program returns (``jax.grad``) is
  reduced into the layout of the differentiated input of its shape (the k-th such result into the k-th such
  input, as ``jax.grad`` orders them), as ``nb.grad`` returns one. These steps are labelled ``grad of <module
  path>``, phase "backward", as nabla's gradient sums are (``nb.estimate``'s ``overlap="grads"`` hides them)."""

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


#: the primitives where a pending sum met by a whole value of its shape is made
JOINS = frozenset({"add", "add_any", "sub", "mul", "div"})


def find_returned(prog: Any) -> None:
    """Mark in ``prog.returned`` the results of the traced function that its backward pass makes (the gradients it
    returns), each with the differentiated input of its shape it is the gradient of, and its label; and that input
    in ``prog.kinds`` as "params"."""
    made = {v: ins for ins in prog.instrs for v in ins.outs if v is not None}
    read = {a for ins in prog.instrs if ins.site.differentiated and not ins.site.backward for a in ins.ins
            if _is_var(a)}
    by_type: dict = {}
    for v in prog.jaxpr.invars:
        if v in read and _shape(v):
            by_type.setdefault((_shape(v), str(v.aval.dtype)), []).append(v)
    seen: dict = {}
    out = []
    for v in prog.jaxpr.outvars:
        ins = made.get(v) if _is_var(v) else None
        if ins is None or not ins.site.backward or not _shape(v):
            continue
        key = (_shape(v), str(v.aval.dtype))
        cands = by_type.get(key, [])
        k = seen[key] = seen.get(key, -1) + 1
        of = cands[k % len(cands)] if cands else None
        out.append((v, of, f"grad of {'/'.join(ins.site.path) or ins.site.user or 'a parameter'}"))
        if of is not None:  # a differentiated input is a parameter, as nb.grad tags one (api: from creation)
            prog.kinds.setdefault(of, "params")
    prog.returned = tuple(out)


def find(prog: Any) -> None:
    """Mark on each equation the values it makes that a join meets with another of their shape (``ins.meets``: each
    with those others); on each backward equation the values it hands to forward code (``ins.settle``), with the
    variable whose layout each is to be reduced into (available when it is made) and its label; and in
    ``prog.kinds`` the inputs those values meet on the way: "params" where the differentiated code reads them,
    else "optimizer"."""
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
    for ins in instrs:
        meets = []
        for v in ins.outs:
            partners = tuple(dict.fromkeys(
                a for j in readers.get(v, ()) if instrs[j].name in JOINS for a in instrs[j].ins
                if _is_var(a) and a is not v and _shape(a) == _shape(v))) if v is not None and _shape(v) else ()
            if partners:
                meets.append((v, partners))
        ins.meets = tuple(meets)
    inputs = set(prog.jaxpr.invars) | set(prog.jaxpr.constvars)
    for i, ins in enumerate(instrs):
        if not ins.site.backward:
            continue
        out = []
        for v in ins.outs:
            if v is None or not _shape(v) or not any(not instrs[j].site.backward for j in readers.get(v, ())):
                continue
            met = _met(instrs, v, i, made, readers)
            if met:
                out.append((v, met[0], f"grad of {'/'.join(ins.site.path) or ins.site.user or 'a parameter'}"))
            for w in met:
                if w in inputs and w not in prog.kinds:
                    read = any(instrs[j].site.differentiated and not instrs[j].site.backward for j in readers[w])
                    prog.kinds[w] = "params" if read else "optimizer"
        ins.settle = tuple(out)


def _met(instrs: list, v: Any, at: int, made: dict, readers: dict) -> list:
    """The values of ``v``'s shape that ``v``, and what elementwise forward code makes of it, meets, in order, each
    followed back through elementwise code to one that exists when ``v`` is made (an input: the optimizer's state,
    the parameter); the first is the one ``v`` is summed into. (Only the readers of what it has made are looked
    at, in program order.)"""
    shape = _shape(v)
    derived, met = {v}, []
    todo = sorted(j for j in readers.get(v, ()) if j > at)
    done: set = set()
    while todo:
        j = todo.pop(0)
        if j in done:
            continue
        done.add(j)
        ins = instrs[j]
        if ins.site.backward or ins.name not in ELEMENTWISE:
            continue
        for a in ins.ins:
            if _is_var(a) and a not in derived and _shape(a) == shape:
                w = _available(instrs, a, at, made)
                if w is not None and w not in met:
                    met.append(w)
        for o in ins.outs:
            if o is not None and _shape(o) == shape:
                derived.add(o)
                todo = sorted(set(todo) | {k for k in readers.get(o, ()) if k > j})
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


def _pending(x: Any) -> bool:
    spec = getattr(x, "sharding", None)
    return bool(spec is not None and getattr(spec, "partial_axes", ()))


def joined(fn):
    """``fn(a, b)`` with a pending sum met by a whole value of its shape made first, into that value's layout."""
    def run(ev, e, a, b):
        pa, pb = _pending(a), _pending(b)
        if pa != pb and getattr(a, "shape", None) == getattr(b, "shape", None):
            if pa:
                a = settle(a, b, None)
            else:
                b = settle(b, a, None)
        return fn(a, b)
    return run


def early(v: Any, partners: tuple, env: dict) -> Any:
    """``v`` summed now if it is pending and a join will meet it with a whole value that exists already (one of
    the variables ``partners``, looked up in ``env``)."""
    if not _pending(v):
        return v
    for var in partners:
        p = env.get(var)
        if isinstance(p, Tensor) and p.sharding is not None and not _pending(p):
            return settle(v, p, None)
    return v


def settle(g: Any, like: Any, label: str | None) -> Any:
    """``g`` with its pending sums made, laid out as ``like`` is (where ``like`` is on its mesh and of its shape).
    With a ``label``: a gradient, told to the memory log as one (its summed value: the partial blocks before the
    sum are temporaries, as nabla's autodiff leaves them), summed in phase "backward" under that label; without: a
    value summed under the running op's label."""
    if not isinstance(g, Tensor):
        return g
    spec = g.sharding
    if spec is None or not getattr(spec, "partial_axes", ()):
        if label is not None:
            C.tag([g], "grads")
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
