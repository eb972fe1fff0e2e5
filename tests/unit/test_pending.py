"""nabla.pending: the pending-sum policy answers once per program (``survival``); values through it equal numpy."""

from __future__ import annotations

import numpy as np

import nabla as nb
from nabla import DeviceMesh, ShardingSpec
from nabla.ops.registry import lookup
from nabla.pending import survival
from nabla.signatures import signature

M = DeviceMesh("m", (2, 2), ("x", "y"))


def _sigs(*xs):
    return tuple(signature(x) for x in xs)


def test_one_answer_per_program_keeps_adds_once_and_masks_as_the_op_needs():
    v = np.arange(8.0, dtype=np.float32).reshape(2, 4)
    p = nb.tensor(v).shard(ShardingSpec(M, [[], []], partial_axes=["y"]))  # a pending sum over y
    q = nb.tensor(v + 1)  # a host value
    sub = survival(lookup("subtract"), _sigs(p, q), (v.shape, v.shape), np.dtype(np.float32))
    assert sub.keep == {"y"} and sub.keep_by == ({"y"}, set())
    assert sub.add_once == ((), ("y",)) and sub.zeros == (None, 0)  # q is added once; negated, its mask is +0.0
    assert sub.checks[-1][1] == "keeps"  # floats: a non-finite result is redone with the sum made first
    strict = survival(lookup("subtract"), _sigs(p, q), (v.shape, v.shape), np.dtype(np.float32), strict=True)
    assert strict.keep == frozenset() and strict.add_once == ((), ()) and strict.checks == ()
    with nb.comm_log() as log:
        r = p - q
    assert log.events == [] and r.sharding.partial_axes == ("y",)  # no communication: the sum stays pending
    np.testing.assert_array_equal(r.numpy(), v - (v + 1))  # (placing a partial value puts it on y=0, zeros elsewhere)
