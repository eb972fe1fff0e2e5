"""Factor kinds are objects: each says how it propagates and what the executor does with it. A new kind is
one class; this file adds a toy one (a cyclic shift by whole blocks) without touching nabla."""

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

import nabla as nb
from nabla import DeviceMesh
from nabla.collectives import CommEvent
from nabla.executor import OpDef
from nabla.factors import PASS, PERMUTE, REDUCE, REPLICATE, FactorKind, LocalStep, neutral
from nabla.layout import chunks, grid
from nabla.ops import apply
from nabla.rules.core import build
from nabla.testing import assert_comm, assert_sharded_allclose


def test_builtin_kinds_say_how_they_propagate():
    assert PASS.shardable and not PASS.contracting
    assert REDUCE.contracting and REDUCE.shardable
    assert not REPLICATE.shardable
    m = DeviceMesh("m", (4,), ("x",))
    x = m.axis_ref("x")
    assert PERMUTE.limit(8, (x,)) == (x,) and PERMUTE.limit(5, (x,)) == ()  # even shards only
    assert PERMUTE.limit(6, (x,)) == (m.axis_ref("x:(1)2"),)  # where only part of an axis fits, its major part
    assert PASS.limit(6, (x,)) == (x,)  # the ceil rule takes uneven shards
    assert {str(k) for k in (PASS, REDUCE, REPLICATE, PERMUTE)} == {"pass", "reduce", "replicate", "permute"}


def test_neutral_values_make_padding_invisible():
    assert neutral("sum", np.dtype("int8")) == 0
    assert neutral("max", np.dtype("float32")) == -np.inf and neutral("min", np.dtype("int16")) == 32767
    assert neutral("max", np.dtype("bool")) is False and neutral("min", np.dtype("uint8")) == 255


@dataclass(frozen=True)
class Roll(FactorKind):
    """Toy kind: the result's block p is the operand's block p-1 (np.roll by one block), so the factor keeps
    its sharding and every device sends its block one step along the dim's axes."""

    name: ClassVar[str] = "roll"

    def limit(self, size, axes):
        return PERMUTE.limit(size, axes)  # whole blocks only move between even shards

    def prepare(self, ctx, dims):
        g = grid(ctx.spec, ctx.cuts)
        (d,) = dims
        atoms = g.dims[d]
        if not atoms:
            return None
        block = int(np.prod(chunks(ctx.spec, ctx.shape))) * ctx.dtype.itemsize
        event = CommEvent("collective_permute", ctx.spec.dim_specs[d].axes, block, 2)

        def shift(x):
            lead = np.moveaxis(x, list(atoms), list(range(len(atoms))))
            flat = lead.reshape((-1,) + lead.shape[len(atoms):])
            rolled = np.roll(flat, 1, axis=0).reshape(lead.shape)
            return np.moveaxis(rolled, list(range(len(atoms))), list(atoms))

        return LocalStep(shift, (event,))


ROLL = OpDef("roll_block", lambda shapes: build([[(0,)]], [(0,)], [shapes[0][0]], [Roll()]),
             lambda arrays, local: arrays[0], linear="add", dtype="same")


def test_a_new_kind_is_one_class():
    m = DeviceMesh("m", (4,), ("x",))
    v = np.arange(8.0)
    t = nb.tensor(v).shard(m, ["x"])
    with nb.comm_log() as log:
        out = apply(ROLL, (t,))
    assert out.sharding.dim_specs[0].axes == ("x",)  # kept its sharding: nothing was gathered
    assert_comm(log, collective_permute=1)
    assert log.events[0].bytes == 16  # one block of two float64
    assert_sharded_allclose(out, np.roll(v, 2), rtol=0, atol=0)
    # uneven shards cannot roll by blocks: the kind's limit keeps what divides and the rest is gathered first
    u = apply(ROLL, (nb.tensor(np.arange(6.0)).shard(m, ["x"]),))
    assert u.sharding.dim_specs[0].axes == ("x:(1)2",) and np.array_equal(u.numpy(), np.roll(np.arange(6.0), 3))
