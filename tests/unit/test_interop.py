import os
import subprocess
import sys
import textwrap

import pytest

import nabla as nb
from nabla import ShardingError

pytest.importorskip("jax")


def test_round_trip_through_jax_on_forced_host_devices():
    code = textwrap.dedent("""
        import numpy as np, nabla as nb
        from nabla import DeviceMesh
        mesh = DeviceMesh("m", (2, 4), ("dp", "tp"))
        x = np.arange(32, dtype=np.float32).reshape(4, 8)
        t = nb.tensor(x).shard(mesh, ["dp", "tp"])
        j = t.to_jax()
        assert tuple(j.sharding.spec) == ("dp", "tp"), j.sharding.spec
        assert {s.device.id: s.data.shape for s in j.addressable_shards}[5] == (2, 2)
        np.testing.assert_array_equal(np.asarray(j), x)
        back = nb.from_jax(j)
        assert back.sharding.dim_specs[0].axes == ("dp",) and back.sharding.dim_specs[1].axes == ("tp",)
        np.testing.assert_array_equal(back.shards[5], x[2:4, 2:4])
        try:
            nb.tensor(np.ones((5, 8), np.float32)).shard(mesh, ["dp", None]).to_jax()
            raise SystemExit("uneven dim did not raise")
        except nb.ShardingError as e:
            assert "dim 0 of size 5 is split over 2 shards" in str(e), e
        p = nb.tensor(x).shard(mesh, [None, "tp"]) @ nb.tensor(x.T).shard(mesh, ["tp", None])
        np.testing.assert_allclose(np.asarray(p.to_jax()), x @ x.T, rtol=1e-5)
        print("ok")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_unknown_backend():
    with nb.backend("numpy"):
        assert (nb.ones(2) + 1).numpy().tolist() == [2.0, 2.0]
    with pytest.raises(ShardingError, match="unknown backend 'tpu'"):
        with nb.backend("tpu"):
            pass
