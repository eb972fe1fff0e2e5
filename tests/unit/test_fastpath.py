"""nabla.fastpath: a program's fast path compiled once to straight-line numpy calls. What it computes is numpy's
(values, dtype, read-only blocks); it prints as the code it runs and pickles as what it was compiled from."""

from __future__ import annotations

import pickle
import warnings

import numpy as np

import nabla as nb
from nabla import DeviceMesh, executor, fastpath, program, signatures
from nabla.fastpath import Kernel
from nabla.ops.registry import lookup
from nabla.testing import assert_matches_numpy

MESH = DeviceMesh("fast24", (2, 4), ("dp", "tp"))


def _program(op, *args):
    return program.program_for(op, tuple(signatures.sid_of(a) for a in args), (), executor.current_strategy(),
                               executor.current_cost_model())


def test_the_mixed_add_kernel_is_numpys_add_on_a_void_pack():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
    a[3, 5], b[60, 2] = np.nan, -np.inf
    A, B = nb.tensor(a).shard(MESH, ["dp", None]), nb.tensor(b).shard(MESH, [None, "tp"])
    kernel = _program(nb.add.op, A, B).kernel
    code = repr(kernel)
    assert "p.transpose((3, 0, 2, 1)).copy().view(D0)" in code and "out=h0" in code  # one view, one copy, in place
    out = kernel.call([A._data, B._data])
    assert not out.flags.writeable and out.shape == (2, 4, 32, 16)
    assert_matches_numpy(A + B, a + b)
    np.testing.assert_array_equal(out[1, 2], (a + b)[32:, 32:48])  # device (1, 2)'s block, from the call itself


def test_a_kernel_pickles_and_compares_as_what_it_was_compiled_from():
    A = nb.tensor(np.arange(64, dtype=np.int8).reshape(8, 8)).shard(MESH, ["dp", None])
    B = nb.tensor(np.ones((8, 8), np.int8)).shard(MESH, [None, "tp"])
    for prog in (_program(nb.add.op, A, B), _program(nb.relu.op, A)):
        back = pickle.loads(pickle.dumps(prog.kernel))
        assert back == prog.kernel and hash(back) == hash(prog.kernel) and repr(back) == repr(prog.kernel)
        assert back.call([A._data, B._data][:len(prog.preps)]).tobytes() == \
            prog.kernel.call([A._data, B._data][:len(prog.preps)]).tobytes()  # (compiled again where it was loaded)
    assert _program(nb.add.op, A, B).kernel != _program(nb.subtract.op, A, B).kernel


def test_kernels_on_scalars_and_casts_are_numpys():
    """A Python scalar operand as it is (NEP 50: int8 stays int8 and wraps around); a comparison's bool; an
    operand read through a lazy transpose. (A product of a kept pending sum, whose kernel runs without numpy's
    warnings: test_executor's ``test_summands_that_overflow_where_their_sum_does_not_warn_nothing``.)"""
    a = np.array([[100, -128, 127, 5]] * 4, np.int8)
    A = nb.tensor(a).shard(MESH, ["dp", "tp"])
    assert_matches_numpy(A + 100, a + np.int8(100))
    assert_matches_numpy(3 - A, np.int8(3) - a)
    assert_matches_numpy(A < 6, a < 6)
    assert_matches_numpy(nb.maximum(A, A.T), np.maximum(a, a.T))
    assert _program(nb.add.op, A, 100) is _program(nb.add.op, A, 7)  # (one kernel: the scalar is read per call)


def test_programs_of_one_pattern_share_their_compiled_code():
    """Each program has its own kernel, but programs whose kernels read the same (an exp of blocks as stored, on
    any shape or layout) compile their code once."""
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    first = nb.exp(nb.tensor(x.reshape(8, 8)).shard(MESH, ["dp", "tp"]))
    before = fastpath._compiled.cache_info()
    again = nb.exp(nb.tensor(x.reshape(4, 16)).shard(MESH, [None, "tp"]))
    after = fastpath._compiled.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    assert_matches_numpy(first, np.exp(x.reshape(8, 8)))
    assert_matches_numpy(again, np.exp(x.reshape(4, 16)))


def test_a_kernel_is_made_only_where_the_fast_path_runs():
    A = nb.tensor(np.ones((8, 8), np.float32)).shard(MESH, ["dp", None])
    assert isinstance(_program(nb.exp.op, A).kernel, Kernel)
    assert _program(lookup("matmul"), A, A.T).kernel is None  # (no numpy function is the kernel: no fast path)


def test_numpys_warnings_from_a_kernel_are_nablas_and_warned_once():
    """What numpy warns in a kernel (0/0 here, as numpy warns it) comes from nabla: a filter on nabla's modules
    catches it, and Python's "default" action shows it once, not once per compiled kernel (a review's find: code
    made by ``exec`` warned as module ``<string>``)."""
    A = nb.tensor(np.zeros((8, 8), np.float32)).shard(MESH, ["dp", None])
    B = nb.tensor(np.zeros((8, 8), np.float32)).shard(MESH, ["dp", "tp"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="nabla")
        for _ in range(2):  # (the second call takes the hot path)
            assert_matches_numpy(A / A, np.full((8, 8), np.nan, np.float32))
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        fastpath.__warningregistry__.clear()
        for _ in range(3):
            A / A, B / B  # (two kernels, one message)
    assert [str(w.message) for w in seen] == ["invalid value encountered in divide"]
