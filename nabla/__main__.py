"""``python -m nabla``: a short tour of a mesh, a sharded tensor, its blocks, an op and a reshard."""

from __future__ import annotations

import numpy as np

import nabla as nb
from nabla import DeviceMesh, DimSpec


def main() -> None:
    mesh = DeviceMesh("cluster", (2, 4), ("dp", "tp"))
    print("A 2x4 mesh of 8 simulated devices:")
    print("  ", mesh)
    x = nb.arange(40, dtype="float32").reshape(5, 8)
    xs = x.shard(mesh, [DimSpec(["dp"]), DimSpec(["tp"])])
    print("\nA 5x8 tensor sharded rows over dp, columns over tp (5 rows over 2: blocks of 3 and 2):")
    print("   sharding:", xs.sharding, "   as an XLA HLO sharding string:", xs.sharding.to_mhlo())
    print("   (Shardy's notation, as repr(spec) prints it: one {...} per dim listing the mesh axes that split it,\n"
          "   major to minor; {} = replicated. nabla's docs write the same short: x[dp|tp], '|' between dims,\n"
          "   '-' for a replicated dim: a[dp|-] is a[{\"dp\"}, {}]. nb.debug.short(spec) prints it.)")
    nb.visualize_sharding(xs)
    print("device 5 holds rows 3:5, cols 2:4:")
    print(xs.shards[5])

    print("\nAn op: y = relu(a @ w) with a[dp|-], w[-|tp] runs with no communication:")
    a = nb.random.normal((8, 16), seed=0).shard(mesh, ["dp", None])
    w = nb.random.normal((16, 12), seed=1).shard(mesh, [None, "tp"])
    with nb.comm_log() as log:
        y = nb.relu(a @ w)
    print("   y.sharding =", y.sharding, "  collectives:", log.counts or "none")
    print("   '?' marks an open dim: an op's result is open, so a later op may still add axes to it; dims you\n"
          "   write are closed (stay as written) unless open: DimSpec([], is_open=True) or jax's P.UNCONSTRAINED.")

    print("\nA matmul whose contracted dim (K, the 16 shared by a and w) is split over tp on both operands gives\n"
          "partial sums; the sum is made when a non-linear op needs it. a[dp|tp] @ w[tp|-], then tanh:")
    a2 = a.with_sharding(mesh, ["dp", "tp"])  # rows over dp, the contracted dim over tp
    w2 = nb.random.normal((16, 12), seed=1).shard(mesh, ["tp", None])
    with nb.comm_log() as log:
        z = a2 @ w2
        print("   (a @ w).sharding =", z.sharding)
        r = nb.tanh(z)
    print("   tanh(...) sharding =", r.sharding)
    print(log.summary())
    print("   (the 8x12 result's blocks are 4x12 float32, 192 B; a ring all_reduce over 4 devices sends 2 x 3/4 of it)")
    print("   est. us: the cost model's estimate (nb.CostModel: per mesh axis, 5 us per ring step + bytes at 25 GB/s\n"
          "   by default; the planner picks the cheapest moves under it). nb.explain(fn, *args) tells op by op why.")

    print("\nA reshard (t.with_sharding, named in the log's 'during' column): moving dp from the rows to the\n"
          "columns, after tp, is one all_to_all:")
    with nb.comm_log() as log:
        moved = xs.with_sharding(mesh, [None, ("tp", "dp")])
    print("  ", xs.sharding, "->", moved.sharding)
    print(log.summary())
    ok = np.array_equal(moved.numpy(), x.numpy()) and np.allclose(r.numpy(), np.tanh(a.numpy() @ w2.numpy()),
                                                                    rtol=1e-5, atol=1e-5)
    print("\nall values equal numpy:", ok)


if __name__ == "__main__":
    main()
