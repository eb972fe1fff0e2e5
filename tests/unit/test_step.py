"""nabla.step: a recorded step is data: it prints, compares equal to the same step recorded again, and pickles
(its op by key, local steps as bound module functions, no closures)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

import nabla as nb
from nabla import opdef
from nabla.trace import link_of

PROGRAM = '''
import numpy as np, nabla as nb
m = nb.DeviceMesh("m", (2, 4), ("dp", "tp"))
a = nb.tensor(np.ones((8, 16), np.float32)).shard(m, ["dp", None])
b = nb.tensor(np.ones((16, 8), np.float32)).shard(m, [None, "tp"])
x = nb.tensor(np.ones((2, 3, 30, 32), np.float32)).shard(m, [None, None, "dp", None])
odd = nb.tensor(np.ones((6, 10), np.float32)).shard(m, ["tp", None])
with nb.comm_log() as log:
    c = a @ b                                      # a pending sum's all_reduce later, a matmul kernel
    c.sum(0).with_sharding(nb.ShardingSpec(m, [nb.DimSpec([])]))  # a move with its plan
    c[:, 2:5]                                      # a window inside whole dims (a view)
    nb.flip(a, 0)                                  # a mirror permute
    nb.max_pool(x, (3, 3), (1, 1), 1)              # halo rows from the neighbours, padding filled
    odd.max(0)                                     # padding past a dim's end, set to max's neutral value
steps = list(log.steps)
'''


def _steps():
    space: dict = {}
    exec(PROGRAM, space)  # noqa: S102 - the program above, shared with the child process
    return space["steps"]


def _named(steps):
    """The steps with each value's serial replaced by its order of first appearance (serials are per run) and
    signature ids left out (per process)."""
    seen: dict[int, int] = {}

    def n(v):
        return seen.setdefault(v, len(seen) + 1) if v else v

    def sid(prog):  # the result's signature id: a key of this process's caches
        return prog._replace(result_sid=0) if hasattr(prog, "result_sid") else prog

    return [s._replace(uses=tuple(u._replace(value=n(u.value), kept=n(u.kept)) for u in s.uses), out=n(s.out),
                       alias=n(s.alias), saves=tuple(map(n, s.saves)), prog=sid(s.prog)) for s in steps]


def test_steps_compare_equal_when_recorded_again_and_after_a_pickle_round_trip():
    first, again = _steps(), _steps()
    assert len(first) >= 6 and _named(first) == _named(again)
    kinds = {e.kind for s in first for e in s.events}
    assert {"all_reduce", "collective_permute"} <= kinds  # (halo rows and the mirror are collective_permutes)
    for s in first:
        back = pickle.loads(pickle.dumps(s))
        assert back == s and back.op == s.op and repr(back) == repr(s)  # (an OpDef compares by identity)


def test_steps_pickled_in_another_process_load_here_equal_to_ours(tmp_path):
    path = tmp_path / "steps.pkl"
    code = PROGRAM + f"\nimport pickle\nopen({str(path)!r}, 'wb').write(pickle.dumps(steps))\n"
    subprocess.run([sys.executable, "-c", code], check=True)
    theirs = pickle.loads(path.read_bytes())
    ours = _steps()
    assert _named(theirs) == _named(ours)


def test_an_op_missing_from_the_loading_process_is_named():
    with pytest.raises(LookupError, match="no op 'not-an-op'"):
        opdef.by_key("not-an-op")
    made = opdef.OpDef("matmul", None, None)  # a second op of a name takes another key
    assert made.key.startswith("matmul#") and opdef.by_key(made.key) is made
    assert opdef.by_key("matmul") is nb.ops.registry.lookup("matmul")


def test_the_tape_holds_the_steps_the_log_took():
    """One record: a traced value is linked to the very step the comm log took for the op that made it (a
    ``with_sharding`` too); an untraced one to none. With no log open no step is built: the link holds the op and
    the program the executor chose (the one the logged step holds)."""
    m = nb.DeviceMesh("m", (2,), ("x",))
    w = nb.tensor(np.ones((4, 6))).shard(m, [None, "x"]).trace()
    x = nb.tensor(np.ones((2, 4)))
    with nb.comm_log() as log:
        y = x @ w
        z = y.with_sharding(m, [None, None])
        u = x * 2.0
    assert link_of(y).step is log.steps[-3] and link_of(y).op.name == "matmul" and link_of(y).args[0] is x
    assert link_of(z).step is log.steps[-2] and link_of(z).prog is log.steps[-2].prog
    assert link_of(u) is None and log.steps[-1].name == "multiply"
    assert link_of(x * 2.0) is None
    unlogged = link_of(x @ w)
    assert unlogged.step is None and unlogged.op.name == "matmul" and unlogged.prog is log.steps[-3].prog
