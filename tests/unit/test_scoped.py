"""nabla.scoped: a context variable set for a block, and the collector thresholds raised for a long search."""

from __future__ import annotations

import contextvars
import gc
import threading

import pytest

import nabla as nb
from nabla.scoped import few_collections, setting

FLAG: contextvars.ContextVar = contextvars.ContextVar("flag", default="outside")


def test_setting_restores_the_variable_even_when_the_block_raises():
    with setting(FLAG, "inside", result=3) as r:
        assert (FLAG.get(), r) == ("inside", 3)
    assert FLAG.get() == "outside"
    with pytest.raises(RuntimeError), setting(FLAG, "inside"):
        raise RuntimeError
    assert FLAG.get() == "outside"


def test_few_collections_raises_the_thresholds_and_the_last_block_out_restores_them():
    before = gc.get_threshold()
    with few_collections(young=123_456):
        raised = gc.get_threshold()
        assert raised[0] == max(123_456, before[0]) and all(t >= 20 for t in raised[1:])
        with few_collections():  # nested: the outer block's setting stays
            assert gc.get_threshold() == raised
        assert gc.get_threshold() == raised
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), few_collections():
        raise RuntimeError
    assert gc.get_threshold() == before


def test_few_collections_from_threads_that_overlap_restore_the_thresholds_once_all_have_left():
    before = gc.get_threshold()
    inside, leave = threading.Barrier(2), threading.Event()
    seen = []

    def search(first: bool) -> None:
        with few_collections():
            inside.wait()
            if first:
                leave.wait()  # the first thread to enter leaves last
            seen.append(gc.get_threshold())

    a = threading.Thread(target=search, args=(True,))
    b = threading.Thread(target=search, args=(False,))
    a.start(), b.start()
    b.join()
    assert gc.get_threshold() != before  # thread a is still searching
    leave.set()
    a.join()
    assert gc.get_threshold() == before and len(seen) == 2


def test_estimate_and_autoshard_leave_the_thresholds_as_they_found_them():
    before = gc.get_threshold()
    cluster = nb.Cluster(nb.Hardware.preset("h100-sxm-80gb"), nodes=1, devices_per_node=8)
    mesh = cluster.mesh("m", (2, 4), ("dp", "tp"))
    x = nb.abstract((64, 256), "float32").shard(mesh, [nb.DimSpec([], is_open=True)] * 2)
    w = nb.abstract((256, 256), "float32").shard(mesh, [nb.DimSpec([], is_open=True)] * 2)
    plan = nb.autoshard(lambda x, w: nb.tanh(x @ w).sum(), cluster, x, w)
    assert plan.step_time > 0 and gc.get_threshold() == before
    laid = x.shard(mesh, ["dp", None]), w.shard(mesh, [None, "tp"])
    rep = nb.estimate(lambda x, w: nb.tanh(x @ w).sum(), cluster)(*laid)
    assert rep.step_time > 0 and gc.get_threshold() == before
