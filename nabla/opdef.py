"""What an op is, as data: ``OpDef`` (rule, kernel, VJP, FLOPs, and the names numpy and ONNX know it by) and
``Local``, what a kernel sees besides its arrays. The executor runs OpDefs; ``nabla.ops`` registers them."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

if TYPE_CHECKING:
    from .rules.core import Rule


class Local(NamedTuple):
    """What a kernel needs beyond its arrays: grid axes in front, the result block shape, op params; whether
    window factors already cut each operand's windowed dims to its windows (on sharded values, always; on
    host values, never); and what the op's ``aux`` hook computed for this layout (e.g. global row indices)."""

    G: int
    out_chunk: tuple[int, ...]
    params: tuple
    windowed: bool = False
    aux: tuple = ()
    fold: tuple[int, ...] = ()  # grid axes to reduce too (kept as 1s): the all_reduce after the op, done in it


_KEYS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> the op: how a pickled step names it
_KEYS_LOCK = threading.Lock()


def by_key(key: str) -> "OpDef":
    """The op a pickled step names (``OpDef.key``): ops are made once per process, in import order, so a key
    names the same op in another process that made the same ops (an op made on the fly, a batched twin under
    ``nb.vmap``, may not exist there)."""
    try:
        return _KEYS[key]
    except KeyError:
        raise LookupError(f"no op {key!r} in this process: a pickled step's op must be made here too (import the "
                          f"module defining it)") from None


class OpDef:
    """An op is data: its rule, its kernel, and how partial sums and reductions behave.

    ``linear``: "add" (partial operands add; other operands are added once), "mul" (linear in each
    operand separately), or None (partial operands are summed first). ``linear_args`` limits which
    operands that applies to. ``reduction``: what a sharded reduce factor leaves ("sum": partial sums;
    "max"/"min": reduced at once). ``dtype``: "sample" (run the kernel on tiny arrays), "same", a dtype, or
    a function of the operands' dtypes.
    ``fast``: a numpy function equal to the kernel on operands of the result's rank (an elementwise ufunc),
    called directly when nothing moves. ``aux(result_spec, cuts, shapes, params)``: per-layout constants the
    kernel needs (computed once per program). ``vjp(cotangent, link, out)``: the cotangents of the operands
    (None where there is none), written with nabla ops (``link``: the op's ``trace.Link``, its params and the
    operands it kept). ``folds``: the kernel honours ``Local.fold`` (a max/min reduction also reduces over grid
    axes), so a following all_reduce of the same op runs inside it.
    ``flops(operand block shapes, result block shape, params)``: per device (None: one per result element).

    What the rest of nabla reads from the registry (``nabla.ops.registry``): ``numpy``, the numpy ufunc or
    function the op answers to on tensors (``np.exp(t)``); ``onnx``, how ``nabla.onnx.export`` writes it (an
    ONNX op type for one node taking the operands in the result's dtype, or a function of an export context,
    marked with the ONNX op types it emits); ``reference``, a numpy function computing the op on host arrays
    (random programs and tests compare with it); ``domain``, the ``(low, high)`` interval random programs
    keep its operands in (None: any value); ``arity``, how many operands it takes (None: a varying number);
    ``public``, the user-facing function (``nb.<name>``; None for an op that is not called directly).

    What the VJP reads (its residuals, as JAX and PyTorch keep them): ``saves`` is ``"all"`` (every operand and
    the output; the default, right for any VJP), ``"none"`` (an add, a reshape), ``"operands"``, ``"output"``
    (exp, tanh, softmax), ``"cross"`` (each operand for the others' cotangents: multiply, matmul), or a function
    ``saves(diff, params) -> (operand indices, output kept)`` of which operands need cotangents. Autodiff keeps
    only these alive for the backward pass and the memory log counts exactly them. ``saved_extra(operand block
    shapes, result block shape, params)``: bytes per device the VJP keeps beyond them (FlashAttention's float32
    log-sum-exp per query row). ``view``: the result shares its operand's storage when nothing moves (reshape,
    transpose): no new bytes. ``arrange(operands, params)``: the operands laid out as the op chooses before it is
    planned (a cost choice its rule cannot state: which side of a lookup gives up a mesh axis both are cut over);
    ``apply`` applies it, so the public function and a replay of the recorded op (autoshard's, under other
    layouts) choose alike.
    Ops hash by identity: each is defined once.
    """

    __slots__ = ("name", "rule", "kernel", "linear", "linear_args", "reduction", "dtype", "fast", "aux", "vjp",
                 "folds", "flops", "numpy", "onnx", "reference", "domain", "arity", "public", "saves",
                 "saved_extra", "view", "arrange", "key", "__weakref__")

    def __init__(self, name: str, rule: Callable[..., Rule], kernel: Callable[[list, Local], Any],
                 linear: str | None = None, linear_args: tuple[int, ...] | None = None, reduction: str = "sum",
                 dtype: Any = "sample", fast: Callable | None = None, aux: Callable | None = None,
                 vjp: Callable | None = None, folds: bool = False, flops: Callable | None = None, *,
                 numpy: str | None = None, onnx: str | Callable | None = None, reference: Callable | None = None,
                 domain: tuple[float, float] | None = None, arity: int | None = None,
                 public: Callable | None = None, saves: str | Callable = "all",
                 saved_extra: Callable | None = None, view: bool = False, arrange: Callable | None = None) -> None:
        self.name, self.rule, self.kernel, self.linear = name, rule, kernel, linear
        self.linear_args, self.reduction, self.dtype, self.fast = linear_args, reduction, dtype, fast
        self.aux, self.vjp, self.folds, self.flops = aux, vjp, folds, flops
        self.numpy, self.onnx, self.reference, self.domain = numpy, onnx, reference, domain
        self.arity, self.public = arity, public
        self.saves, self.saved_extra, self.view = saves, saved_extra, view
        self.arrange = arrange
        with _KEYS_LOCK:  # the first op of a name is the name; a later one (a batched twin) its name and a number
            key, n = name, 1
            while key in _KEYS:
                n += 1
                key = f"{name}#{n}"
            self.key = key
            _KEYS[key] = self

    def __reduce__(self) -> tuple:
        return by_key, (self.key,)

    def residuals(self, diff: tuple[bool, ...], params: tuple = ()) -> tuple[frozenset, bool]:
        """What the VJP reads when the operands marked in ``diff`` need cotangents: (operand indices, output)."""
        s, n = self.saves, len(diff)
        if s == "all":
            return frozenset(range(n)), True
        if s == "none":
            return frozenset(), False
        if s == "operands":
            return frozenset(range(n)), False
        if s == "output":
            return frozenset(), True
        if s == "cross":  # operand j is read for the cotangent of every other operand
            return frozenset(j for j in range(n) if any(d for i, d in enumerate(diff) if i != j)), False
        keep, out = s(diff, params)
        return frozenset(keep), bool(out)

    def __repr__(self) -> str:
        return f"OpDef({self.name})"
