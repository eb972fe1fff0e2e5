"""JAX peer of run.py: ``python _jax_peer.py N [--quick] --json PATH`` with
XLA_FLAGS=--xla_force_host_platform_device_count=N. Times in us (training: ms).

N = 1: every case on one device, plain arrays (pure dispatch: no sharding, no collectives).
N > 1: "eager" runs the case op by op on sharded arrays (each op its own cached XLA computation), "jit"
runs it under jax.jit with the same in and out shardings as nabla's. Cases and layouts are run.py's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from _timing import alternating, measure

TRAIN = dict(batch=256, din=512, hidden=2048, dout=512, lr=0.01)  # as run.py
TRAIN_REPEATS = {False: 21, True: 5}  # as run.py


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def main(devices: int, quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    assert len(jax.devices()) >= devices, f"{len(jax.devices())} devices, asked for {devices}"

    def timed(fn):
        # block on every call: nabla is synchronous, and queued async collectives on 2 cores can starve
        # XLA's CPU rendezvous (it aborts after 40 s)
        return measure(lambda: jax.block_until_ready(fn()), quick) * 1e6

    eager: dict[str, float] = {}
    jit: dict[str, float] = {}
    out = {"devices": devices, "eager": eager, "jit": jit}
    single = devices == 1
    if single:
        put = lambda x, *spec: jax.device_put(jnp.asarray(x), jax.devices()[0])  # noqa: E731
        mesh = None
    else:
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
        put = lambda x, *spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(*spec)))  # noqa: E731

    def at(*spec):  # the jitted output's layout (None on one device)
        return None if single else (mesh, *spec)

    def both(cid, fn, args, out_spec=None):
        """The case op by op, and (sharded only) under jax.jit with nabla's output layout."""
        eager[cid] = timed(lambda: fn(*args))
        if not single:
            kw = {} if out_spec is None else {"out_shardings": NamedSharding(out_spec[0], P(*out_spec[1:]))}
            jf = jax.jit(fn, **kw)
            jit[cid] = timed(lambda: jf(*args))

    if devices in (1, 8):
        a, b = put(rnd(64, 64), "dp", None), put(rnd(64, 64, seed=1), None, "tp")
        both("add_64", lambda a, b: a + b, (a, b), at("dp", "tp"))
        both("matmul_64", lambda a, b: a @ b, (a, b), at("dp", "tp"))
        a, b = put(rnd(2048, 2048), "dp", None), put(rnd(2048, 2048, seed=1), None, "tp")
        both("matmul_2048", lambda a, b: a @ b, (a, b), at("dp", "tp"))
        if not single:  # a reshard is a device-to-device transfer: nothing to do on one device
            x = put(rnd(1024, 1024), ("dp", "tp"), None)
            target = NamedSharding(mesh, P(None, ("dp", "tp")))
            eager["reshard_materialised"] = timed(lambda: jax.device_put(x, target))
            jf = jax.jit(lambda x: x, out_shardings=target)
            jit["reshard_materialised"] = timed(lambda: jf(x))
        k1, k2 = put(rnd(256, 1024), None, "tp"), put(rnd(1024, 256, seed=1), "tp", None)
        if single:
            eager["contract"] = timed(lambda: k1 @ k2)
        else:
            rep = NamedSharding(mesh, P(None, None))
            both("contract", lambda k1, k2: jax.device_put(k1 @ k2, rep), (k1, k2), at(None, None))
        xm = put(rnd(64, 256), "dp", None)
        w1, w2 = put(rnd(256, 1024, seed=1), None, "tp"), put(rnd(1024, 256, seed=2), "tp", None)
        if single:
            eager["mlp"] = timed(lambda: jax.nn.relu(xm @ w1) @ w2)
        else:
            dp_ = NamedSharding(mesh, P("dp", None))
            both("mlp", lambda xm, w1, w2: jax.device_put(jax.nn.relu(xm @ w1) @ w2, dp_), (xm, w1, w2), at("dp", None))
        out.update(training(jax, jnp, put, mesh, quick))
    if single:
        e1, e2 = put(rnd(1024, 1024)), put(rnd(1024, 1024, seed=1))
        eager["add_1024"] = timed(lambda: e1 + e2)
        for n in (8, 64, 256):
            eager[f"add_1024_{n}"] = eager["add_1024"]
        g1, g2 = put(rnd(1021, 1024)), put(rnd(1021, 1024, seed=1))
        eager["add_uneven"] = timed(lambda: g1 + g2)
        eager["sum_uneven"] = eager["sum_uneven_partial"] = timed(lambda: g1.sum(0))
    else:
        line = Mesh(np.array(jax.devices()[:devices]), ("x",))
        s = NamedSharding(line, P("x", None))
        e1 = jax.device_put(jnp.asarray(rnd(1024, 1024)), s)
        e2 = jax.device_put(jnp.asarray(rnd(1024, 1024, seed=1)), s)
        both(f"add_1024_{devices}", lambda a, b: a + b, (e1, e2), (line, "x", None))
    return out


def training(jax, jnp, put, mesh, quick: bool) -> dict:
    """The DP x TP MLP step of run.py: forward, forward+backward, step (+ SGD), eager and jitted (ms)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    r = np.random.default_rng(0)  # the same draws as run.train_data
    B, I, H, O, lr = TRAIN["batch"], TRAIN["din"], TRAIN["hidden"], TRAIN["dout"], TRAIN["lr"]
    w1 = (r.standard_normal((I, H)) * 0.02).astype(np.float32)
    w2 = (r.standard_normal((H, O)) * 0.02).astype(np.float32)
    x = r.standard_normal((B, I)).astype(np.float32)
    y = r.standard_normal((B, O)).astype(np.float32)
    p = {"w1": put(w1, None, "tp"), "w2": put(w2, "tp", None)}
    xb, yb = put(x, "dp", None), put(y, "dp", None)

    def loss(p, x, y):
        return ((jax.nn.relu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    vg = jax.value_and_grad(loss)

    def step(p, x, y):
        v, g = vg(p, x, y)
        return v, {k: p[k] - lr * g[k] for k in p}

    if mesh is None:
        jf, jvg, jstep = jax.jit(loss), jax.jit(vg), jax.jit(step)
    else:
        ps = {"w1": NamedSharding(mesh, P(None, "tp")), "w2": NamedSharding(mesh, P("tp", None))}
        ds, rep = NamedSharding(mesh, P("dp", None)), NamedSharding(mesh, P())
        ins = (ps, ds, ds)
        jf = jax.jit(loss, in_shardings=ins, out_shardings=rep)
        jvg = jax.jit(vg, in_shardings=ins, out_shardings=(rep, ps))
        jstep = jax.jit(step, in_shardings=ins, out_shardings=(rep, ps))
    fns = {"eager/forward": lambda: loss(p, xb, yb), "eager/forward_backward": lambda: vg(p, xb, yb),
           "eager/step": lambda: step(p, xb, yb), "jit/forward": lambda: jf(p, xb, yb),
           "jit/forward_backward": lambda: jvg(p, xb, yb), "jit/step": lambda: jstep(p, xb, yb)}
    def host_loss(out):  # each call waited for, then the loss read on the host (as nabla's side does)
        out = jax.block_until_ready(out)
        return float(out[0] if isinstance(out, tuple) else out)

    t = alternating({k: (lambda f=f: host_loss(f())) for k, f in fns.items()}, TRAIN_REPEATS[quick])
    return {f"train_{mode}": {part: t[f"{mode}/{part}"].median * 1e3 for part in ("forward", "forward_backward", "step")}
            for mode in ("eager", "jit")}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("devices", type=int)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    a.json.write_text(json.dumps(main(a.devices, a.quick)))
