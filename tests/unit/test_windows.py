import contextlib
import itertools
from math import prod

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nabla import windows as W
from nabla.testing import examples

jax = pytest.importorskip("jax")
from jax import lax  # noqa: E402


# ---- references -------------------------------------------------------------------------------------


def _pad(x, pads, fill):
    """Pad the trailing spatial dims, ``pads`` as ((lo, hi), ...)."""
    nd = len(pads)
    return np.pad(x, [(0, 0)] * (x.ndim - nd) + list(pads), constant_values=fill)


def _jax_conv(x, w, stride, dilation, pads, groups):
    with jax.enable_x64(True):
        y = lax.conv_general_dilated(x, w, window_strides=stride, padding=list(pads), rhs_dilation=dilation,
                                     feature_group_count=groups)
        return np.asarray(y)


def _jax_pool(x, kind, kernel, stride, dilation, pads, include_pad=True):
    one = (1, 1)
    args = dict(window_dimensions=one + kernel, window_strides=one + stride,
                padding=((0, 0), (0, 0)) + tuple(pads), window_dilation=one + dilation)
    with jax.enable_x64(True):
        if kind == "max":
            return np.asarray(lax.reduce_window(x, -np.inf, lax.max, **args))
        s = np.asarray(lax.reduce_window(x, 0.0, lax.add, **args))
        n = prod(kernel) if include_pad else np.asarray(lax.reduce_window(np.ones_like(x), 0.0, lax.add, **args))
        return s / n


def _ort(op, inputs, **attrs):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    names = [f"i{j}" for j in range(len(inputs))]
    vin = [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape) for n, a in zip(names, inputs)]
    vout = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * inputs[0].ndim)]
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], "g", vin, vout)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: a.astype(np.float32) for n, a in zip(names, inputs)})[0]


def _local(x, op, w, kernel, stride, dilation, pads, groups=1, include_pad=True):
    """nabla's kernels with G=0 on an explicitly padded input."""
    nd = len(kernel)
    if op == "conv":
        return W.conv(_pad(x, pads, 0.0), w, 0, stride, dilation, groups)
    if op == "max":
        return W.max_pool(_pad(x, pads, -np.inf), 0, kernel, stride, dilation)
    n = x.shape[2:]
    outs = tuple(W.out_size(n[i], kernel[i], stride[i], dilation[i], *pads[i]) for i in range(nd))
    counts = W.avg_divisor(n, (0,) * nd, outs, kernel, stride, [p[0] for p in pads], include_pad, dilation)
    return W.avg_pool(_pad(x, pads, 0.0), 0, kernel, stride, counts, dilation)


# (spatial, kernel, stride, dilation, pads, C, O, groups)
CASES = [
    ((9,), (3,), (1,), (1,), ((1, 1),), 4, 6, 1),
    ((11,), (4,), (3,), (2,), ((2, 0),), 6, 4, 2),
    ((7, 8), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1)), 3, 5, 1),
    ((10, 9), (3, 2), (2, 1), (1, 2), ((0, 2), (1, 0)), 4, 4, 4),
    ((12, 7), (2, 3), (3, 2), (2, 1), ((1, 0), (2, 1)), 6, 9, 3),
    ((5, 6, 7), (2, 3, 2), (1, 2, 2), (2, 1, 1), ((1, 0), (0, 1), (1, 1)), 2, 4, 2),
    ((6, 5, 4), (3, 3, 3), (1, 1, 1), (1, 1, 1), ((1, 1), (1, 1), (1, 1)), 3, 2, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}d-k{c[1]}-s{c[2]}-d{c[3]}-g{c[7]}")
def test_kernels_match_jax_float64(case):
    spatial, kernel, stride, dilation, pads, C, O, groups = case
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, C) + spatial)
    w = rng.normal(size=(O, C // groups) + kernel)
    np.testing.assert_allclose(_local(x, "conv", w, kernel, stride, dilation, pads, groups),
                               _jax_conv(x, w, stride, dilation, pads, groups), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(_local(x, "max", None, kernel, stride, dilation, pads),
                                  _jax_pool(x, "max", kernel, stride, dilation, pads))
    for inc in (True, False):
        np.testing.assert_allclose(_local(x, "avg", None, kernel, stride, dilation, pads, include_pad=inc),
                                   _jax_pool(x, "avg", kernel, stride, dilation, pads, inc), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES[1::2], ids=lambda c: f"{len(c[0])}d-k{c[1]}-s{c[2]}-g{c[7]}")
def test_kernels_match_onnxruntime(case):
    spatial, kernel, stride, dilation, pads, C, O, groups = case
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, C) + spatial).astype(np.float32)
    w = rng.normal(size=(O, C // groups) + kernel).astype(np.float32)
    onnx_pads = [p[0] for p in pads] + [p[1] for p in pads]
    common = dict(kernel_shape=list(kernel), strides=list(stride), pads=onnx_pads)
    got = _local(x, "conv", w, kernel, stride, dilation, pads, groups)
    want = _ort("Conv", [x, w], dilations=list(dilation), group=groups, **common)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    got = _local(x, "max", None, kernel, stride, dilation, pads)
    np.testing.assert_array_equal(got, _ort("MaxPool", [x], dilations=list(dilation), **common))
    ones = (1,) * len(kernel)
    for inc in (0, 1):
        got = _local(x, "avg", None, kernel, stride, ones, pads, include_pad=bool(inc))
        want = _ort("AveragePool", [x], count_include_pad=inc, **common)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_conv_broadcasts_grids_and_keeps_float32():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 1, 2, 4, 6, 6)).astype(np.float32)  # grid (3, 1): 3 different blocks
    w = rng.normal(size=(1, 2, 5, 4, 3, 3)).astype(np.float32)  # grid (1, 2): 2 different weights
    y = W.conv(x, w, 2)
    assert y.shape == (3, 2, 2, 5, 4, 4) and y.dtype == np.float32
    for i, j in itertools.product(range(3), range(2)):
        np.testing.assert_allclose(y[i, j], W.conv(x[i, 0], w[0, j], 0), rtol=1e-6)
    assert W.avg_pool(np.arange(8).reshape(1, 1, 8), 0, (2,), 2).tolist() == [[[0.5, 2.5, 4.5, 6.5]]]


# ---- window arithmetic ------------------------------------------------------------------------------


@given(st.integers(0, 30), st.integers(1, 5), st.integers(1, 4), st.integers(1, 3), st.integers(0, 4),
       st.integers(0, 4))
@settings(max_examples=examples(60, 1))
def test_out_size_counts_fitting_windows(n, kernel, stride, dilation, lo, hi):
    span = (kernel - 1) * dilation + 1
    fits = [s for s in range(-lo, n + hi, stride) if s + span <= n + hi]
    assert W.out_size(n, kernel, stride, dilation, lo, hi) == len(fits)


@given(st.integers(1, 20), st.integers(1, 5), st.integers(1, 4), st.integers(1, 3), st.integers(0, 4))
@settings(max_examples=examples(60, 1))
def test_tap_counts_brute_force(n, kernel, stride, dilation, pad_lo):
    idx = np.arange(12)
    want = [sum(0 <= i * stride - pad_lo + j * dilation < n for j in range(kernel)) for i in idx]
    assert W.tap_counts(idx, n, kernel, stride, dilation, pad_lo).tolist() == want


def test_halo_3x3_conv_pad1_over_4_shards():
    h = W.halo(16, W.out_size(16, 3, 1, 1, 1, 1), 4, 3, 1, 1, 1)
    assert (h.ci, h.co, h.width) == (4, 4, 6)
    assert h.lo == (-1, 3, 7, 11)
    assert h.left == (0, 1, 1, 1) and h.right == (1, 1, 1, 0)
    assert all(a + b <= 2 for a, b in zip(h.left, h.right))
    assert (h.max_left, h.max_right, h.max_hops) == (1, 1, 1)
    assert h.rows_from(1) == (1, 1) and h.rows_from(2) == (0, 0)
    assert W.halo_bytes(h, row_bytes=4 * 8 * 16) == (512, 512)


def test_halo_multi_hop_and_empty_shards():
    # a 7-wide kernel over shards of 2 rows reads 3 rows each side: 2 hops
    h = W.halo(16, 16, 8, 7, 1, 1, 3)
    assert h.max_left == h.max_right == 3 and h.max_hops == 2
    assert h.rows_from(1) == (2, 2) and h.rows_from(2) == (1, 1)
    # 5 outputs over 4 shards (2, 2, 1, 0): the last device needs nothing
    h = W.halo(5, 5, 4, 3, 1, 1, 1)
    assert h.need[3] == (0, 0) and h.left[3] == h.right[3] == 0


@st.composite
def _dims(draw, max_n=24, max_k=6):
    n_in = draw(st.integers(1, max_n))
    kernel, stride, dilation = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    lo, hi = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    n_out = W.out_size(n_in, kernel, stride, dilation, lo, hi)
    if n_out < 1:
        lo = hi = 0
        n_in = max(n_in, (kernel - 1) * dilation + 1)
        n_out = W.out_size(n_in, kernel, stride, dilation, 0, 0)
    return n_in, n_out, draw(st.integers(1, max_k)), kernel, stride, dilation, lo, hi


@given(_dims())
@settings(max_examples=examples(80, 1))
def test_halo_receives_only_what_the_windows_read(dims):
    n_in, n_out, k, kernel, stride, dilation, lo, _ = dims
    h = W.halo(n_in, n_out, k, kernel, stride, dilation, lo)
    ci, co = -(-n_in // k), -(-n_out // k)
    assert h.width == (co - 1) * stride + (kernel - 1) * dilation + 1
    for p in range(k):
        assert h.lo[p] == p * co * stride - lo
        read = {o * stride - lo + j * dilation for o in range(p * co, min(n_out, (p + 1) * co))
                for j in range(kernel)}
        read = {r for r in read if 0 <= r < n_in}
        if not read:
            assert h.need[p] == (0, 0) and h.left[p] == h.right[p] == 0
            continue
        a, b = min(read), max(read) + 1
        assert h.need[p] == (a, b) and h.lo[p] <= a and b <= h.lo[p] + h.width
        # from each other device, the slab from the first to the last row read that it holds
        slab = {s: (min(r for r in read if r // ci == s), max(r for r in read if r // ci == s) + 1)
                for s in {r // ci for r in read} if s != p}
        assert all(h.slabs[p][s] == slab.get(s, (0, 0)) for s in range(k) if s != p)
        assert h.left[p] == sum(e - f for s, (f, e) in slab.items() if s < p)
        assert h.right[p] == sum(e - f for s, (f, e) in slab.items() if s > p)
        assert h.left[p] + h.right[p] <= h.width
        assert h.hops_left[p] == (p - min(s for s in slab if s < p) if h.left[p] else 0)
        assert h.hops_right[p] == (max(s for s in slab if s > p) - p if h.right[p] else 0)
    assert h.max_left == max(h.left) and h.max_right == max(h.right)

    def got(p, src):  # rows p receives from device src
        if not 0 <= src < k or src == p:
            return 0
        read = {o * stride - lo + j * dilation for o in range(p * co, min(n_out, (p + 1) * co))
                for j in range(kernel)}
        mine = [r for r in read if 0 <= r < n_in and r // ci == src]
        return max(mine) + 1 - min(mine) if mine else 0

    for dist in range(1, h.max_hops + 2):
        assert h.rows_from(dist) == (max(got(p, p - dist) for p in range(k)), max(got(p, p + dist) for p in range(k)))
    assert h.rows_from(h.max_hops + 1) == (0, 0) and (h.max_hops == 0 or h.rows_from(h.max_hops) != (0, 0))


# ---- sharded simulation -------------------------------------------------------------------------------


def _store(x, dims):
    """Lay a global (N, C, *spatial) out as blocks: spatial dim i on grid axes ``dims[i] = ((axis, size), ...)``
    major to minor, over a grid of ``G`` axes (unused ones size 1); padding rows are NaN."""
    G = 1 + max((a for d in dims for a, _ in d), default=-1)
    grid = [1] * G
    for d in dims:
        for a, s in d:
            grid[a] = s
    ks = [prod(s for _, s in d) for d in dims]
    cis = [-(-n // k) for n, k in zip(x.shape[2:], ks)]
    out = np.full(tuple(grid) + x.shape[:2] + tuple(cis), np.nan)
    for g in itertools.product(*(range(s) for s in grid)):
        src, dst = [], []
        for d, ci, n in zip(dims, cis, x.shape[2:]):
            p = 0
            for a, s in d:
                p = p * s + g[a]
            rows = range(p * ci, min(n, (p + 1) * ci))
            src.append(slice(rows.start, rows.stop))
            dst.append(slice(0, len(rows)))
        out[g][(slice(None),) * 2 + tuple(dst)] = x[(slice(None),) * 2 + tuple(src)]
    return out, G


def _simulate(x, w, op, dims, kernel, stride, dilation, pads, groups=1, include_pad=True):
    """Extend every sharded block, run the kernel on all devices at once, and check each device's real
    output rows against the global result."""
    blocks, G = _store(x, dims)
    nd = len(kernel)
    n_in = x.shape[2:]
    n_out = tuple(W.out_size(n_in[i], kernel[i], stride[i], dilation[i], *pads[i]) for i in range(nd))
    fill = -np.inf if op == "max" else 0.0
    for i in range(nd):
        blocks = W.extend(blocks, 2 + i, G, [a for a, _ in dims[i]], n_in[i], n_out[i], kernel[i], stride[i],
                          dilation[i], pads[i][0], fill)
    if op == "conv":
        y = W.conv(blocks, w.reshape((1,) * G + w.shape), G, stride, dilation, groups)
    elif op == "max":
        y = W.max_pool(blocks, G, kernel, stride, dilation)
    else:
        counts = W.avg_divisor_blocks(G, blocks.shape[:G], [[a for a, _ in d] for d in dims], n_in, n_out, kernel,
                                      stride, [p[0] for p in pads], include_pad, dilation)
        y = W.avg_pool(blocks, G, kernel, stride, counts, dilation)
    want = _local(x, op, w, kernel, stride, dilation, pads, groups, include_pad)
    ks = [prod(s for _, s in d) for d in dims]
    cos = [-(-n // k) for n, k in zip(n_out, ks)]
    assert y.shape[G + 2:] == tuple(cos)
    checked = 0
    for g in itertools.product(*(range(s) for s in blocks.shape[:G])):
        src, dst = [], []
        for d, co, n in zip(dims, cos, n_out):
            p = 0
            for a, s in d:
                p = p * s + g[a]
            rows = range(p * co, min(n, (p + 1) * co))
            src.append(slice(rows.start, rows.stop))
            dst.append(slice(0, len(rows)))
        if any(len(range(s.start, s.stop)) == 0 for s in src):
            continue  # an empty shard
        got = y[g][(slice(None),) * 2 + tuple(dst)]
        np.testing.assert_allclose(got, want[(slice(None),) * 2 + tuple(src)], rtol=1e-12, atol=1e-12)
        checked += 1
    assert checked >= 1


@given(_dims(), st.sampled_from(["conv", "max", "avg", "avg_exclude"]), st.integers(1, 3), st.booleans(),
       st.booleans(), st.integers(0, 2**32 - 1))
@settings(max_examples=examples(80, 1))
def test_sharded_1d_matches_global(dims, op, minor, swap, grouped, seed):
    n_in, _, k, kernel, stride, dilation, lo, hi = dims
    # the dim's k shards on two grid axes (major, minor) with a replicated axis between them
    axes = [(0, k), (2, minor)] if not swap else [(2, k), (0, minor)]
    rng = np.random.default_rng(seed)
    C, groups = (4, 2) if grouped else (3, 1)
    x = rng.normal(size=(2, C, n_in))
    w = rng.normal(size=(4, C // groups, kernel))
    _simulate(x, w, op.split("_")[0], [axes], (kernel,), (stride,), (dilation,), ((lo, hi),), groups,
              include_pad=op != "avg_exclude")


@given(_dims(max_n=12, max_k=3), _dims(max_n=12, max_k=4), st.sampled_from(["conv", "max", "avg_exclude"]),
       st.integers(0, 2**32 - 1))
@settings(max_examples=examples(40, 1))
def test_sharded_2d_matches_global(dh, dw, op, seed):
    # H on grid axis 1, W on grid axes (2, 0): corners come through the two one-dim exchanges
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, 2, dh[0], dw[0]))
    kernel = (dh[3], dw[3])
    w = rng.normal(size=(3, 2) + kernel)
    dims = [[(1, dh[2])], [(2, dw[2]), (0, 2)]]
    _simulate(x, w, op.split("_")[0], dims, kernel, (dh[4], dw[4]), (dh[5], dw[5]),
              ((dh[6], dh[7]), (dw[6], dw[7])), include_pad=op != "avg_exclude")


def test_sharded_3d_conv_one_dim_sharded():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 2, 9, 5, 4))
    w = rng.normal(size=(2, 2, 3, 3, 2))
    _simulate(x, w, "conv", [[(0, 4)], [], []], (3, 3, 2), (2, 1, 1), (1, 1, 2), ((1, 1), (1, 1), (0, 1)))


def test_extend_unsharded_is_padding_and_int_max_fill():
    x = np.arange(10, dtype=np.int32).reshape(1, 2, 5)
    y = W.extend(x, 2, 0, (), 5, W.out_size(5, 3, 1, 1, 2, 1), 3, 1, 1, 2, fill=-np.inf)
    lowest = np.iinfo(np.int32).min
    assert y.dtype == np.int32 and y.shape == (1, 2, 8)
    assert y[0, 0].tolist() == [lowest, lowest, 0, 1, 2, 3, 4, lowest]
    assert W.max_pool(y, 0, (3,)).tolist() == [[[0, 1, 2, 3, 4, 4], [5, 6, 7, 8, 9, 9]]]


def test_extend_fills_rows_not_received():
    # 5 rows over 4 shards (2, 2, 1, 0) with a 3-tap window: the empty last shard receives nothing
    x = np.array([[0.0, 1.0], [2.0, 3.0], [4.0, np.nan], [np.nan, np.nan]]).reshape(4, 1, 1, 2)
    y = W.extend(x, 2, 1, (0,), 5, 5, 3, 1, 1, 1, fill=-1.0)
    assert y.shape == (4, 1, 1, 4)
    assert y[:, 0, 0].tolist() == [[-1, 0, 1, 2], [1, 2, 3, 4], [3, 4, -1, -1], [-1, -1, -1, -1]]


# ---- the conv kernel's paths: Winograd, the bias in the GEMM, kept weight transforms -----------------------


@contextlib.contextmanager
def _winograd_everywhere():
    """Winograd F(2x2, 3x3) on every 3x3 stride-1 conv whatever its channels and sizes, in pieces of 8 tiles
    (bands of tile rows of one image, short last pieces)."""
    from nabla.windows import winograd
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(winograd, "CHANNELS", 1)
        mp.setattr(winograd, "USE", 0.0)
        mp.setattr(winograd, "TILES", 8)
        yield


def _epilogue_ref(y, bias, res, relu):
    y = y + bias.reshape((1, -1) + (1,) * (y.ndim - 2)) + (0 if res is None else res)
    return np.maximum(y, 0) if relu else y


@pytest.mark.parametrize("spatial,pads", [((6, 6), ((1, 1), (1, 1))), ((7, 9), ((1, 1), (1, 1))),
                                          ((5, 4), ((0, 0), (2, 1))), ((3, 3), ((0, 0), (0, 0))),
                                          ((12, 5), ((1, 1), (0, 0)))], ids=str)
@pytest.mark.parametrize("res,relu", [(False, False), (True, True)])
def test_winograd_matches_jax_float64(spatial, pads, res, relu):
    """Odd and even sizes (a dropped tile row or column), one output, bands and a short last piece: as the
    direct sum, to float64 rounding, with the bias, a residual and relu after."""
    rng = np.random.default_rng(4)
    x, w, b = rng.normal(size=(3, 5) + spatial), rng.normal(size=(6, 5, 3, 3)), rng.normal(size=6)
    want = _jax_conv(x, w, (1, 1), (1, 1), pads, 1)
    r = rng.normal(size=want.shape) if res else None
    with _winograd_everywhere():
        got = W.conv(_pad(x, pads, 0.0), w, 0, bias=b, relu=relu, res=r)
        plain = _local(x, "conv", w, (3, 3), (1, 1), (1, 1), pads)
    np.testing.assert_allclose(got, _epilogue_ref(want, b, r, relu), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(plain, want, rtol=1e-12, atol=1e-12)


@given(_dims(max_n=12, max_k=3), st.integers(0, 2**32 - 1))
@settings(max_examples=examples(20, 1))
def test_winograd_sharded_matches_global(dh, seed):
    """Rows on grid axis 1, columns on grid axes (2, 0): every device's windows (halo rows, fill, blocks of
    padding) through Winograd equal the global conv (itself checked against jax above)."""
    rng = np.random.default_rng(seed)
    n = dh[0] + 2
    x, w = rng.normal(size=(2, 3, n, n + 1)), rng.normal(size=(4, 3, 3, 3))
    with _winograd_everywhere():
        _simulate(x, w, "conv", [[(1, dh[2])], [(2, 2), (0, 2)]], (3, 3), (1, 1), (1, 1), ((1, 1), (1, 0)))


def test_winograd_float32_matches_onnxruntime():
    """A ResNet-sized layer (256 channels, 14x14) takes Winograd unforced; float32, with its bias, it is as
    close to onnxruntime's conv as the direct sum is."""
    from nabla.windows import winograd
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 256, 14, 14)).astype(np.float32)
    w = (rng.normal(size=(256, 256, 3, 3)) / 48).astype(np.float32)
    b = rng.normal(size=256).astype(np.float32)
    assert winograd.fits((3, 3), (1, 1), (1, 1), 1, 256, 256, (14, 14), np.dtype(np.float32))
    want = _ort("Conv", [x, w, b], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    got = W.conv(_pad(x, ((1, 1), (1, 1)), 0.0), w, 0, bias=b)
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("case", [
    ((2, 4, 9, 9), (8, 4, 1, 1), (1, 1), 1),  # widens: the input copied under a row of ones
    ((2, 8, 9, 9), (4, 8, 1, 1), (1, 1), 1),  # narrows: the input read in place, the bias added after
    ((2, 4, 9, 9), (8, 4, 1, 1), (2, 2), 1),  # strided 1x1: copied anyway
    ((2, 4, 12, 11), (5, 4, 3, 3), (1, 1), 1),  # im2col
    ((9, 4, 4, 4), (6, 4, 3, 3), (1, 1), 1),  # thin images folded into one GEMM
    ((2, 4, 9, 9), (6, 2, 3, 3), (1, 1), 2),  # groups: the bias added after
], ids=lambda c: f"x{c[0]}w{c[1]}s{c[2]}g{c[3]}")
def test_conv_bias_residual_relu_on_every_kernel_path(case):
    """The bias as one more column of the GEMM's weight (or added after), a residual and relu, on grids of
    two blocks, equal the reference."""
    xs, ws, stride, groups = case
    rng = np.random.default_rng(6)
    x, w, b = rng.normal(size=(2,) + xs), rng.normal(size=ws), rng.normal(size=ws[0])
    want = _jax_conv(x[0], w, stride, (1, 1), ((0, 0), (0, 0)), groups)
    r = rng.normal(size=(2,) + want.shape)
    got = W.conv(x, w[None], 1, stride, None, groups, (), b[None], True, r)
    for i in range(2):
        ref = _epilogue_ref(_jax_conv(x[i], w, stride, (1, 1), ((0, 0), (0, 0)), groups), b, r[i], True)
        np.testing.assert_allclose(got[i], ref, rtol=1e-12, atol=1e-12)


def test_weight_transforms_are_kept_while_their_weights_live():
    """The GEMM weight with its bias column is made once for read-only blocks and dropped with them; a
    writeable weight (its values may change) is transformed on every call."""
    import gc
    from nabla.windows import arrays
    rng = np.random.default_rng(7)
    w, b = rng.normal(size=(4, 3, 1, 1)), rng.normal(size=4)
    dtype = np.dtype(np.float64)
    fresh = arrays.gemm_weight(w, b, dtype)
    assert arrays.gemm_weight(w, b, dtype) is not fresh  # writeable: never kept
    w.flags.writeable = b.flags.writeable = False
    kept = arrays.gemm_weight(w, b, dtype)
    assert arrays.gemm_weight(w, b, dtype) is kept and not kept.flags.writeable
    np.testing.assert_array_equal(kept, np.concatenate([w.reshape(4, 3), b[:, None]], axis=1))
    before = len(arrays._DERIVED)
    del w, kept
    gc.collect()
    assert len(arrays._DERIVED) == before - 1


def test_relu_keeps_nan_and_any_layout():
    from nabla.windows import arrays
    y = np.array([[-1.0, np.nan, 2.0, -0.5], [3.0, -2.0, 0.0, 1.0]]).T  # a transposed (strided) view
    out = arrays.relu_inplace(y)
    assert out is y
    np.testing.assert_array_equal(y, np.array([[0.0, np.nan, 2.0, 0.0], [3.0, 0.0, 0.0, 1.0]]).T)
    big = np.linspace(-1, 1, (1 << arrays._ZEROS_BITS) + 3)  # past the kept zeros: the scalar form
    np.testing.assert_array_equal(arrays.relu_inplace(big), np.maximum(np.linspace(-1, 1, big.size), 0))
