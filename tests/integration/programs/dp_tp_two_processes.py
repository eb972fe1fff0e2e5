"""One process of a 2-process run (2 x 4 CPU devices, gloo): a DP x TP MLP training step under nb.jit,
the batch loaded per process, checked against the same step computed in one process on numpy.
Run by tests/integration/test_distributed.py as ``python dp_tp_two_processes.py <process id> <port>``."""

import sys
pid, port = int(sys.argv[1]), sys.argv[2]
import nabla as nb
nb.distributed.initialize(f"localhost:{port}", 2, pid, local_device_count=4)
import numpy as np
from nabla import DeviceMesh, optim
mesh = DeviceMesh("cluster", (2, 4), ("dp", "tp"))
r = np.random.default_rng(0)
w1, w2 = r.standard_normal((16, 32)).astype(np.float32), r.standard_normal((32, 4)).astype(np.float32)
x, y = r.standard_normal((8, 16)).astype(np.float32), r.standard_normal((8, 4)).astype(np.float32)
params = {"w1": nb.tensor(w1).shard(mesh, [None, "tp"]), "w2": nb.tensor(w2).shard(mesh, ["tp", None])}
rows = slice(4 * pid, 4 * pid + 4)  # this process loads only its half of the batch
xb = nb.from_process_local(x[rows], mesh, ["dp", None], (8, 16))
yb = nb.from_process_local(y[rows], mesh, ["dp", None], (8, 4))
def loss(p, x, y):
    return ((nb.relu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()
opt = optim.SGD(0.1)
state = opt.init(params)
def step(p, s, x, y):
    v, g = nb.value_and_grad(loss)(p, x, y)
    p, s = opt.update(g, s, p)
    return v, p
value, new = nb.jit(step)(params, state, xb, yb)
# the same step in one process, on numpy values (nabla eager), and by hand in numpy
rv, rp = step(params, state, nb.tensor(x).shard(mesh, ["dp", None]), nb.tensor(y).shard(mesh, ["dp", None]))
h = x @ w1
a = np.maximum(h, 0)
r = a @ w2 - y
dout = 2 * r / r.size
dh = (dout @ w2.T) * (h > 0)
ref = {"loss": float((r ** 2).mean()), "w1": w1 - 0.1 * (x.T @ dh), "w2": w2 - 0.1 * (a.T @ dout)}
loss = float(nb.distributed.gather(value))
print(pid, "loss", repr(loss))
np.testing.assert_allclose(loss, float(rv), rtol=1e-6)
np.testing.assert_allclose(loss, ref["loss"], rtol=1e-5)
for k in ("w1", "w2"):
    assert new[k].sharding == rp[k].sharding, (k, new[k].sharding, rp[k].sharding)
    np.testing.assert_allclose(nb.distributed.gather(new[k]), rp[k].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nb.distributed.gather(new[k]), ref[k], rtol=1e-4, atol=1e-5)
    for d, blk in nb.distributed.local_blocks(new[k]).items():
        np.testing.assert_allclose(blk, rp[k].shards[d], rtol=1e-5, atol=1e-6)
print(pid, "ok", sorted(nb.distributed.local_blocks(new["w1"])))
