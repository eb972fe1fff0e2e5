"""nb.jit against JAX: one DP x TP MLP training step (forward, backward, SGD update) on 8 forced CPU devices.

    python benchmarks/jit_training.py [--quick] [--json PATH]

Both sides run one compiled XLA program per step on the same 8 devices with the same shardings
(x, y [dp,-], w1 [-,tp], w2 [tp,-] on a 2x4 mesh, batch 256, 512 -> 2048 -> 512, float32, SGD):
nabla's is nabla's trace lowered through shard_map (nb.jit), JAX's is the same step written in jax.numpy
under jax.jit with NamedSharding in/out shardings (XLA's SPMD partitioner chooses its collectives). Timed:
calling the compiled step on arguments already on the devices and reading the loss on the host, the
same number of samples of each side taken alternately (``_timing.alternating``): medians with quartiles. Also reported: bytes per device each
program's HLO sends. ``run.py`` runs this in a child process and folds it into ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests" / "integration"))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import nabla as nb  # noqa: E402
import xla_harness as H  # noqa: E402
from _timing import alternating, paired  # noqa: E402

BATCH, DIN, HIDDEN, DOUT = 256, 512, 2048, 512
LR = 0.01


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    r = np.random.default_rng(0)
    w1 = (r.standard_normal((DIN, HIDDEN)) * 0.02).astype(np.float32)
    w2 = (r.standard_normal((HIDDEN, DOUT)) * 0.02).astype(np.float32)
    x = r.standard_normal((BATCH, DIN)).astype(np.float32)
    y = r.standard_normal((BATCH, DOUT)).astype(np.float32)

    # nabla: the step as eager code, compiled
    mesh = nb.DeviceMesh("cluster", (2, 4), ("dp", "tp"))
    params = {"w1": nb.tensor(w1).shard(mesh, [None, "tp"]), "w2": nb.tensor(w2).shard(mesh, ["tp", None])}
    xb, yb = nb.tensor(x).shard(mesh, ["dp", None]), nb.tensor(y).shard(mesh, ["dp", None])
    opt = nb.optim.SGD(LR)
    state = opt.init(params)

    def loss(p, x, y):
        return ((nb.relu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    def step(p, s, x, y):
        v, g = nb.value_and_grad(loss)(p, x, y)
        p, s = opt.update(g, s, p)
        return v, p

    jstep = nb.jit(step)
    lowered = jstep.lower(params, state, xb, yb)
    compiled, arrays = lowered.compiled((params, state, xb, yb))
    nabla_hlo = H.collectives(compiled.as_text())

    # JAX: the same step in jax.numpy with the same shardings
    jmesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    shard = {"w1": NamedSharding(jmesh, P(None, "tp")), "w2": NamedSharding(jmesh, P("tp", None))}
    xs, ys = NamedSharding(jmesh, P("dp", None)), NamedSharding(jmesh, P("dp", None))

    def jloss(p, x, y):
        return ((jax.nn.relu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    def jstep_fn(p, x, y):
        v, g = jax.value_and_grad(jloss)(p, x, y)
        return v, {k: p[k] - LR * g[k] for k in p}

    jp = {k: jax.device_put(v, shard[k]) for k, v in (("w1", w1), ("w2", w2))}
    jx, jy = jax.device_put(x, xs), jax.device_put(y, ys)
    jcompiled = jax.jit(jstep_fn, in_shardings=(shard, xs, ys),
                        out_shardings=(NamedSharding(jmesh, P()), shard)).lower(jp, jx, jy).compile()
    jax_hlo = H.collectives(jcompiled.as_text())

    # same values
    v_nb, p_nb = lowered(params, state, xb, yb)
    v_jax, p_jax = jcompiled(jp, jx, jy)
    np.testing.assert_allclose(float(v_nb), float(v_jax), rtol=1e-4)
    np.testing.assert_allclose(p_nb["w1"].numpy(), np.asarray(p_jax["w1"]), rtol=1e-4, atol=1e-5)

    def host_loss(out):
        """Each call waited for (queued asynchronous collectives on 2 cores can starve XLA's CPU rendezvous),
        then device 0's copy of the loss read on the host: the same work after the step on both sides."""
        return float(np.asarray(jax.block_until_ready(out)[0].addressable_data(0)).reshape(-1)[0])

    t = alternating({"nabla": lambda: host_loss(compiled(*arrays)), "jax": lambda: host_loss(jcompiled(jp, jx, jy))},
                    repeats=7 if args.quick else 31)
    res = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "numpy": np.__version__,
           "shape": [BATCH, DIN, HIDDEN, DOUT], "devices": 8, "optimizer": f"SGD({LR})",
           "nabla_jit_ms": t["nabla"].median * 1e3, "jax_jit_ms": t["jax"].median * 1e3,
           "ratio": t["nabla"].median / t["jax"].median,
           "spread_ms": {k: [v.q1 * 1e3, v.q3 * 1e3] for k, v in t.items()}, "repeats": t["nabla"].repeats,
           "ratio_spread": paired(t["nabla"], t["jax"]),
           "nabla_bytes": sum(c.bytes for c in nabla_hlo), "xla_bytes": sum(c.bytes for c in jax_hlo),
           "nabla_collectives": [f"{c.kind}:{c.bytes}" for c in nabla_hlo],
           "xla_collectives": [f"{c.kind}:{c.bytes}" for c in jax_hlo]}
    print(f"DP x TP MLP training step {BATCH}x{DIN}x{HIDDEN}x{DOUT} float32, 8 CPU devices, compiled on both sides")
    print(f"| | time per step | bytes per device (HLO) | collectives |")
    print(f"|---|---|---|---|")
    print(f"| nb.jit | {res['nabla_jit_ms']:.2f} ms | {res['nabla_bytes']:,} | {', '.join(res['nabla_collectives'])} |")
    print(f"| jax.jit + NamedSharding | {res['jax_jit_ms']:.2f} ms | {res['xla_bytes']:,} | "
          f"{', '.join(res['xla_collectives'])} |")
    print(f"nb.jit / jax.jit: {res['ratio']:.2f}x (target <= 1.1x); bytes {res['nabla_bytes']} vs {res['xla_bytes']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
