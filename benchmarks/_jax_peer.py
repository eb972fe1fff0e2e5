"""JAX peer: run with XLA_FLAGS=--xla_force_host_platform_device_count=N; prints JSON timings (us)."""

import json
import sys

import numpy as np

from _timing import measure


def main(devices: int, quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def measure_jax(fn, quick_):
        # block on every call: nabla is synchronous, and queued async collectives on 2 cores can starve
        # XLA's CPU rendezvous (it aborts after 40 s)
        return measure(lambda: jax.block_until_ready(fn()), quick_)

    out = {}
    rng = np.random.default_rng(0)
    if devices == 8:
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))

        def put(x, *spec):
            return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(*spec)))

        a = put(rng.standard_normal((64, 64), dtype=np.float32), "dp", None)
        b = put(rng.standard_normal((64, 64), dtype=np.float32), None, "tp")
        out["a_add"] = measure_jax(lambda: a + b, quick)
        out["a_matmul"] = measure_jax(lambda: a @ b, quick)
        if not quick:
            big_a = put(rng.standard_normal((2048, 2048), dtype=np.float32), "dp", None)
            big_b = put(rng.standard_normal((2048, 2048), dtype=np.float32), None, "tp")
            out["b_matmul"] = measure_jax(lambda: big_a @ big_b, quick)
        x = put(rng.standard_normal((1024, 1024), dtype=np.float32), ("dp", "tp"), None)
        target = NamedSharding(mesh, P(None, ("dp", "tp")))
        out["c_reshard"] = measure_jax(lambda: jax.device_put(x, target), quick)
        k1 = put(rng.standard_normal((256, 1024), dtype=np.float32), None, "tp")
        k2 = put(rng.standard_normal((1024, 256), dtype=np.float32), "tp", None)
        rep = NamedSharding(mesh, P(None, None))
        out["d_contract"] = measure_jax(lambda: jax.device_put(k1 @ k2, rep), quick)
        xm = put(rng.standard_normal((64, 256), dtype=np.float32), "dp", None)
        w1 = put(rng.standard_normal((256, 1024), dtype=np.float32), None, "tp")
        w2 = put(rng.standard_normal((1024, 256), dtype=np.float32), "tp", None)
        out["f_mlp"] = measure_jax(lambda: jax.nn.relu(xm @ w1) @ w2, quick)
    mesh1 = Mesh(np.array(jax.devices()[:devices]), ("x",))
    s = NamedSharding(mesh1, P("x", None))
    e1 = jax.device_put(jnp.asarray(rng.standard_normal((1024, 1024), dtype=np.float32)), s)
    e2 = jax.device_put(jnp.asarray(rng.standard_normal((1024, 1024), dtype=np.float32)), s)
    out[f"e_add_{devices}"] = measure_jax(lambda: e1 + e2, quick)
    return {k: v * 1e6 for k, v in out.items()}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2] == "quick")))
