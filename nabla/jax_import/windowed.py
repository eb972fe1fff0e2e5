"""Window reductions (``flax.linen.max_pool``/``avg_pool``/``min_pool``, ``lax.reduce_window`` with a monoid) and the
max pool's gradient as nabla's pools. JAX gives a window per dim of the operand (Flax's NHWC: ``(1, h, w, 1)``); the
dims the window leaves alone (size 1, stride 1, no padding) are moved in front as nabla's (N, C), the others after
them as its spatial dims, and the result moved back. A sharded spatial dim keeps its halo exchange.

``reduce_window_sum`` is ``avg_pool`` times the window's size (avg_pool then divides by it again: Flax's
``avg_pool`` is ``reduce_window_sum`` then a ``div``). ``select_and_scatter_add`` (the transpose of JAX's
``select_and_gather_add``, which is ``reduce_window_max``'s JVP: jax/_src/lax/windowed_reductions.py) is
``max_pool``'s own gradient; ``reduce_window_sum``'s transpose is a ``pad`` and a ``reduce_window_sum``, both run
already. Base dilation, and the generic ``reduce_window`` (a body JAX did not recognise as max, min or add), have
no nabla op: they raise naming the primitive and the line."""

from __future__ import annotations

from math import prod
from typing import Any, Callable

import numpy as np

from .. import ops as O
from ..errors import ShardingError
from ..tensor import Tensor
from .interpreter import unsupported
from .table import as_tensor, primitive


class Layout:
    """Where the window acts: ``perm`` takes the operand to (the dims it leaves alone, then its spatial dims);
    ``lead`` is how many leading dims that gives (nabla's pools want two: a third and more are merged, a missing
    one is a unit dim); the pool's kernel, stride, padding and dilation per spatial dim."""

    def __init__(self, e: Any, ndim: int) -> None:
        p = e.params
        window = tuple(int(w) for w in p["window_dimensions"])
        stride = tuple(int(s) for s in p["window_strides"])
        pads = tuple((int(lo), int(hi)) for lo, hi in p["padding"])
        wdil = tuple(int(d) for d in p.get("window_dilation", (1,) * ndim))
        if any(int(d) != 1 for d in p.get("base_dilation", (1,) * ndim)):
            raise ShardingError(f"base_dilation {tuple(p['base_dilation'])} (holes between the operand's elements) "
                                f"has no nabla pool")
        if any(lo < 0 or hi < 0 for lo, hi in pads):
            raise ShardingError(f"negative padding {pads} has no nabla pool")
        spatial = [i for i in range(ndim) if (window[i], stride[i], pads[i], wdil[i]) != (1, 1, (0, 0), 1)]
        alone = [i for i in range(ndim) if i not in spatial]
        self.perm = tuple(alone + spatial)
        self.lead = len(alone)
        self.kernel = tuple(window[i] for i in spatial)
        self.stride = tuple(stride[i] for i in spatial)
        self.pads = tuple(pads[i] for i in spatial)
        self.dilation = tuple(wdil[i] for i in spatial)

    def into(self, x: Tensor) -> Tensor:
        """``x`` as (N, C, *spatial)."""
        if self.perm != tuple(range(x.ndim)):
            x = O.transpose(x, self.perm)
        if self.lead > 2:
            x = O.reshape(x, (-1,) + x.shape[self.lead - 1:])
        for _ in range(2 - self.lead):
            x = O.expand_dims(x, 0)
        return x

    def back(self, y: Tensor, like: tuple) -> Tensor:
        """A pool's result ``y`` back in the operand's layout (``like``: the operand's shape, permuted)."""
        if self.lead > 2:
            y = O.reshape(y, tuple(like[:self.lead]) + y.shape[2:])
        for _ in range(2 - self.lead):
            y = O.squeeze(y, 0)
        inv = tuple(int(i) for i in np.argsort(self.perm))
        return O.transpose(y, inv) if inv != tuple(range(y.ndim)) else y


def _check(e: Any) -> None:
    """Compiling: a window nabla's pools cannot express is refused before anything runs."""
    try:
        e.subs["layout"] = Layout(e, len(e.eqn.invars[-1].aval.shape))
    except ShardingError as err:
        raise unsupported(e.name, e.site, str(err)) from None


def _windowed(run: Callable[[Tensor, Layout], Tensor]):
    def handler(ev, e, x):
        x = as_tensor(x)
        lay = e.subs["layout"]
        if not lay.kernel:  # a window of 1 everywhere: every element is its own window
            return x
        like = tuple(x.shape[i] for i in lay.perm)
        return lay.back(run(lay.into(x), lay), like)
    handler.prepare = _check
    return handler


def _max(x: Tensor, lay: Layout) -> Tensor:
    return O.max_pool(x, lay.kernel, lay.stride, lay.pads, lay.dilation)


def _sum(x: Tensor, lay: Layout) -> Tensor:
    """The window's sum: its mean (padding counted, as zeros) times its size; an integer sum in float64, rounded."""
    y = O.multiply(O.avg_pool(x, lay.kernel, lay.stride, lay.pads, True, lay.dilation), float(prod(lay.kernel)))
    if y.dtype != x.dtype:
        y = O.astype(O.floor(O.add(y, 0.5)) if x.dtype.kind in "iu" else y, x.dtype)
    return y


def _min(x: Tensor, lay: Layout) -> Tensor:
    if x.dtype.kind in "ub":
        raise ShardingError(f"a min window over {x.dtype} (nabla runs it as -max_pool(-x))")
    return O.negative(_max(O.negative(x), lay))


primitive("reduce_window_max")(_windowed(_max))
primitive("reduce_window_sum")(_windowed(_sum))
primitive("reduce_window_min")(_windowed(_min))


def _generic(ev, e, *args):  # (never runs: refused when compiled)
    raise AssertionError("reduce_window")


def _refuse_generic(e: Any) -> None:
    raise unsupported(e.name, e.site, "its body is not a max, min or add (JAX's reduce_window_max, _min, _sum: "
                      "nabla's max_pool and avg_pool); write the window with one of those")


_generic.prepare = _refuse_generic
primitive("reduce_window")(_generic)


@primitive("select_and_scatter_add")
def _select_and_scatter_add(ev, e, source, operand):
    """Each window's ``source`` element added at the window's selected element of ``operand``: the first max
    (``select_prim`` ``ge``, a max pool's gradient) or the first min (``le``)."""
    select = str(e.params["select_prim"])
    source, operand = as_tensor(source), as_tensor(operand)
    lay = e.subs["layout"]
    if not lay.kernel:
        return source
    like = tuple(operand.shape[i] for i in lay.perm)
    x, g = lay.into(operand), lay.into(source)
    if select == "le":
        x = O.negative(x)
    out = _max(x, lay)
    return lay.back(O.max_pool_scatter(x, g, out, lay.kernel, lay.stride, lay.pads, lay.dilation), like)


def _check_select(e: Any) -> None:
    if str(e.params["select_prim"]) not in ("ge", "le"):
        raise unsupported(e.name, e.site, f"select_prim {e.params['select_prim']}: only ge (a max window's "
                          f"element) and le (a min's) are")
    _check(e)


_select_and_scatter_add.prepare = _check_select
