"""Windowed ops (the ONNX formalism draft's fifth group), ONNX layout ``N, C, *spatial``: convolution and pooling. Batch and
output channels pass through, input channels are contracted, each spatial dim is a window factor (halo
exchange where it is sharded), the kernel's dims are needed whole."""

from __future__ import annotations

from functools import lru_cache

from ..errors import ShardingError
from ..factors import PASS, REDUCE, REPLICATE, Window, WindowSpec
from ..windows import out_size
from .core import Rule, build


def _spatial(op: str, x: tuple[int, ...], kernel: tuple[int, ...], stride, dilation, pads) -> list[int]:
    nd = len(kernel)
    outs = []
    for i in range(nd):
        n = x[2 + i]
        lo, hi = pads[i]
        o = out_size(n, kernel[i], stride[i], dilation[i], lo, hi)
        if n + lo + hi < (kernel[i] - 1) * dilation[i] + 1:
            raise ShardingError(f"{op}: spatial dim {2 + i} of size {n} with padding ({lo}, {hi}) is smaller than "
                                f"the window ({kernel[i]} taps, dilation {dilation[i]})")
        outs.append(o)
    return outs


def _before(outs, wins, i: int) -> tuple:
    """For the window factor of spatial dim ``i``: the spatial dims of ``x`` (operand 0) widened to their
    windows before it, so its halo messages are sized on the widened block (corners included)."""
    return (tuple((2 + j, outs[j], wins[j]) for j in range(i)), ())


@lru_cache(maxsize=4096)
def conv_rule(x: tuple[int, ...], w: tuple[int, ...], stride: tuple[int, ...], padding: tuple[tuple[int, int], ...],
              dilation: tuple[int, ...], groups: int, bias: tuple[int, ...] | None = None,
              whole: bool = False, residual: tuple[int, ...] | None = None) -> Rule:
    """``x (N, C, *S)`` with ``w (O, C/groups, *K)``: factors n, g (groups), c (C/groups, contracted),
    o (O/groups), one window factor per spatial dim, one whole factor per kernel dim. ``bias (O,)``, when
    given, is a third operand on (g, o). ``whole``: c is needed whole rather than contracted (no partial
    sums), for a kernel that applies something non-linear to the sums (a fused epilogue). ``residual``, when
    given, is a last operand of the result's shape and factors, added in that epilogue."""
    nd = len(x) - 2
    if nd < 1 or nd > 3 or len(w) != len(x):
        raise ShardingError(f"conv: x must be (N, C, *spatial) with 1 to 3 spatial dims and w (O, C/groups, "
                            f"*kernel) of the same rank; got x {x}, w {w}")
    N, C = x[:2]
    O, Cg = w[:2]
    if groups < 1 or C % groups or O % groups or C // groups != Cg:
        raise ShardingError(f"conv: x has {C} channels and w {O} x {Cg}: with groups={groups}, C/groups must "
                            f"equal w's dim 1 and groups must divide C and O")
    kernel = w[2:]
    outs = _spatial("conv", x, kernel, stride, dilation, padding)
    sizes, kinds = [], []

    def new(size, kind):
        sizes.append(size)
        kinds.append(kind)
        return len(sizes) - 1

    def dim(*factors):
        return tuple(f for f in factors if sizes[f] != 1 or kinds[f].windowed)  # (an empty dim keeps its factor)

    n, g = new(N, PASS), new(groups, PASS)
    c, o = new(Cg, REPLICATE if whole else REDUCE), new(O // groups, PASS)
    wins = [WindowSpec(x[2 + i], kernel[i], stride[i], dilation[i], padding[i][0]) for i in range(nd)]
    # one window per operand: x reads its windows; w, bias and a residual have none (a residual's rows are
    # the result's own)
    sp = [new(outs[i], Window(outs[i], (wins[i], None, None, None), 0.0, _before(outs, wins, i))) for i in range(nd)]
    kk = [new(kernel[i], REPLICATE) for i in range(nd)]
    xd = [dim(n), dim(g, c)] + [dim(f) for f in sp]
    wd = [dim(g, o), dim(c)] + [dim(f) for f in kk]
    rd = [dim(n), dim(g, o)] + [dim(f) for f in sp]
    operands = [xd, wd]
    if bias is not None:
        if tuple(bias) != (O,):
            raise ShardingError(f"conv: bias must have shape ({O},) (one per output channel), got {bias}")
        operands.append([dim(g, o)])
    if residual is not None:
        if tuple(residual) != (N, O, *outs):
            raise ShardingError(f"conv: the residual must have the result's shape {(N, O, *outs)}, got {residual}")
        operands.append(rd)
    return build(operands, rd, sizes, kinds)


@lru_cache(maxsize=4096)
def pool_rule(x: tuple[int, ...], kernel: tuple[int, ...], stride: tuple[int, ...],
              padding: tuple[tuple[int, int], ...], dilation: tuple[int, ...], fill: float, op: str) -> Rule:
    """Pooling: batch and channels pass through, each spatial dim is a window factor padded with ``fill``."""
    nd = len(kernel)
    if len(x) != nd + 2 or nd < 1 or nd > 3:
        raise ShardingError(f"{op}: x must be (N, C, *spatial) with {nd} spatial dims for kernel {kernel}, got {x}")
    outs = _spatial(op, x, kernel, stride, dilation, padding)
    sizes = list(x[:2]) + outs
    wins = [WindowSpec(x[2 + i], kernel[i], stride[i], dilation[i], padding[i][0]) for i in range(nd)]
    kinds = [PASS, PASS] + [Window(outs[i], (wins[i],), fill, _before(outs, wins, i)[:1]) for i in range(nd)]
    operand = [(0,) if x[0] != 1 else (), (1,) if x[1] != 1 else ()] + [(2 + i,) for i in range(nd)]
    return build([operand], operand, sizes, kinds)
