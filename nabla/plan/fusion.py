"""Which recorded steps run as one kernel. nabla records every elementwise op as its own step; a compiler (XLA's
loop and input fusion) or a hand-written kernel (Megatron-LM's bias-GeLU, bias-dropout-add, fused softmax and
layer norm) runs a chain of them as one pass over HBM. Pricing each step as its own round trip overstates a
training step's memory traffic several times over, so the estimate groups them here and prices each group once.

The rule, from XLA's GPU fusion passes (``xla/service/gpu/instruction_fusion.cc``, ``multi_output_fusion.cc``):

- a chain is a run of consecutive *loop* steps (elementwise maps, broadcasts, layout changes, slices, casts,
  dropout) of one phase, with no collective between them (a step whose collectives run before its kernel may
  start a chain, never join one) and with element counts per device that are equal or whole multiples of one
  another (one loop, a broadcast into it or a slice of it);
- a *reduce* step (a sum or max over some dims, softmax, logsumexp) may end a chain: its elementwise producers
  fuse into it (XLA's input fusion), its consumers do not;
- a matmul, a gather, a sort or a convolution is a kernel of its own, and so is a step whose dataflow was not
  recorded (hand-made steps without ``reads``); except that a sum that alone reads a matmul's result is that
  GEMM's (a batched weight-gradient product summed over the batch is one GEMM over batch and sequence, as
  XLA's ``dot_general`` and cuBLAS run it: the per-example products are never written);
- a view (a reshape or transpose sharing its operand's storage: ``kind="alias"``) is no kernel: its readers
  read the operand in place (a GEMM takes a transposed operand as it is, a fused loop reads it strided).

The group reads every value its members read but do not make, once, and writes every value it makes that a
later step reads or that no step reads (a result): a value only used inside the group stays in registers, as
XLA's multi-output fusion keeps it. Its FLOPs are its members' sum.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from .steps import MATMUL_OPS

#: elementwise maps, casts, masks and layout changes: loop-fusible (XLA fuses them into their consumers)
LOOP_OPS = frozenset({
    "add", "subtract", "multiply", "divide", "power", "maximum", "minimum", "less", "less_equal", "greater",
    "greater_equal", "equal", "not_equal", "negative", "exp", "log", "tanh", "sin", "cos", "sqrt", "abs", "relu",
    "sigmoid", "where", "silu", "isnan", "isfinite", "astype", "gelu", "dropout", "tril", "triu", "stop_gradient",
    "one_hot", "transpose", "reshape", "broadcast_to", "expand_dims", "squeeze", "concatenate", "flip", "roll",
    "pad", "getitem"})
#: reductions (and the row-reduce ops built on them): they end a chain, as an XLA input fusion's root
REDUCE_OPS = frozenset({"sum", "max", "min", "prod", "any", "all", "argmax", "argmin", "softmax", "log_softmax",
                        "logsumexp"})
#: the executor's own steps (a value laid out anew): no kernel when no collective moves anything
EXECUTOR_OPS = frozenset({"with_sharding", "shard", "move"})


def kind(step: Any) -> str:
    """``"loop"``, ``"reduce"``, ``"alias"`` (the executor's relayout that moves nothing: the same blocks under a
    new name, no kernel) or ``"opaque"``: how ``step`` fuses. A step's own ``kind`` wins when it has one."""
    own = getattr(step, "kind", "")
    if own:
        return own
    op = step.op
    if op in MATMUL_OPS:
        return "opaque"
    if op in EXECUTOR_OPS and not step.events:
        return "alias"
    if op in LOOP_OPS:
        return "loop"
    if op in REDUCE_OPS:
        return "reduce"
    return "opaque"


class Group(NamedTuple):
    """Steps ``start`` to ``stop - 1`` run as one kernel reading ``bytes_in`` and writing ``bytes_out``."""

    start: int
    stop: int
    flops: int
    bytes_in: int
    bytes_out: int


def groups(steps: Sequence[Any]) -> list[Group]:
    """The kernels of ``steps`` (program order) under the module's rule, every step in exactly one group."""
    n = len(steps)
    kinds = [kind(s) for s in steps]
    reads = [getattr(s, "reads", ()) for s in steps]
    same: dict[int, int] = {}  # an alias's result -> the value whose blocks it is
    last_read: dict[int, int] = {}
    for i, r in enumerate(reads):
        if kinds[i] == "alias" and r and getattr(steps[i], "out", 0):
            v = r[0][0]
            same[steps[i].out] = same.get(v, v)
        for v, _ in r:
            last_read[same.get(v, v)] = i
    out: list[Group] = []
    i = 0
    while i < n:
        s, k = steps[i], kinds[i]
        j = i + 1
        if k == "opaque" and s.op in MATMUL_OPS and getattr(s, "out", 0):
            j = _folded_sum(steps, kinds, reads, i, last_read, same)
        elif k in ("loop", "alias") and reads[i]:
            space, phase = (_elems(s) if k == "loop" else 0), s.phase
            while k != "reduce" and j < n:
                t, k = steps[j], kinds[j]
                if k == "opaque" or not reads[j] or t.events or t.phase != phase:
                    break
                if k != "alias":
                    e = _elems(t)
                    if space and not _compatible(space, e):
                        break
                    space = max(space, e)
                j += 1
        out.append(_group(steps, kinds, i, j, last_read, same))
        i = j
    return out


def _folded_sum(steps: Sequence[Any], kinds: list[str], reads: list, i: int, last_read: dict[int, int],
                same: dict[int, int]) -> int:
    """The end of matmul ``i``'s kernel: past the sum that alone reads its result (views between them), if any."""
    out, phase = steps[i].out, steps[i].phase
    j = i + 1
    while j < len(steps) and kinds[j] == "alias" and not steps[j].events:
        j += 1
    if j < len(steps) and steps[j].op == "sum" and not steps[j].events and steps[j].phase == phase:
        r = reads[j]
        if len(r) == 1 and same.get(r[0][0], r[0][0]) == out and last_read.get(out) == j:
            return j + 1
    return i + 1


def _elems(step: Any) -> int:
    """Elements per device the step's kernel runs over (``elems``; else its largest operand or its result)."""
    n = getattr(step, "elems", 0)
    if n:
        return n
    return max([b for _, b in getattr(step, "reads", ())] + [int(step.bytes_out)]) or 1


def _compatible(a: int, b: int) -> bool:
    lo, hi = min(a, b), max(a, b)
    return lo > 0 and hi % lo == 0


def _group(steps: Sequence[Any], kinds: list[str], i: int, j: int, last_read: dict[int, int],
           same: dict[int, int]) -> Group:
    """One kernel's bytes: what it reads and does not make, once each, and what it makes that is read later
    or never (a result). An opaque step, or one without recorded dataflow, keeps its own bytes."""
    first = steps[i]
    if kinds[i] == "opaque" or not getattr(first, "reads", ()):  # a matmul with a folded sum: its bytes, the sum's
        return Group(i, j, sum(int(s.flops) for s in steps[i:j]), int(first.bytes_in), int(steps[j - 1].bytes_out))
    made: set[int] = set()
    reads: dict[int, int] = {}
    written = 0
    for s, k in zip(steps[i:j], kinds[i:j]):
        if k == "alias":
            continue
        for v, b in s.reads:
            v = same.get(v, v)
            if v and v not in made:
                reads[v] = max(reads.get(v, 0), b)
        v = getattr(s, "out", 0)
        if v:
            made.add(v)
        if not v or last_read.get(v, j) >= j:
            written += int(s.bytes_out)
    return Group(i, j, sum(int(s.flops) for s in steps[i:j]), sum(reads.values()), written)
