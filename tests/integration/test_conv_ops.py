"""Convolution, pooling and normalization on every sharding of batch, channels and spatial dims, against
float64 references nobody here wrote (jax.lax.conv_general_dilated and reduce_window, under x64), and the
halo exchange of spatially sharded dims checked against a brute-force count of the rows each device reads."""

import itertools

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh, ShardingError
from nabla.testing import assert_sharded_allclose

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
lax = jax.lax

M4 = DeviceMesh("m4", (4,), ("x",))
M22 = DeviceMesh("m22", (2, 2), ("x", "y"))
R = np.random.default_rng(0)


def ref_conv(x, w, stride, pads, dilation, groups):
    return np.asarray(lax.conv_general_dilated(x, w, stride, pads, rhs_dilation=dilation,
                                               feature_group_count=groups))


def ref_pool(x, kind, kernel, stride, pads, dilation, include=True):
    nd = len(kernel)
    win, st, dil = (1, 1) + kernel, (1, 1) + stride, (1, 1) + dilation
    pad = [(0, 0), (0, 0)] + list(pads)
    if kind == "max":
        return np.asarray(lax.reduce_window(x, -np.inf, lax.max, win, st, pad, window_dilation=dil))
    s = lax.reduce_window(x, 0.0, lax.add, win, st, pad, window_dilation=dil)
    if include:
        return np.asarray(s) / np.prod(kernel)
    c = lax.reduce_window(np.ones_like(x), 0.0, lax.add, win, st, pad, window_dilation=dil)
    return np.asarray(s / c)


CONV_CASES = [  # x shape, w shape, stride, padding pairs, dilation, groups
    ((2, 3, 13), (4, 3, 3), (1,), ((1, 1),), (1,), 1),
    ((2, 4, 11), (6, 2, 3), (2,), ((2, 0),), (2,), 2),
    ((3, 3, 9, 7), (4, 3, 3, 2), (1, 2), ((1, 1), (0, 1)), (1, 1), 1),
    ((2, 4, 10, 6), (4, 1, 3, 3), (2, 1), ((1, 2), (1, 1)), (2, 1), 4),
    ((1, 2, 6, 5, 5), (3, 2, 2, 3, 1), (1, 1, 2), ((0, 1), (1, 1), (0, 0)), (1, 2, 1), 1),
    ((2, 3, 20, 18), (4, 3, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),  # blocks wide enough for a GEMM each
    ((2, 4, 16, 9), (6, 2, 1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 2),  # 1x1: the input is its own im2col
    ((2, 4, 17, 10), (6, 4, 1, 1), (2, 2), ((0, 0), (0, 0)), (1, 1), 1),  # 1x1 strided
]


def x_specs(mesh, rank, dims=None):
    """Every way to put the mesh's axes on ``dims`` (default: N, C and the first two spatial dims), one axis
    per dim."""
    dims = list(range(min(rank, 4))) if dims is None else list(dims)
    out = []
    for assign in itertools.product([None] + dims, repeat=mesh.ndim):
        used = [d for d in assign if d is not None]
        if len(used) != len(set(used)):
            continue
        spec = [None] * rank
        for a, d in zip(mesh.axis_names, assign):
            if d is not None:
                spec[d] = a
        out.append(spec)
    return out


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"x{c[0]}w{c[1]}s{c[2]}g{c[5]}")
@pytest.mark.parametrize("mesh", [M4, M22], ids=lambda m: m.name)
def test_conv_on_every_sharding_equals_xla(case, mesh):
    xs, ws, stride, pads, dil, groups = case
    x, w = R.standard_normal(xs), R.standard_normal(ws)
    want = ref_conv(x, w, stride, pads, dil, groups)
    free = [a for a in mesh.axis_names]
    for spec in x_specs(mesh, len(xs)):
        # w replicated; O on C's axis; w's input channels on C's axis (partial sums); O on an axis x leaves free
        spare = [a for a in free if a not in spec]
        wspecs = [[None] * len(ws), [spec[1]] + [None] * (len(ws) - 1), [None, spec[1]] + [None] * (len(ws) - 2)]
        if spare:
            wspecs.append([spare[0]] + [None] * (len(ws) - 1))
        for wspec in wspecs:
            t = nb.tensor(x).shard(mesh, spec)
            u = nb.tensor(w).shard(mesh, wspec)
            out = nb.conv(t, u, stride=stride, padding=pads, dilation=dil, groups=groups)
            assert out.shape == want.shape and out.dtype == want.dtype
            assert_sharded_allclose(out, want, rtol=1e-10, atol=1e-10)


def test_conv_bias_and_host_operands():
    x, w, b = R.standard_normal((2, 3, 8, 8)), R.standard_normal((5, 3, 3, 3)), R.standard_normal(5)
    want = ref_conv(x, w, (1, 1), [(1, 1), (1, 1)], (1, 1), 1) + b[None, :, None, None]
    t = nb.tensor(x).shard(M22, ["x", None, "y", None])
    assert_sharded_allclose(nb.conv(t, w, b, padding=1), want, rtol=1e-10, atol=1e-10)
    assert_sharded_allclose(nb.conv(nb.tensor(x), nb.tensor(w), b, padding=1), want, rtol=1e-10, atol=1e-10)


def test_input_channels_sharded_give_partial_sums():
    x, w = R.standard_normal((2, 8, 6, 6)), R.standard_normal((4, 8, 3, 3))
    t = nb.tensor(x).shard(M4, [None, "x", None, None])
    u = nb.tensor(w).shard(M4, [None, "x", None, None])
    with nb.comm_log() as log:
        out = nb.conv(t, u, padding=1)
    assert out.sharding.partial_axes == ("x",) and log.events == []  # deferred like matmul's
    assert_sharded_allclose(out, ref_conv(x, w, (1, 1), [(1, 1), (1, 1)], (1, 1), 1), rtol=1e-10, atol=1e-10)


def brute_halo(n_in, n_out, k, kernel, stride, dilation, pad_lo):
    """Per direction, the most rows any device receives: rows its real outputs read, minus its own block."""
    ci, co = -(-n_in // k), -(-n_out // k)
    left = right = 0
    for p in range(k):
        read = {o * stride - pad_lo + j * dilation for o in range(p * co, min(n_out, (p + 1) * co))
                for j in range(kernel)}
        read = {r for r in read if 0 <= r < n_in}
        left = max(left, len({r for r in read if r < p * ci}))
        right = max(right, len({r for r in read if r >= (p + 1) * ci}))
    return left, right


@pytest.mark.parametrize("n,kernel,stride,dil,pads", [(16, 3, 1, 1, (1, 1)), (13, 3, 2, 1, (1, 0)),
                                                      (17, 5, 1, 2, (4, 4)), (9, 2, 1, 1, (0, 0))])
def test_spatial_sharding_exchanges_halo_rows_only(n, kernel, stride, dil, pads):
    """The comm log holds collective_permutes only, of exactly the halo rows; a 3x3 conv with padding 1 on
    16 rows over 4 devices sends each device two rows (one from each side)."""
    x, w = R.standard_normal((2, 3, n, 5)), R.standard_normal((4, 3, kernel, 1))
    t = nb.tensor(x).shard(M4, [None, None, "x", None])
    with nb.comm_log() as log:
        out = nb.conv(t, w, stride=(stride, 1), padding=(pads, (0, 0)), dilation=(dil, 1))
    assert set(log.counts) <= {"collective_permute"}
    n_out = out.shape[2]
    left, right = brute_halo(n, n_out, 4, kernel, stride, dil, pads[0])
    row = 2 * 3 * 5 * 8  # N x C x W float64: one input row of a block
    assert sorted(e.bytes for e in log.events) == sorted(b * row for b in (left, right) if b)
    if (n, kernel, stride, pads) == (16, 3, 1, (1, 1)):
        assert (left, right) == (1, 1)
    assert_sharded_allclose(out, ref_conv(x, w, (stride, 1), [pads, (0, 0)], (dil, 1), 1), rtol=1e-10, atol=1e-10)


M8 = DeviceMesh("m8", (8,), ("x",))
M222 = DeviceMesh("m222", (2, 2, 2), ("x", "y", "z"))


def read_rows(n_in, n_out, k, kernel, stride, dilation, pad_lo, p):
    """Input rows (inside the dim) that the real outputs of device ``p`` read, from the definition: output
    ``o`` reads ``o * stride - pad_lo + j * dilation`` for every tap ``j``; device ``p`` owns outputs
    ``[p * co, (p + 1) * co)`` of ``n_out`` (``co = ceil(n_out / k)``)."""
    co = -(-n_out // k)
    rows = {o * stride - pad_lo + j * dilation for o in range(p * co, min(n_out, (p + 1) * co))
            for j in range(kernel)}
    return {r for r in rows if 0 <= r < n_in}


def brute_halo_events(x_shape, splits, itemsize, windows):
    """The halo messages of a window op by brute force, independent of nabla.windows' arithmetic.

    ``splits``: how many blocks each dim of ``x`` is split into. ``windows``: per spatial dim ``d`` (in
    order), ``(d, k, kernel, stride, dilation, pad_lo, n_out)`` with ``k = splits[d]``. Each device receives,
    from each device holding rows its windows read, those rows as one slab (first to last row read there:
    the rows read, unless a stride and a dilation both skip rows inside one block). The messages of one
    distance and direction form a part, as large as its largest slab. Parts share a collective_permute
    while it stays a permutation (XLA's source-target pairs: no device sends twice or receives twice):
    largest part first, each into the first round it fits. A row is the rest of the block: the other dims'
    blocks (ceil rule), the spatial dims handled before it already widened to their windows (the rows from
    the first window's first tap to the last window's last)."""
    block = [-(-n // k) for n, k in zip(x_shape, splits)]
    sizes = []
    for d, k, kernel, stride, dilation, pad_lo, n_out in windows:
        n_in = x_shape[d]
        ci, co = -(-n_in // k), -(-n_out // k)
        row = itemsize * int(np.prod([b for i, b in enumerate(block) if i != d]))
        most: dict[tuple[int, bool], int] = {}
        pairs: dict[tuple[int, bool], set] = {}
        for p in range(k):
            by_source: dict[int, list[int]] = {}
            for r in read_rows(n_in, n_out, k, kernel, stride, dilation, pad_lo, p):
                if r // ci != p:
                    by_source.setdefault(r // ci, []).append(r)
            for q, rows in by_source.items():
                key = (abs(q - p), q < p)
                most[key] = max(most.get(key, 0), max(rows) + 1 - min(rows))  # one slab per source
                pairs.setdefault(key, set()).add((q, p))
        rounds: list[list] = []  # [rows, senders, receivers]
        for key in sorted(most, key=lambda key: -most[key]):
            snd, rcv = {q for q, _ in pairs[key]}, {p for _, p in pairs[key]}
            for r in rounds:
                if not (r[1] & snd) and not (r[2] & rcv):
                    r[1] |= snd
                    r[2] |= rcv
                    break
            else:
                rounds.append([most[key], set(snd), set(rcv)])
        sizes += [r[0] * row for r in rounds]
        block[d] = (co - 1) * stride + (kernel - 1) * dilation + 1
    return sorted(sizes)


def n_outs(x_shape, kernel, stride, pads, dilation):
    return [(n + lo + hi - (k - 1) * d - 1) // s + 1
            for n, k, s, (lo, hi), d in zip(x_shape[2:], kernel, stride, pads, dilation)]


HALO_CASES = [  # mesh, x spec, x shape, kernel, stride, pads, dilation
    (M22, [None, None, "x", "y"], (2, 3, 9, 10), (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1)),  # H and W both
    (M22, [None, None, "x", "y"], (2, 2, 13, 11), (3, 5), (2, 1), ((1, 0), (2, 2)), (1, 2)),  # strided, dilated
    (M22, [None, "x", "y", None], (1, 4, 11, 4), (5, 2), (1, 1), ((2, 2), (0, 1)), (1, 1)),  # C and H
    (M22, [None, None, ("x", "y"), None], (2, 2, 6, 5), (5, 1), (1, 1), ((2, 2), (0, 0)), (1, 1)),  # 4-way H
    (M22, [None, None, ("x", "y"), None], (1, 2, 4, 3), (5, 3), (1, 1), ((2, 2), (1, 1)), (1, 1)),  # 2 hops
    (M22, [None, None, ("y", "x"), None], (1, 3, 5, 3), (3, 1), (1, 1), ((2, 2), (0, 0)), (2, 1)),  # dilated
    (M22, [None, None, ("y", "x"), None], (1, 3, 4, 3), (3, 1), (1, 1), ((2, 2), (0, 0)), (2, 1)),  # hop 2 only
    (M222, [None, None, ("x", "y"), "z"], (2, 1, 8, 6), (5, 3), (1, 2), ((2, 2), (1, 1)), (1, 1)),  # 3 axes
    (M8, [None, None, "x", None], (1, 2, 7, 3), (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1)),  # an all-padding block
    (M8, [None, None, "x", None], (1, 2, 5, 3), (7, 1), (1, 1), ((3, 3), (0, 0)), (1, 1)),  # 3 hops, uneven
    (M4, [None, None, "x", None], (1, 2, 12, 3), (3, 1), (2, 1), ((2, 2), (0, 0)), (2, 1)),  # skips rows
]


def splits_of(mesh, spec):
    """How many blocks each dim is split into under ``spec`` (a list of None / axis / axes per dim)."""
    out = []
    for axes in spec:
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        out.append(int(np.prod([mesh.shape[mesh.axis_names.index(a)] for a in axes])) if axes else 1)
    return out


def halo_windows(splits, x_shape, kernel, stride, pads, dilation):
    outs = n_outs(x_shape, kernel, stride, pads, dilation)
    return [(2 + i, splits[2 + i], kernel[i], stride[i], dilation[i], pads[i][0], outs[i]) for i in range(len(kernel))]


@pytest.mark.parametrize("case", HALO_CASES, ids=lambda c: f"{c[0].name}-{c[1]}-x{c[2]}k{c[3]}")
def test_halo_bytes_equal_a_brute_force_count(case):
    """Conv, max pool and average pool on 2-D and multi-axis spatial shardings (multi-hop halos included):
    only collective_permutes, of exactly the rows read and not held, in as few rounds as the permutation rule
    allows (see brute_halo_events)."""
    mesh, spec, xs, kernel, stride, pads, dil = case
    x = R.standard_normal(xs)
    splits = splits_of(mesh, spec)
    want_bytes = brute_halo_events(xs, splits, 8, halo_windows(splits, xs, kernel, stride, pads, dil))
    w = R.standard_normal((3, xs[1]) + kernel)
    runs = {
        "conv": (lambda t: nb.conv(t, w, stride=stride, padding=pads, dilation=dil),
                 ref_conv(x, w, stride, list(pads), dil, 1)),
        "max_pool": (lambda t: nb.max_pool(t, kernel, stride, pads, dil),
                     ref_pool(x, "max", kernel, stride, pads, dil)),
        "avg_pool": (lambda t: nb.avg_pool(t, kernel, stride, pads, False, dil),
                     ref_pool(x, "avg", kernel, stride, pads, dil, False)),
    }
    for name, (fn, want) in runs.items():
        t = nb.tensor(x).shard(mesh, spec)
        with nb.comm_log() as log:
            out = fn(t)
        assert set(log.counts) <= {"collective_permute"}, (name, log.counts)
        assert sorted(e.bytes for e in log.events) == want_bytes, name
        assert [d.axes for d in out.sharding.dim_specs[2:]] == [d.axes for d in t.sharding.dim_specs[2:]], name
        assert_sharded_allclose(out, want, rtol=1e-10, atol=1e-10)


def test_the_brute_force_counts_what_it_should():
    """The brute force itself, on cases counted by hand: a 3x3 conv, padding 1, 16 rows over 4 devices
    sends each device one row from each side (two messages: every inner device sends both ways); a
    dilation-2 window over one-row blocks reads two devices away and never its neighbours (devices 0, 1 read
    from 2, 3 and 2, 3 from 0, 1: one swap, a single collective_permute)."""
    assert brute_halo_events((1, 1, 16, 1), (1, 1, 4, 1), 8, [(2, 4, 3, 1, 1, 1, 16)]) == [8, 8]
    assert brute_halo_events((1, 1, 4, 1), (1, 1, 4, 1), 8, [(2, 4, 3, 1, 2, 2, 4)]) == [8]
    assert read_rows(4, 4, 4, 3, 1, 2, 2, 1) == {1, 3}  # device 1 (output 1) reads rows -1, 1, 3
    # 8x8 on 2x2 devices, 3x3 padding 1: along H the two devices swap one row of a 4-wide block (one
    # permutation, 32 B); along W they swap one column of H's 6-row window (the corners come along: 48 B)
    assert brute_halo_events((1, 1, 8, 8), (1, 1, 2, 2), 8, [(2, 2, 3, 1, 1, 1, 8), (3, 2, 3, 1, 1, 1, 8)]) == \
        [32, 48]


POOL_CASES = [((2, 3, 13, 6), (3, 2), (2, 2), ((1, 1), (0, 1)), (1, 1)),
              ((1, 2, 10, 9), (2, 3), (1, 2), ((0, 1), (1, 1)), (2, 1)),
              ((2, 2, 7), (3,), (1,), ((1, 1),), (1,))]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"x{c[0]}k{c[1]}")
@pytest.mark.parametrize("mesh", [M4, M22], ids=lambda m: m.name)
def test_pools_on_every_sharding_equal_xla(case, mesh):
    xs, kernel, stride, pads, dil = case
    x = R.standard_normal(xs)
    x[0, 0, 0] = -np.inf  # padding must never beat a real -inf (max) nor count (average)
    refs = {"max": ref_pool(x, "max", kernel, stride, pads, dil),
            "avg": ref_pool(x, "avg", kernel, stride, pads, dil, True),
            "avg_excl": ref_pool(x, "avg", kernel, stride, pads, dil, False)}
    for spec in x_specs(mesh, len(xs)):
        t = nb.tensor(x).shard(mesh, spec)
        assert_sharded_allclose(nb.max_pool(t, kernel, stride, pads, dil), refs["max"], rtol=1e-12, atol=1e-12)
        assert_sharded_allclose(nb.avg_pool(t, kernel, stride, pads, True, dil), refs["avg"], rtol=1e-12, atol=1e-12)
        assert_sharded_allclose(nb.avg_pool(t, kernel, stride, pads, False, dil), refs["avg_excl"],
                                rtol=1e-12, atol=1e-12)


def test_integer_pools_follow_numpy_dtypes():
    x = R.integers(-50, 50, (1, 2, 8, 8)).astype(np.int32)
    t = nb.tensor(x).shard(M4, [None, None, "x", None])
    mp = nb.max_pool(t, 2)
    assert mp.dtype == np.int32
    np.testing.assert_array_equal(mp.numpy(), ref_pool(x.astype(np.float64), "max", (2, 2), (2, 2), [(0, 0)] * 2,
                                                       (1, 1)).astype(np.int32))
    ap = nb.avg_pool(t, 2)
    assert ap.dtype == np.float64
    np.testing.assert_allclose(ap.numpy(), ref_pool(x.astype(np.float64), "avg", (2, 2), (2, 2), [(0, 0)] * 2,
                                                    (1, 1)))


def test_global_avg_pool_batch_and_layer_norm():
    x = R.standard_normal((4, 6, 5, 7))
    t = nb.tensor(x).shard(M22, ["x", None, "y", None])
    assert_sharded_allclose(nb.global_avg_pool(t), x.mean(axis=(2, 3), keepdims=True), rtol=1e-12, atol=1e-12)
    mean, var = R.standard_normal(6), R.random(6) + 0.5
    scale, bias = R.standard_normal(6), R.standard_normal(6)
    c = (slice(None), None, None)
    want = (x - mean[c]) / np.sqrt(var[c] + 1e-5) * scale[c] + bias[c]
    tc = nb.tensor(x).shard(M22, [None, "x", "y", None])
    assert_sharded_allclose(nb.batch_norm(tc, mean, var, scale, bias), want, rtol=1e-12, atol=1e-12)
    h = R.standard_normal((8, 16))
    g, b = R.standard_normal(16), R.standard_normal(16)
    mu = h.mean(-1, keepdims=True)
    sd = np.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    th = nb.tensor(h).shard(M22, ["x", "y"])
    with nb.comm_log() as log:
        out = nb.layer_norm(th, g, b)
    assert_sharded_allclose(out, (h - mu) / sd * g + b, rtol=1e-12, atol=1e-12)
    assert log.counts == {"all_reduce": 2}  # the mean's and the variance's, as XLA does


def every_spec(mesh, rank):
    """Every placement of the mesh's axes on the dims of a rank-``rank`` tensor: each axis on at most one
    dim, a dim holding none, one or several axes (in either order)."""
    out = set()
    names = mesh.axis_names
    for assign in itertools.product([None] + list(range(rank)), repeat=len(names)):
        for order in itertools.permutations(range(len(names))):
            spec = [[] for _ in range(rank)]
            for j in order:
                if assign[j] is not None:
                    spec[assign[j]].append(names[j])
            out.add(tuple(None if not a else a[0] if len(a) == 1 else tuple(a) for a in spec))
    return sorted(out, key=repr)


@pytest.mark.parametrize("mesh", [M4, M22], ids=lambda m: m.name)
def test_batch_norm_on_every_sharding_of_every_dim(mesh):
    x = R.standard_normal((4, 6, 5, 7))
    mean, var = R.standard_normal(6), R.random(6) + 0.5
    scale, bias = R.standard_normal(6), R.standard_normal(6)
    c = (slice(None), None, None)
    want = (x - mean[c]) / np.sqrt(var[c] + 1e-3) * scale[c] + bias[c]
    for spec in every_spec(mesh, 4):
        t = nb.tensor(x).shard(mesh, list(spec))
        params = [nb.tensor(v).shard(mesh, [spec[1]]) for v in (mean, var, scale, bias)]  # channels alike
        with nb.comm_log() as log:
            out = nb.batch_norm(t, *params, eps=1e-3)
        assert log.events == [], spec  # per channel: nothing moves
        assert_sharded_allclose(out, want, rtol=1e-12, atol=1e-12)
        assert_sharded_allclose(nb.batch_norm(t, mean, var, scale, bias, eps=1e-3), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("axis", [-1, (1, 2)], ids=["last", "last_two"])
@pytest.mark.parametrize("mesh", [M4, M22], ids=lambda m: m.name)
def test_layer_norm_on_every_sharding_of_every_dim(mesh, axis):
    h = R.standard_normal((6, 5, 8))
    axes = (axis,) if isinstance(axis, int) else axis
    norm_shape = tuple(h.shape[a] for a in axes)
    g, b = R.standard_normal(norm_shape), R.standard_normal(norm_shape)
    mu = h.mean(axis=axes, keepdims=True)
    want = (h - mu) / np.sqrt(((h - mu) ** 2).mean(axis=axes, keepdims=True) + 1e-5) * g + b
    for spec in every_spec(mesh, 3):
        t = nb.tensor(h).shard(mesh, list(spec))
        with nb.comm_log() as log:
            out = nb.layer_norm(t, g, b, axis=axis)
        assert_sharded_allclose(out, want, rtol=1e-12, atol=1e-12)
        on_norm = {a for d in axes for a in ((spec[d % 3],) if isinstance(spec[d % 3], str) else spec[d % 3] or ())}
        # the mean's and the variance's sums (an all_reduce, or reduce_scatter + all_reduce + all_gather
        # over two axes), over the axes of the normalised dims only; nothing when those are whole
        assert set(log.counts) <= {"all_reduce", "reduce_scatter", "all_gather"}, (spec, log.counts)
        assert bool(log.events) == bool(on_norm) and all(set(e.axes) <= on_norm for e in log.events), spec
        assert log.counts.get("all_reduce", 0) == (2 if on_norm else 0), (spec, log.counts)


def test_global_pools_reduce_whole_windows():
    """A window as large as the image (a global pool, ONNX's GlobalAveragePool as AveragePool), on spatial
    shards: an average is a mean (partial sums over the row shards, summed once where needed: the (N, C)
    result's all_reduce, 2 x 7/8 x 48 B on 8 devices; ResNet-50's final 7 x 7 pool exchanged 286,720 B of halo
    rows before); a max gets every row through multi-hop halos; the values equal the reference."""
    x = R.standard_normal((2, 3, 7, 6))
    with nb.comm_log() as log:
        y = nb.avg_pool(nb.tensor(x).shard(M8, [None, None, "x", None]), (7, 6))
        assert log.events == [] and y.sharding.partial_axes == ("x",)
        y = y.with_sharding(M8, [None, None, None, None])
    assert [(e.kind, e.bytes) for e in log.events] == [("all_reduce", 2 * 7 * 2 * 3 * 8 // 8)]
    assert_sharded_allclose(y, x.mean(axis=(2, 3), keepdims=True), rtol=1e-12, atol=1e-12)
    for spec in ([None, None, "x", None], [None, "x", None, None], ["x", None, None, None]):
        t = nb.tensor(x).shard(M8, spec)
        assert_sharded_allclose(nb.avg_pool(t, (7, 6)), x.mean(axis=(2, 3), keepdims=True), rtol=1e-12, atol=1e-12)
        assert_sharded_allclose(nb.max_pool(t, (7, 6)), x.max(axis=(2, 3), keepdims=True), rtol=1e-12, atol=1e-12)
        assert_sharded_allclose(nb.avg_pool(t, (7, 3), stride=(1, 3)), ref_pool(x, "avg", (7, 3), (1, 3),
                                [(0, 0), (0, 0)], (1, 1)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", [[None, None, "x", None], ["x", None, None, None], [None, None, None, "x"],
                                  [None, "x", None, None]], ids=str)
@pytest.mark.parametrize("relu", [False, True])
def test_fused_conv_bias_relu_equals_the_reference(spec, relu):
    """nox.run's fused conv (bias and Relu in the kernel): 7 rows on 8 devices leave the last block only
    padding, which the kernel skips; input channels sharded are gathered first (no partial sums reach the
    relu)."""
    fuse = pytest.importorskip("nabla.onnx.fuse")
    x, w, b = R.standard_normal((2, 8, 7, 9)), R.standard_normal((5, 8, 3, 3)), R.standard_normal(5)
    want = ref_conv(x, w, (1, 1), [(1, 1), (1, 1)], (1, 1), 1) + b[None, :, None, None]
    want = np.maximum(want, 0) if relu else want
    t = nb.tensor(x).shard(M8, spec)
    out = fuse.conv_act(t, w, b, (1, 1), ((1, 1), (1, 1)), (1, 1), 1, relu)
    assert out.sharding.partial_axes == ()
    assert_sharded_allclose(out, want, rtol=1e-10, atol=1e-10)
    strided = fuse.conv_act(t, w, None, (2, 2), ((1, 1), (0, 0)), (1, 1), 1, relu)
    want2 = ref_conv(x, w, (2, 2), [(1, 1), (0, 0)], (1, 1), 1)
    assert_sharded_allclose(strided, np.maximum(want2, 0) if relu else want2, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spec", [[None, None, "x", None], ["x", None, None, None], [None, None, None, "x"]], ids=str)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("n", [2, 16])
def test_fused_conv_adds_a_residual_in_its_kernel(spec, relu, n):
    """``relu(conv + bias + residual)`` in one op: the residual, laid out as the result, moves nowhere (the
    collectives are the conv's own) and is added in the order an Add after the conv would (exactly equal);
    7 rows on 8 devices leave a padding block; 16 images of 2x3 fold into one GEMM."""
    fuse = pytest.importorskip("nabla.onnx.fuse")
    x, w, b = R.standard_normal((n, 8, 7, 3)), R.standard_normal((5, 8, 3, 3)), R.standard_normal(5)
    t = nb.tensor(x).shard(M8, spec)
    with nb.comm_log() as conv_only:
        y = fuse.conv_act(t, w, b, (1, 1), ((1, 1), (1, 1)), (1, 1), 1, False)
    r = nb.tensor(R.standard_normal(y.shape)).shard(M8, spec)
    with nb.comm_log() as log:
        out = fuse.conv_act(t, w, b, (1, 1), ((1, 1), (1, 1)), (1, 1), 1, relu, r)
    assert [(e.kind, e.bytes) for e in log.events] == [(e.kind, e.bytes) for e in conv_only.events]
    want = y.numpy() + r.numpy()
    np.testing.assert_array_equal(out.numpy(), np.maximum(want, 0) if relu else want)
    assert out.sharding.layout() == y.sharding.layout()


@pytest.mark.parametrize("xs,spec", [((2, 3, 5, 9), ["a", None, "b", None]), ((2, 3, 5, 30), [None, None, "b", "a"]),
                                     ((4, 3, 9, 40), ["a", None, "b", None])], ids=str)
def test_fused_conv_skips_padding_blocks_on_a_later_grid_axis(xs, spec):
    """Rows on the second axis of a 2x4 mesh (5 or 9 rows over 4: the last block is all padding): the kernel
    writes the live blocks through a strided view of the output, by one GEMM per image or folded."""
    fuse = pytest.importorskip("nabla.onnx.fuse")
    m24 = DeviceMesh("m24", (2, 4), ("a", "b"))
    x, w, b = R.standard_normal(xs), R.standard_normal((4, 3, 3, 3)), R.standard_normal(4)
    want = np.maximum(ref_conv(x, w, (1, 1), [(1, 1), (1, 1)], (1, 1), 1) + b[None, :, None, None], 0)
    out = fuse.conv_act(nb.tensor(x).shard(m24, spec), w, b, (1, 1), ((1, 1), (1, 1)), (1, 1), 1, True)
    assert_sharded_allclose(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bad,match", [
    (lambda: nb.conv(np.ones((1, 3, 5, 5)), np.ones((2, 4, 3, 3))), "channels"),
    (lambda: nb.conv(np.ones((1, 3, 2, 2)), np.ones((2, 3, 3, 3))), "smaller than the window"),
    (lambda: nb.conv(np.ones((1, 3, 5, 5)), np.ones((2, 3, 3, 3)), stride=0), "stride"),
    (lambda: nb.max_pool(np.ones((1, 3, 5, 5)), 2, padding=-1), "padding"),
    (lambda: nb.avg_pool(np.ones((5, 5)), 2), "N, C"),
])
def test_bad_windows_are_sharding_errors(bad, match):
    with pytest.raises(ShardingError, match=match):
        bad()


@pytest.mark.parametrize("spec", [None, [None, None, "x", None], ["x", None, None, None], ["x", None, "y", None]])
def test_conv_of_an_empty_batch_equals_xla(spec):
    """A batch of 0 images (an ONNX model fed an empty batch): the rule dropped the size-0 batch factor and
    the result came out with a batch of 1 (found by review)."""
    x, w = R.standard_normal((0, 3, 8, 8)), R.standard_normal((4, 3, 3, 3))
    want = ref_conv(x, w, (1, 1), [(1, 1), (1, 1)], (1, 1), 1)
    t = nb.tensor(x) if spec is None else nb.tensor(x).shard(M22, spec)
    out = nb.conv(t, nb.tensor(w), padding=1)
    assert out.shape == want.shape == (0, 4, 8, 8) and out.dtype == want.dtype
    assert_sharded_allclose(out, want)


@pytest.mark.parametrize("mesh", [M4, M22], ids=lambda m: m.name)
def test_winograd_convs_on_every_sharding_equal_xla(mesh, monkeypatch):
    """256 channels, 3x3 stride 1: the kernel's Winograd path on blocks of whole channels and 4 rows or more
    (the direct one where input channels are split); on every sharding of N, C and the spatial dims equal
    to the float64 reference."""
    from nabla.windows import winograd
    calls = []
    monkeypatch.setattr(winograd, "conv", lambda *a, _f=winograd.conv: calls.append(1) or _f(*a))
    x, w, b = R.standard_normal((2, 256, 16, 14)), R.standard_normal((256, 256, 3, 3)), R.standard_normal(256)
    want = ref_conv(x, w, (1, 1), [(1, 1), (1, 1)], (1, 1), 1) + b[None, :, None, None]
    for spec in x_specs(mesh, 4):
        out = nb.conv(nb.tensor(x).shard(mesh, spec), w, b, padding=1)
        assert_sharded_allclose(out, want, rtol=1e-10, atol=1e-10)
    assert calls
