"""Winograd F(2x2, 3x3) for the 3x3 stride-1 convs with many channels, on the ``(L, C, H+2, W+2)`` windows
``kernels`` runs them on: which convs take it (``fits``) and how they are cut into pieces are decided here; the
epilogue and the kept weight transform are ``arrays``'s."""

from __future__ import annotations

import numpy as np

from .arrays import derived, finish

# Each 2x2 tile of output from a 4x4 tile of input (stride 2): V = B^T d B per input tile and channel,
# M = U V per tile position (16 GEMMs over the channels, U = G g G^T the weight's transform), then
# Y = A^T M A. 16 multiplies per 4 outputs where a direct conv makes 36: the GEMMs shrink 2.25x, and the
# transforms (adds only) cost less than that on layers with many channels. Exact in exact arithmetic; in
# float32 as accurate as the direct sum (the transforms' entries are 0, +-1 and +-1/2).
_G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])  # the weight's transform, G g G^T
_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])  # the output's, A^T M A
# Least input and output channels for Winograd: the GEMM time saved grows with C*O, the transforms (passes
# over 4x the input and output) with C + O. Measured on ResNet-50's layers (batch 8, one core): 256 channels
# (14x14) 15-25% faster than the direct conv; 128 (28x28) even (17.9 vs 17.3 ms, batch sharded); 64 (56x56)
# within the noise.
CHANNELS = 256
# Least share of the computed tiles' outputs that is real output (a 7x7 image computes 8x10 tile outputs,
# with odd sizes rounded up and the flat column transform's extra tile per row): below, the GEMM's waste
# eats the gain.
USE = 0.85
# Tile positions per GEMM the image chunks aim for: fewer make thin GEMMs, more leave the cache.
TILES = 128


def fits(kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], groups: int, C: int, O: int,
         outs: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether :func:`conv` runs this conv: 3x3, stride and dilation 1, ungrouped, floating point, with
    :data:`CHANNELS` and :data:`USE`, and at least two tile rows (a block of one tile row, image
    rows split 8 ways, reads twice as many input rows as it makes: measured slower than the direct conv)."""
    if kernel != (3, 3) or stride != (1, 1) or dilation != (1, 1) or groups != 1 or dtype.kind != "f":
        return False
    th, tw = -(-outs[0] // 2), -(-outs[1] // 2)
    return (min(C, O) >= CHANNELS and th >= 2 and tw >= 1
            and outs[0] * outs[1] >= USE * 2 * th * 2 * (tw + 1))


def conv(runs: list[tuple], w: np.ndarray, bias: np.ndarray | None, relu: bool, has_res: bool, dtype: np.dtype,
         out: np.ndarray) -> np.ndarray:
    """F(2x2, 3x3) over ``runs`` of ``(x (L, C, H+2, W+2), out (L, O, H, W), res)``, in pieces of about
    :data:`TILES` tiles (a few images, or a band of tile rows of a large one) so that each piece's
    transforms stay in cache.

    The transforms are passes over whole pieces, laid out so each is a long run: the input rows split even
    and odd (one copy, which also moves channels before images, as the GEMM wants them); the column
    transform on that buffer as flat stride-2 sequences (each row's last tile reads into the next row: one
    extra tile column, computed and dropped); the row transform as contiguous blocks (even and odd rows
    are each contiguous); one batched GEMM per piece; the output transform as one small GEMM; the tiles
    scattered into the output with the bias added. A non-finite input reaches the other outputs of its
    tiles (as in any Winograd conv), not only those whose windows hold it."""
    O, C = w.shape[:2]
    U = derived("winograd", (w,), lambda: (np.kron(_G, _G) @ w.reshape(O * C, 9).T.astype(
        np.float64)).astype(dtype).reshape(16, O, C))
    AtA = np.kron(_AT, _AT).astype(dtype)  # (4, 16): the output transform of every tile
    Hp, Wp = runs[0][0].shape[-2:]
    H, W = Hp - 2, Wp - 2
    th, tc = -(-H // 2), -(-W // 2) + 1  # tiles per image (odd sizes round up); tile columns computed
    if th * tc > TILES:  # bands of tile rows, one image at a time
        n, hb = 1, min(th, max(1, TILES // tc))
        pieces = [(xr[l:l + 1, :, 2 * i:2 * i + 2 * hb + 2], orr[l:l + 1, :, 2 * i:2 * i + 2 * hb],
                   rr[l:l + 1, :, 2 * i:2 * i + 2 * hb]) for xr, orr, rr in runs
                  for l in range(xr.shape[0]) for i in range(0, th, hb)]
    else:  # a few whole images
        hb = th
        n = max(1, min(max(r[0].shape[0] for r in runs), round(TILES / (th * tc))))
        pieces = [(xr[l:l + n], orr[l:l + n], rr[l:l + n]) for xr, orr, rr in runs
                  for l in range(0, xr.shape[0], n)]
    X = np.zeros((C, n, 2, hb + 1, 2 * tc), dtype)  # input row 2i + p at [p, i]; zeros past the input
    Cb = np.zeros((4, C, n, 2, hb + 1, tc), dtype)
    tiles = n * hb * tc
    Vb, Mb, Yb = np.empty(16 * C * tiles, dtype), np.empty(16 * O * tiles, dtype), np.empty(4 * O * tiles, dtype)
    b = np.zeros((O, 1, 1), dtype) if bias is None else bias.astype(dtype, copy=False).reshape(O, 1, 1)
    xf, cf = X.reshape(-1), Cb.reshape(4, -1)
    half = xf.size // 2 - 1  # column pairs computed: all but the very last (a dropped tile column)
    e0, o0, e1, o1 = (xf[k:k + 2 * half:2] for k in range(4))  # columns 2j, 2j+1, 2j+2, 2j+3
    filled = [hb + 1, hb + 1]  # even, odd input rows of X that may hold data
    for xs, dst, rs in pieces:
        m, hp = xs.shape[0], xs.shape[2]
        h = hp - 2
        tb = -(-h // 2)  # tile rows of this piece
        src = xs.transpose(1, 0, 2, 3)
        for p in (0, 1):
            k = len(range(p, hp, 2))
            X[:, :m, p, :k, :Wp] = src[:, :, p::2]
            if filled[p] > k:  # a shorter piece (the last band): rows past it are zeros again
                X[:, :, p, k:filled[p]] = 0
            filled[p] = k
        # columns: d B for each row, b = 0..3 (B^T's rows: [1 0 -1 0], [0 1 1 0], [0 -1 1 0], [0 1 0 -1])
        np.subtract(e0, e1, out=cf[0, :half])
        np.add(o0, e1, out=cf[1, :half])
        np.subtract(e1, o0, out=cf[2, :half])
        np.subtract(o0, o1, out=cf[3, :half])
        # rows: B^T (d B), a = 0..3, from rows 2i (even, i), 2i+1 (odd, i), 2i+2 (even, i+1), 2i+3 (odd, i+1)
        T = m * tb * tc
        V = Vb[:16 * C * T].reshape(4, 4, C, m, tb, tc)
        ev0, ev1 = Cb[:, :, :m, 0, :tb], Cb[:, :, :m, 0, 1:tb + 1]
        od0, od1 = Cb[:, :, :m, 1, :tb], Cb[:, :, :m, 1, 1:tb + 1]
        np.subtract(ev0, ev1, out=V[0])
        np.add(od0, ev1, out=V[1])
        np.subtract(ev1, od0, out=V[2])
        np.subtract(od0, od1, out=V[3])
        M = Mb[:16 * O * T].reshape(16, O, T)
        np.matmul(U, V.reshape(16, C, T), out=M)
        Y = Yb[:4 * O * T].reshape(4, O, m, tb, tc)
        np.matmul(AtA, M.reshape(16, O * T), out=Y.reshape(4, O * T))
        for r in (0, 1):
            for c in (0, 1):  # output (2i + r, 2j + c) of tile (i, j); a dropped row or column past odd sizes
                ys = Y[2 * r + c].transpose(1, 0, 2, 3)[:, :, :len(range(r, h, 2)), :len(range(c, W, 2))]
                np.add(ys, b, out=dst[:, :, r::2, c::2], casting="unsafe")
        finish(dst, rs if has_res else None, relu)
    return out
