"""One interpreter of recorded steps: what each part of a recorded ``Step`` does to blocks (an operand moved by the
plan the move ran, a host value placed, a kernel run by its program, an op on host values), on any backend, read
from the step alone: nothing is propagated or planned again. ``nb.jit`` runs it on one device's block inside
``shard_map`` (``jax_local``), and on every device's blocks at once (a grid backend) to fold the values that read
no input data, so a folded constant is what the recorded program computes, not what a new plan would."""

from __future__ import annotations

from typing import Any, Callable

from . import collectives as C
from .backends.base import Backend
from .executor import ready
from .opdef import Local


def run(ins: Any, blocks: list, be: Backend) -> Any:
    """The blocks instruction ``ins`` makes (``nb.jit``'s ``Instr``: a recorded step, and which part of it runs:
    ``kind``, the operand ``use`` a move is for and the ``plan`` it runs) of ``blocks``, the blocks of what it reads,
    in order (None for a Python scalar)."""
    return JOBS[ins.kind](ins, blocks, be)


def move(ins: Any, blocks: list, be: Backend) -> Any:
    """A move of one operand (or one hop of it) by the plan recorded with it."""
    return be.move(blocks[0], ins.plan, ins.step.uses[ins.use].shape)


def alias(ins: Any, blocks: list, be: Backend) -> Any:
    """``with_sharding``'s result: the moved blocks themselves."""
    return blocks[0]


def place(ins: Any, blocks: list, be: Backend) -> Any:
    """``shard`` of a host value: each device's block of it."""
    return be.place(blocks[0], ins.step.out_spec)


def kernel(ins: Any, blocks: list, be: Backend) -> Any:
    """A planned op by its recorded program: each operand's blocks as the kernel takes them (moved before, by the
    move instructions; a host value placed; a scalar joining a pending sum placed and added once), through the
    eager interpreter's ``ready``; then the kernel and the result's moves (``Backend.kernel``)."""
    s = ins.step
    prog = s.prog
    arrays = []
    for x, u, p in zip(blocks, s.uses, prog.preps):
        if p.kind == "scalar" and not p.mask_axes:
            arrays.append(u.const)
            continue
        if p.kind == "scalar":
            x = be.xp.asarray(u.const, dtype=prog.dtype)
        arrays.append(ready(x if p.kind == "sharded" else be.place(x, p.target), p, be))
    return be.kernel(s.op, arrays, prog)


def host(ins: Any, blocks: list, be: Backend) -> Any:
    """An op on whole values (host values, or one device's blocks inside ``nb.shard_map``), in the dtype it was
    recorded with (the executor casts a host op's result to its dtype rule's)."""
    s = ins.step
    arrays = [x if r is not None else u.const for x, r, u in zip(blocks, ins.reads, s.uses)]
    out = be.xp.asarray(s.op.kernel(arrays, Local(0, s.out_shape, s.params)))
    return out if out.dtype == s.out_dtype else out.astype(s.out_dtype)


def bucket(ins: Any, blocks: list, be: Backend) -> list:
    """Several values summed in one collective (a gradient bucket) by the plans recorded with it."""
    return be.bucket(C.REGISTRY["bucket"], blocks, ins.plan, [u.shape for u in ins.step.uses])


#: instruction kind -> its job (what a grid backend and a device's block share; ``nb.jit`` adds the per-device kinds)
JOBS: dict[str, Callable[[Any, list, Backend], Any]] = {"move": move, "alias": alias, "place": place,
                                                        "kernel": kernel, "host": host, "bucket": bucket}
