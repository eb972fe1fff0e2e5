"""``conv_general_dilated`` as nabla's ``conv``: operands transposed to its (N, C, *spatial) and (O, I, *kernel)
layouts by the dimension numbers, an input dilation spelled as interior zero padding (as a strided conv's input
gradient has it), the result transposed back. A sharded spatial dim keeps its halo exchange."""

from __future__ import annotations

import numpy as np

from .. import ops as O
from .shape import _interleave
from .table import as_tensor, primitive


@primitive("conv_general_dilated")
def _conv(ev, e, lhs, rhs):
    p = e.params
    dn = p["dimension_numbers"]
    lhs, rhs = as_tensor(lhs), as_tensor(rhs)
    want = p.get("preferred_element_type")
    dt = np.dtype(want) if want is not None else np.result_type(lhs.dtype, rhs.dtype)
    x = O.transpose(lhs, tuple(dn.lhs_spec)) if tuple(dn.lhs_spec) != tuple(range(lhs.ndim)) else lhs
    w = O.transpose(rhs, tuple(dn.rhs_spec)) if tuple(dn.rhs_spec) != tuple(range(rhs.ndim)) else rhs
    x, w = (O.astype(t, dt) if t.dtype != dt else t for t in (x, w))
    for k, d in enumerate(p.get("lhs_dilation") or ()):
        if int(d) > 1:
            x = _interleave(x, 2 + k, int(d) - 1, 0)
    pads = [(int(lo), int(hi)) for lo, hi in p["padding"]]
    if any(lo < 0 or hi < 0 for lo, hi in pads):  # negative padding cuts the input first
        x = x[(slice(None), slice(None)) + tuple(slice(max(-lo, 0), x.shape[2 + k] - max(-hi, 0))
                                               for k, (lo, hi) in enumerate(pads))]
        pads = [(max(lo, 0), max(hi, 0)) for lo, hi in pads]
    kw = dict(stride=tuple(int(s) for s in p["window_strides"]), padding=pads,
              dilation=tuple(int(d) for d in (p.get("rhs_dilation") or (1,) * len(pads))),
              groups=int(p.get("feature_group_count", 1)))
    g = int(p.get("batch_group_count", 1))
    if g == 1:
        y = O.conv(x, w, **kw)
    else:  # (a grouped convolution's weight gradient) output feature group k reads input batch group k
        nb_, no = x.shape[0] // g, w.shape[0] // g
        y = O.concatenate([O.conv(x[k * nb_:(k + 1) * nb_], w[k * no:(k + 1) * no], **kw) for k in range(g)], axis=1)
    perm = tuple(int(i) for i in np.argsort(dn.out_spec))
    return O.transpose(y, perm) if perm != tuple(range(y.ndim)) else y
