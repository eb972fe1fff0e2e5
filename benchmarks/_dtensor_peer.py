"""PyTorch DTensor peer: LocalTensorMode on a fake process group of N ranks; prints JSON timings (us)."""

import json
import sys

import numpy as np

from _timing import measure


def main(devices: int, quick: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(2)
    dist.init_process_group("fake", rank=0, world_size=devices, store=FakeStore())
    out = {}
    g = torch.Generator().manual_seed(0)
    with LocalTensorMode(frozenset(range(devices))):
        if devices == 8:
            mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
            a = distribute_tensor(torch.randn(64, 64, generator=g), mesh, [Shard(0), Replicate()])
            b = distribute_tensor(torch.randn(64, 64, generator=g), mesh, [Replicate(), Shard(1)])
            out["a_add"] = measure(lambda: a + b, quick)
            out["a_matmul"] = measure(lambda: a @ b, quick)
            x = distribute_tensor(torch.randn(1024, 1024, generator=g), mesh, [Shard(0), Shard(0)])
            out["c_reshard"] = measure(lambda: x.redistribute(mesh, [Shard(1), Shard(1)]), quick)
            k1 = distribute_tensor(torch.randn(256, 1024, generator=g), mesh, [Replicate(), Shard(1)])
            k2 = distribute_tensor(torch.randn(1024, 256, generator=g), mesh, [Replicate(), Shard(0)])
            out["d_contract"] = measure(lambda: (k1 @ k2).redistribute(mesh, [Replicate(), Replicate()]), quick)
            xm = distribute_tensor(torch.randn(64, 256, generator=g), mesh, [Shard(0), Replicate()])
            w1 = distribute_tensor(torch.randn(256, 1024, generator=g), mesh, [Replicate(), Shard(1)])
            w2 = distribute_tensor(torch.randn(1024, 256, generator=g), mesh, [Replicate(), Shard(0)])
            out["f_mlp"] = measure(lambda: torch.relu(xm @ w1) @ w2, quick)
            del Partial
        mesh1 = init_device_mesh("cpu", (devices,), mesh_dim_names=("x",))
        e1 = distribute_tensor(torch.randn(1024, 1024, generator=g), mesh1, [Shard(0)])
        e2 = distribute_tensor(torch.randn(1024, 1024, generator=g), mesh1, [Shard(0)])
        out[f"e_add_{devices}"] = measure(lambda: e1 + e2, quick)
    dist.destroy_process_group()
    return {k: v * 1e6 for k, v in out.items()}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2] == "quick")))
