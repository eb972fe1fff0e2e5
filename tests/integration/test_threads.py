"""No shared mutable state: threads mixing overflowing pending sums (which redo an op strictly), plain pending
sums, ordinary ops and random draws see none of each other's state; many distinct shapes leave the caches and
intern tables bounded."""

import gc
import threading
import tracemalloc

import numpy as np

import nabla as nb
from nabla import signatures
from nabla.testing import examples

MESH = nb.DeviceMesh("threads", (2,), ("x",))


def _overflowing():
    """Summands 3e38 and -3e38: their doubles overflow (inf - inf) where the doubled sum is 0, so the product
    is redone with the sum made first (numpy's value), and that all_reduce is logged."""
    p = nb.from_local({0: np.full((4,), 3e38, np.float32), 1: np.full((4,), -3e38, np.float32)}, MESH, [None],
                      partial_axes=["x"])
    with nb.comm_log() as log:
        y = p * 2.0
    assert np.array_equal(y.numpy(), np.zeros(4, np.float32)), y.numpy()
    assert log.counts == {"all_reduce": 1}, log.events


def _plain():
    """Finite summands: the product keeps the sum pending (no communication), whatever other threads redo."""
    q = nb.from_local({0: np.full((4,), 1.0, np.float32), 1: np.full((4,), 2.0, np.float32)}, MESH, [None],
                      partial_axes=["x"])
    with nb.comm_log() as log:
        y = q * 2.0
    assert log.events == [] and y.sharding.partial_axes == ("x",), log.events
    assert np.array_equal(y.numpy(), np.full(4, 6.0, np.float32))


def _ops(k: int):
    a = nb.tensor(np.arange(16, dtype=np.float32).reshape(4, 4) + k).shard(MESH, ["x", None])
    with nb.comm_log() as log:
        s = (a @ a.T).sum(0)
    want = (np.arange(16, dtype=np.float32).reshape(4, 4) + k)
    np.testing.assert_allclose(s.numpy(), (want @ want.T).sum(0), rtol=1e-6)
    assert all(e.op for e in log.events)


def _draws(k: int):
    """A thread's seed fixes its own draws: numpy's generator with that seed gives the same values."""
    nb.random.seed(k)
    got = [nb.random.normal((3,)).numpy() for _ in range(3)]
    ref = np.random.default_rng(k)
    for g in got:
        np.testing.assert_array_equal(g, ref.standard_normal(3).astype(np.float32))


def test_eight_threads_share_no_state():
    rounds = examples(25, thorough_share=200)
    errors: list = []

    def worker(k: int):
        try:
            for r in range(rounds):
                [_overflowing, _plain, lambda: _ops(k), lambda: _draws(100 * k + r)][(k + r) % 4]()
                _plain()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append((k, e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_a_seed_in_one_thread_leaves_another_threads_draws_alone():
    nb.random.seed(5)
    first = nb.random.normal((4,)).numpy()
    t = threading.Thread(target=lambda: (nb.random.seed(99), nb.random.normal((1000,))))
    t.start()
    t.join()
    second = nb.random.normal((4,)).numpy()
    ref = np.random.default_rng(5)
    np.testing.assert_array_equal(first, ref.standard_normal(4).astype(np.float32))
    np.testing.assert_array_equal(second, ref.standard_normal(4).astype(np.float32))


def test_many_distinct_shapes_leave_memory_bounded(monkeypatch):
    """Each new shape interns a signature and fills plan caches; all of them are bounded. The intern table is
    made small here so that it empties itself within the run (at its real size, 32,768, it does after as many
    signatures); the caches are the real ones (4,096 to 8,192 entries each)."""
    monkeypatch.setattr(signatures, "_SIG_LIMIT", 2048)
    n = 20_000 if examples(1) > 1 else 1_500  # the thorough profile: 20,000 new shapes

    def one(rows: int):
        x = nb.tensor(np.ones((rows, 4), np.float32)).shard(MESH, ["x", None])
        return x + 1.0

    for rows in range(1, 501):  # warm: the caches and tables exist
        one(rows)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for rows in range(501, 501 + n):
            one(rows)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(signatures._SIG_IDS) <= 2048
    # what 8,192-entry plan caches and the bounded table can hold; without the bounds, 20,000 shapes held 183 MB
    assert grown < 40e6, f"{grown / 1e6:.1f} MB after {n:,} new shapes"
