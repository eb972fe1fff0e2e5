"""The recorded step: what one op did, as plain immutable data (operands and the layouts they were read and
used in, every move carried out with its bytes, the result, FLOPs per device). The executor writes steps; the
comm log, ``nb.explain``, ``nb.jit`` and the estimator read them, so they cannot disagree. A step holds no closure:
it compares equal to the same step recorded again (up to value serials) and pickles (its op by ``OpDef.key``)."""

from __future__ import annotations

from math import prod
from typing import Any, NamedTuple

import numpy as np

from .value import Value, serial

#: ``Step.op`` of the executor's own steps (no kernel): a value laid out anew (``with_sharding``), a host value
#: placed on a mesh (``shard``), and a value brought to another layout for a later use (a pending sum made once).
RELAYOUT, PLACE, MOVE = "with_sharding", "shard", "move"
#: several values summed in one collective (gradient buckets, as DDP fuses them): ``params`` holds their targets
#: and result serials, ``post`` the one collective
BUCKET = "bucket"

class Use(NamedTuple):
    """How one operand reached the kernel: read in layout ``src`` (its own, or a copy an earlier step made),
    moved to ``dst`` by ``events`` here, or taken as an earlier step moved it (``reused``); ``inside``: what the
    op itself exchanged of it on the way in (the halo rows a window reads from its neighbours)."""

    value: int  # the operand's serial (0: a Python scalar, in ``const``)
    shape: tuple[int, ...]
    dtype: np.dtype
    src: Any  # ShardingSpec, a per-device spec, or None (a host value)
    dst: Any
    events: tuple = ()
    reused: bool = False
    const: Any = None
    inside: tuple = ()
    settled: bool = False  # ``src`` is a summed copy an earlier use made, not the value's own (partial) layout
    kept: int = 0  # the serial of the moved copy the op keeps for the backward pass (a recompute's gathered weight)
    cached: bool = False  # the moved copy stays on the value for its later uses (a traced value's gathered copy)

    @property
    def block_bytes(self) -> int:
        """Bytes of one device's block of the operand as the kernel reads it."""
        if self.value == 0:
            return 0
        return block_elems(self.dst, self.shape) * self.dtype.itemsize


#: Python and numpy scalars: an operand that is one is a constant of its own dtype (anything else: dtype object)
SCALARS = (bool, int, float, complex, np.generic)


def read(a: Any) -> Use:
    """An operand read as it is, nothing moved: a value in its own layout, or a constant."""
    if isinstance(a, Value):
        return Use(serial(a), a._shape, a._dtype, a._spec, a._spec)
    return Use(0, (), np.dtype(type(a)) if isinstance(a, SCALARS) else np.dtype(object), None, None, const=a)


class Step(NamedTuple):
    """One op as it ran: ``op`` (an OpDef, or RELAYOUT / PLACE / MOVE), its params, how each operand was used,
    the result (serial, shape, dtype, layout), the moves after the kernel (``post``: a max over a sharded dim),
    what the executor decided (``prog``: reshard plans, local steps, the plan a MOVE or RELAYOUT ran; None on the
    host), the public op it ran
    for (``user``), ``"forward"``/``"backward"``/``"recompute"``, and the FLOPs of one device's kernel (the
    largest block). For memory: ``alias``, the operand whose storage the result shares (a view: reshape,
    transpose, a move that moved nothing; 0 when it is new), ``saves``, the values the op's VJP keeps for the
    backward pass (its declared residuals, when it is differentiated), and ``extra``, bytes per device it keeps
    beyond them (FlashAttention's log-sum-exp)."""

    op: Any
    params: tuple
    uses: tuple[Use, ...]
    out: int
    out_shape: tuple[int, ...]
    out_dtype: np.dtype
    out_spec: Any
    post: tuple = ()
    prog: Any = None
    user: str = ""
    phase: str = "forward"
    flops: int = 0
    layer: str = ""  # the ``nb.named_scope`` it ran in
    alias: int = 0
    saves: tuple = ()
    extra: int = 0

    @property
    def name(self) -> str:
        """The kernel's name ("matmul"), or the executor's step ("with_sharding")."""
        return self.op if isinstance(self.op, str) else getattr(self.op, "name", str(self.op))

    @property
    def events(self) -> tuple:
        """Every move of the step, in the order it ran: each operand's, then the result's."""
        out = ()
        for u in self.uses:  # (most steps move nothing: this is read for every step a log takes)
            if u.events or u.inside:
                out += u.events + u.inside
        return out + tuple(self.post) if self.post else out

    @property
    def bytes_in(self) -> int:
        """Bytes the kernel reads on one device."""
        return 0 if isinstance(self.op, str) else sum(u.block_bytes for u in self.uses)

    @property
    def bytes_out(self) -> int:
        """Bytes of one device's result block."""
        return block_elems(self.out_spec, self.out_shape) * self.out_dtype.itemsize


def block_elems(spec: Any, shape: tuple[int, ...]) -> int:
    """Elements of one device's block (the largest: a dim that does not divide evenly rounds up)."""
    if spec is None or not hasattr(spec, "num_shards"):
        return prod(shape)
    return prod(-(-n // spec.num_shards(d)) for d, n in enumerate(shape))
