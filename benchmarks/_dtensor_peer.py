"""PyTorch DTensor peer of run.py: ``python _dtensor_peer.py N [--quick] --json PATH``.

DTensor runs under ``LocalTensorMode`` on a fake process group of N ranks: one process holds every
rank's local tensor and runs each op once per rank (the closest analogue of nabla's simulation).
Every case ends where nabla's does: a Partial result is redistributed to nabla's (reduced) layout.
With N = 8 it also times the training step (DTensor, and plain torch tensors unsharded). Times in us
(training: ms)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from _timing import alternating, measure

TRAIN = dict(batch=256, din=512, hidden=2048, dout=512, lr=0.01)  # as run.py
TRAIN_REPEATS = {False: 21, True: 5}  # as run.py


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def main(devices: int, quick: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def T(*shape, seed=0):
        return torch.from_numpy(rnd(*shape, seed=seed))

    threads = int(os.environ.get("NABLA_BENCH_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    dist.init_process_group("fake", rank=0, world_size=devices, store=FakeStore())
    eager: dict[str, float] = {}
    out = {"devices": devices, "eager": eager, "torch_threads": torch.get_num_threads()}

    def timed(fn):
        return measure(fn, quick) * 1e6

    with LocalTensorMode(frozenset(range(devices))):
        if devices == 8:
            mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
            R, S0, S1 = Replicate(), Shard(0), Shard(1)
            a = distribute_tensor(T(64, 64), mesh, [S0, R])
            b = distribute_tensor(T(64, 64, seed=1), mesh, [R, S1])
            eager["add_64"] = timed(lambda: a + b)
            eager["matmul_64"] = timed(lambda: a @ b)
            a = distribute_tensor(T(2048, 2048), mesh, [S0, R])
            b = distribute_tensor(T(2048, 2048, seed=1), mesh, [R, S1])
            eager["matmul_2048"] = timed(lambda: a @ b)
            del a, b
            x = distribute_tensor(T(1024, 1024), mesh, [S0, S0])  # dim 0 over (dp, tp)
            eager["reshard_materialised"] = timed(lambda: x.redistribute(mesh, [S1, S1]))
            k1 = distribute_tensor(T(256, 1024), mesh, [R, S1])
            k2 = distribute_tensor(T(1024, 256, seed=1), mesh, [R, S0])
            eager["contract"] = timed(lambda: (k1 @ k2).redistribute(mesh, [R, R]))  # k1 @ k2 is Partial
            xm = distribute_tensor(T(64, 256), mesh, [S0, R])
            w1 = distribute_tensor(T(256, 1024, seed=1), mesh, [R, S1])
            w2 = distribute_tensor(T(1024, 256, seed=2), mesh, [R, S0])
            eager["mlp"] = timed(lambda: (torch.relu(xm @ w1) @ w2).redistribute(mesh, [S0, R]))
            line = init_device_mesh("cpu", (8,), mesh_dim_names=("x",))
            u1 = distribute_tensor(T(1021, 1024), line, [S0])  # uneven: torch.chunk's blocks
            u2 = distribute_tensor(T(1021, 1024, seed=1), line, [S0])
            eager["add_uneven"] = timed(lambda: u1 + u2)
            eager["sum_uneven_partial"] = timed(lambda: u1.sum(0))  # Partial, as nabla's
            eager["sum_uneven"] = timed(lambda: u1.sum(0).redistribute(line, [R]))
            out["train_dtensor"] = training(torch, mesh, distribute_tensor, R, S0, S1, quick)
        line = init_device_mesh("cpu", (devices,), mesh_dim_names=("x",))
        e1 = distribute_tensor(T(1024, 1024), line, [Shard(0)])
        e2 = distribute_tensor(T(1024, 1024, seed=1), line, [Shard(0)])
        eager[f"add_1024_{devices}"] = timed(lambda: e1 + e2)
    if devices == 8:
        out["train_torch"] = training(torch, None, None, None, None, None, quick)
    dist.destroy_process_group()
    return out


def training(torch, mesh, distribute, R, S0, S1, quick: bool) -> dict:
    """run.py's DP x TP MLP step in torch (ms): forward (loss), forward+backward (gradients reduced to the
    parameters' layout, as nabla's are), step (+ SGD). mesh None: plain tensors, unsharded."""
    r = np.random.default_rng(0)  # the same draws as run.train_data
    B, I, H, O, lr = TRAIN["batch"], TRAIN["din"], TRAIN["hidden"], TRAIN["dout"], TRAIN["lr"]
    w1 = torch.from_numpy((r.standard_normal((I, H)) * 0.02).astype(np.float32))
    w2 = torch.from_numpy((r.standard_normal((H, O)) * 0.02).astype(np.float32))
    x = torch.from_numpy(r.standard_normal((B, I)).astype(np.float32))
    y = torch.from_numpy(r.standard_normal((B, O)).astype(np.float32))
    if mesh is not None:
        w1, w2 = distribute(w1, mesh, [R, S1]), distribute(w2, mesh, [R, S0])
        x, y = distribute(x, mesh, [S0, R]), distribute(y, mesh, [S0, R])
    params = [w1.requires_grad_(), w2.requires_grad_()]

    def loss():
        v = ((torch.relu(x @ params[0]) @ params[1] - y) ** 2).mean()
        return v

    def replicated(v):  # DTensor leaves the mean Partial(avg): reduce it, as every other side does
        return v.redistribute(mesh, [R, R]) if mesh is not None else v

    def fwd():
        with torch.no_grad():
            return replicated(loss())

    def grads():
        for p in params:
            p.grad = None
        v = loss()
        v.backward()
        gs = [p.grad if mesh is None else p.grad.redistribute(mesh, p.placements) for p in params]  # dp sums
        return replicated(v.detach()), gs

    def step():
        v, gs = grads()
        with torch.no_grad():
            for p, g in zip(params, gs):
                p.sub_(lr * g)
        return v

    t = alternating({"forward": fwd, "forward_backward": grads, "step": step}, TRAIN_REPEATS[quick])
    return {k: v.median * 1e3 for k, v in t.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("devices", type=int)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    a.json.write_text(json.dumps(main(a.devices, a.quick)))
