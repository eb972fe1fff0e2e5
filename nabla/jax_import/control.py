"""Calls and control flow: ``jit``/``pjit``, ``custom_jvp_call``/``custom_vjp_call`` and ``closed_call`` run their
bodies (a custom rule matters only to JAX's own differentiation: the program already holds what it made);
``checkpoint`` runs its body under ``nb.checkpoint`` (so ``nb.grad`` of the imported function recomputes it);
``scan`` runs its body once per iteration (each op planned once per signature by the executor's cache); ``cond``
and ``while`` decide on the data, and refuse to when the program runs without it (``nb.abstract``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..autodiff import checkpoint as nb_checkpoint
from ..errors import ShardingError
from ..tensor import Tensor
from .interpreter import compile_jaxpr
from .random import index0, stack0
from .table import as_tensor, primitive


def _compiled(closed: Any, e: Any) -> tuple:
    """A sub-program and its constants (host tensors), from a ClosedJaxpr or an open Jaxpr."""
    if hasattr(closed, "consts"):
        return compile_jaxpr(closed.jaxpr, e.site), tuple(as_tensor(np.asarray(c)) for c in closed.consts)
    return compile_jaxpr(closed, e.site), ()


def _body(*names: str):
    def prepare(e):
        for n in names:
            if n in e.params:
                e.subs["body"] = _compiled(e.params[n], e)
                return
        raise ShardingError(f"{e.name}: no sub-program among the parameters {sorted(e.params)}")
    return prepare


def _call(ev, e, *args):
    prog, consts = e.subs["body"]
    return ev.run(prog, consts, list(args))


_call.prepare = _body("jaxpr", "call_jaxpr", "fun_jaxpr")
primitive("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
          call=True)(_call)


def _policy(p: Any) -> str:
    """JAX's rematerialization policy as nb.checkpoint's: the dot-saving ones keep matmul outputs."""
    name = getattr(p, "__name__", "") or ""
    return "save_matmuls" if "dot" in name else "full"


def _checkpoint(ev, e, *args):
    prog, consts = e.subs["body"]
    if e.params.get("differentiated"):  # JAX already wrote the recompute into the program: run the body
        return ev.run(prog, consts, list(args))

    def body(*xs):
        return tuple(ev.run(prog, consts, list(xs)))
    return list(nb_checkpoint(body, policy=_policy(e.params.get("policy")))(*[as_tensor(a) for a in args]))


_checkpoint.prepare = _body("jaxpr")
primitive("checkpoint", "remat", "remat2", call=True)(_checkpoint)


def _decided(ev, e, v: Any, what: str) -> Any:
    """The value a branch or a loop decides on, read on the host."""
    if isinstance(v, Tensor):
        if v.is_abstract:
            raise ShardingError(f"{what} decides on a value the program computes, and the program runs without data "
                                f"(nb.abstract): nabla cannot tell which way it goes (use jnp.where, or real inputs)")
        return v.numpy().item()
    return v.item() if hasattr(v, "item") else v


def _scan(ev, e, *args):
    prog, consts = e.subs["body"]
    p = e.params
    nc, nk, n = int(p["num_consts"]), int(p["num_carry"]), int(p["length"])
    cst, carry, xs = list(args[:nc]), list(args[nc:nc + nk]), list(args[nc + nk:])
    ys: list[list] = []
    steps = range(n - 1, -1, -1) if p.get("reverse") else range(n)
    for i in steps:
        out = ev.run(prog, consts, cst + carry + [index0(x, i) for x in xs])
        carry, y = out[:nk], out[nk:]
        ys.append(y)
    if p.get("reverse"):
        ys.reverse()
    if n == 0:
        raise ShardingError("a scan of length 0 is not supported")
    stacked = [stack0([y[j] for y in ys]) for j in range(len(ys[0]))] if ys and ys[0] else []
    return carry + stacked


_scan.prepare = _body("jaxpr")
primitive("scan", call=True)(_scan)


def _cond_prepare(e):
    e.subs["branches"] = [_compiled(b, e) for b in e.params["branches"]]


def _cond(ev, e, index, *ops):
    i = int(_decided(ev, e, index, "cond"))
    branches = e.subs["branches"]
    prog, consts = branches[min(max(i, 0), len(branches) - 1)]  # lax.switch clamps the index
    return ev.run(prog, consts, list(ops))


_cond.prepare = _cond_prepare
primitive("cond", call=True)(_cond)


def _while_prepare(e):
    e.subs["cond"] = _compiled(e.params["cond_jaxpr"], e)
    e.subs["body"] = _compiled(e.params["body_jaxpr"], e)


def _while(ev, e, *args):
    p = e.params
    cn, bn = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cconst, bconst, carry = list(args[:cn]), list(args[cn:cn + bn]), list(args[cn + bn:])
    (cprog, cc), (bprog, bc) = e.subs["cond"], e.subs["body"]
    while bool(_decided(ev, e, ev.run(cprog, cc, cconst + carry)[0], "while")):
        carry = ev.run(bprog, bc, bconst + carry)
    return carry


_while.prepare = _while_prepare
primitive("while", call=True)(_while)
