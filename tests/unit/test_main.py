"""``python -m nabla``: the tour explains what it shows (open dims, both notations, est. us) and is correct."""

import numpy as np

import nabla as nb
from nabla.__main__ import main
from nabla.debug import short


def test_tour_explains_its_notation_and_numbers(capsys):
    main()
    out = capsys.readouterr().out
    assert "all values equal numpy: True" in out
    assert 'sharding: [{"dp"}, {"tp"}]' in out and "Shardy's notation" in out
    assert "x[dp|tp]" in out and "a[dp|-] is a[{\"dp\"}, {}]" in out
    assert "'?' marks an open dim" in out and 'y.sharding = [{"dp", ?}, {"tp", ?}]' in out
    assert "est. us: the cost model's estimate (nb.CostModel" in out and "5 us per ring step" in out
    assert "all_reduce" in out and "all_to_all" in out and "nb.explain" in out


def test_tour_claims_hold():
    # the short form the tour describes is what nb.debug.short prints
    mesh = nb.DeviceMesh("cluster", (2, 4), ("dp", "tp"))
    assert short(nb.ones((2, 2)).shard(mesh, ["dp", None]).sharding) == "[dp|-]"
    # "5 us per ring step + bytes at 25 GB/s": the default cost model, and the tour's 30.0 us all_reduce
    model = nb.CostModel()
    assert (model.default.latency, model.default.bandwidth) == (5e-6, 25e9)
    a = nb.random.normal((8, 16), seed=0).shard(mesh, ["dp", "tp"])
    w = nb.random.normal((16, 12), seed=1).shard(mesh, ["tp", None])
    with nb.comm_log() as log:
        nb.tanh(a @ w)
    (e,) = log.events
    assert np.isclose(e.seconds, 6 * 5e-6 + e.bytes / 25e9)  # 2(k-1) = 6 ring steps over tp of 4
