import nabla as nb
from nabla import DeviceMesh


def test_visualize_lists_blocks_and_devices(capsys):
    mesh = DeviceMesh("c", (2, 2), ("x", "y"))
    t = nb.ones((5, 4)).shard(mesh, ["x", None])
    text = nb.visualize_sharding(t)
    assert "[0:3, 0:4] dev 0,1" in text and "[3:5, 0:4] dev 2,3" in text
    assert text in capsys.readouterr().out


def test_visualize_partial_and_host():
    mesh = DeviceMesh("c", (2,), ("x",))
    p = nb.ones(4).shard(mesh, [None], partial_axes=["x"])
    assert "partial sums over ['x']" in nb.visualize_sharding(p, show=False)
    assert "unsharded" in nb.visualize_sharding(nb.ones(3), show=False)
