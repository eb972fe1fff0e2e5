"""A data- and tensor-parallel MLP block (Megatron style) on a 2x4 mesh, checked against numpy.

x is split over dp (rows), w1 over tp (columns), w2 over tp (rows): the hidden activations never
leave their device, and the only collective is the sum of w2's partial products over tp.
"""

import numpy as np

import nabla as nb
from nabla import DeviceMesh

mesh = DeviceMesh("cluster", (2, 4), ("dp", "tp"))
rng = np.random.default_rng(0)
x, w1, b1, w2 = (rng.standard_normal(s).astype(np.float32) for s in [(16, 32), (32, 128), (128,), (128, 32)])

X = nb.tensor(x).shard(mesh, ["dp", None])
W1 = nb.tensor(w1).shard(mesh, [None, "tp"])
B1 = nb.tensor(b1).shard(mesh, ["tp"])
W2 = nb.tensor(w2).shard(mesh, ["tp", None])

with nb.comm_log() as log:
    h = nb.relu(X @ W1 + B1)  # [dp|tp]: local
    y = h @ W2  # partial over tp: each device holds its share of the sum
    out = y.with_sharding(mesh, ["dp", None])  # one all_reduce over tp

print("h:", h.sharding, " y:", y.sharding, " out:", out.sharding)
print(log.summary())
np.testing.assert_allclose(out.numpy(), np.maximum(x @ w1 + b1, 0) @ w2, rtol=1e-4, atol=1e-4)
assert log.counts == {"all_reduce": 1}
print("equal to numpy; device 5 holds rows", out.sharding.shard_slices(out.shape, 5)[0])
