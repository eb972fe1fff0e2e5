import io

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh, ShardingError
from nabla.debug import render_sharding, short

MESH = DeviceMesh("cluster", (2, 4), ("dp", "tp"))


# ---- visualize_sharding ------------------------------------------------------------------------------------


def test_visualize_prints_plain_text_when_not_a_terminal_and_returns_none(capsys):
    mesh = DeviceMesh("c", (2, 2), ("x", "y"))
    t = nb.ones((5, 4)).shard(mesh, ["x", None])
    assert nb.visualize_sharding(t) is None
    out = capsys.readouterr().out
    assert "[0:3, 0:4] dev 0,1" in out and "[3:5, 0:4] dev 2,3" in out
    assert "uneven: dim 0 of size 5 over 2 shards gives blocks of 3, 2 (ceil rule)" in out
    assert "\x1b[" not in out  # no colour codes into a pipe
    assert out.strip() == render_sharding(t).strip()


def test_plain_picture_of_a_2d_tensor():
    t = nb.arange(40, dtype="float32").reshape(5, 8).shard(MESH, ["dp", "tp"])
    assert render_sharding(t).splitlines() == [
        '[{"dp"}, {"tp"}] on @cluster = <["dp"=2, "tp"=4]>, shape (5, 8)',
        "+------------------+------------------+------------------+------------------+",
        "| [0:3, 0:2] dev 0 | [0:3, 2:4] dev 1 | [0:3, 4:6] dev 2 | [0:3, 6:8] dev 3 |",
        "+------------------+------------------+------------------+------------------+",
        "| [3:5, 0:2] dev 4 | [3:5, 2:4] dev 5 | [3:5, 4:6] dev 6 | [3:5, 6:8] dev 7 |",
        "+------------------+------------------+------------------+------------------+",
        "uneven: dim 0 of size 5 over 2 shards gives blocks of 3, 2 (ceil rule)",
    ]


def test_1d_uneven_empty_and_partial_blocks_are_marked():
    m = DeviceMesh("q", (4,), ("d",))
    text = render_sharding(nb.ones(5).shard(m, ["d"]))
    assert "| [0:2] dev 0 | [2:4] dev 1 | [4:5] dev 2 |" in text  # one row, as jax draws a vector
    assert "blocks of 2, 2, 1, 0 (ceil rule)" in text and "empty blocks" in text and "device 3" in text
    p = render_sharding(nb.ones((4, 4)).shard(MESH, [None, "tp"], partial_axes=["dp"]))
    assert "[0:4, 0:1] Σ dev 0,4" in p and "partial sums over ['dp'] (Σ)" in p
    assert "unsharded host tensor" in render_sharding(nb.ones(3))
    r = render_sharding(nb.ones(()).shard(MESH, []))
    assert "[] dev 0-7" in r


def test_higher_rank_shows_the_first_two_dims_and_says_so():
    text = render_sharding(nb.ones((4, 6, 8)).shard(MESH, ["dp", None, "tp"]))
    assert "[0:2, 0:6, ...] dev 0: [.., 0:2]; dev 1: [.., 2:4]" in text
    assert "rank 3: the grid shows dims 0 and 1; dim 2 is sharded too" in text
    whole = render_sharding(nb.ones((4, 4, 3)).shard(MESH, ["dp", "tp", None]))
    assert "[2:4, 1:2, ...] dev 5" in whole and "dim 2 is whole on every device" in whole


def test_rich_picture_colours_each_device_group():
    pytest.importorskip("rich")
    t = nb.ones((4, 8)).shard(MESH, ["dp", None])  # two groups of replicas: devices 0-3 and 4-7
    text = render_sharding(t, plain=False)
    assert "\x1b[" in text and "┌" in text  # colours and a box
    assert "dev 0-3" in text and "dev 4-7" in text
    colours = {c for c in text.split("\x1b[") if "48;2;" in c}
    assert len({c.split("48;2;")[1].split("m")[0] for c in colours}) == 2  # one background per group
    buf = io.StringIO()
    nb.visualize_sharding(t, plain=False, file=buf)
    assert "dev 4-7" in buf.getvalue()


def test_short_notation():
    assert short(nb.ones((2, 2)).shard(MESH, ["dp", None]).sharding) == "[dp|-]"
    assert short(nb.exp(nb.ones((2, 2)).shard(MESH, [("dp", "tp"), None])).sharding) == "[dp,tp?|?]"
    assert short(nb.ones(2).shard(MESH, [None], partial_axes=["tp"]).sharding) == "[-] Σtp"
    assert short(None) == "host"


# ---- explain ------------------------------------------------------------------------------------------------


def _mlp_args():
    x = nb.random.normal((8, 16), seed=0).shard(MESH, ["dp", None])
    w1 = nb.random.normal((16, 32), seed=1).shard(MESH, [None, "tp"])
    w2 = nb.random.normal((32, 16), seed=2).shard(MESH, ["tp", None])
    return x, w1, w2


def test_explain_walks_the_ops_and_gives_each_collective_its_reason(capsys):
    def mlp(x, w1, w2):
        return nb.softmax(nb.relu(x @ w1) @ w2)

    text = nb.explain(mlp, *_mlp_args())
    assert text in capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "explain mlp: 4 ops" and lines[1] == "strategy aggressive"
    for title in ("%1 = matmul(x, w1)", "%2 = relu(%1)", "%3 = matmul(%2, w2)", "%4 = softmax(%3)"):
        assert title in lines
    assert '  operand 1 w1: f32[16,32] [{}, {"tp"}]   [-|tp]' in lines
    assert "  factor j=32 (reduce, contracting): op0 [tp]? op1 [tp] -> [tp]" in lines
    assert '  result f32[8,16] [{"dp", ?}, {?}], partial={"tp"}   [dp?|?] Σtp' in lines
    assert ("  operand 0 [dp?|?] Σtp -> [dp?|?]: all_reduce over tp (group of 4): 384 B/device, est. 30.0 us"
            in lines)
    assert "    why: softmax is not linear in operand 0: its pending sum over ['tp'] is made first" in lines
    assert "total: 1 collective, 384 B/device, est. 30.0 us" in lines
    assert "softmax" in text.split("comm log of the run:")[1]  # the run's own comm log, user op named


def test_explain_follows_the_backward_pass_of_grad_and_names_the_public_op_of_each_step():
    m = nb.DeviceMesh("m", (4,), ("dp",))
    x = nb.ones((8, 4)).shard(m, ["dp", None])
    w = nb.ones((4, 2)).shard(m, [None, None])
    text = nb.explain(nb.grad(lambda w, x: (x @ w).sum()), w, x, show=False)
    titles = [line for line in text.splitlines() if line.startswith("%")]
    # every step that ran, in order: the forward pass (its pending sum is never made: nothing reads it), the seed
    # cotangent broadcast back through sum, then d/dw sum(x @ w) = x.T @ ones (an einsum of x as it is: no transposed copy): a contraction over the dp-sharded
    # batch, and the dp sum of its summands; the arguments named as the differentiated function names them
    assert titles == ["%1 = matmul(x, w)", "%2 = sum(%1)", "%3 = shard(const)",
                      "%4 = expand_dims(%3)    (in gradient of sum)", "%5 = broadcast_to(%4)    (in gradient of sum)",
                      "%6 = with_sharding(%5)    (in gradient of sum)",  # laid out as the summed value: a local cut
                      "%7 = einsum(x, %6)    (in gradient of matmul)",  # x contracted as it is kept
                      "%8 = with_sharding(%7)    (in grad of w)"], titles
    assert "[?|?] Σdp -> [-|-]: all_reduce over dp (group of 4): 48 B/device, est. 30.0 us" in text
    assert "total: 1 collective, 48 B/device, est. 30.0 us" in text

    y = nb.random.normal((8, 16)).shard(m, ["dp", None])
    steps = [line for line in nb.explain(lambda y: nb.softmax(y, axis=0), y, show=False).splitlines()
             if line.startswith("%")]
    assert steps == ["%1 = max(y)    (in softmax)", "%2 = subtract(y, %1)    (in softmax)",
                     "%3 = exp(%2)    (in softmax)", "%4 = sum(%3)    (in softmax)",
                     "%5 = divide(%3, %4)    (in softmax)"], steps


def test_explain_says_why_fsdp_gathers_the_weight():
    x, _, _ = _mlp_args()
    w = nb.random.normal((16, 32), seed=4).shard(MESH, ["dp", None])
    text = nb.explain(lambda x, w: x @ w, x, w, show=False)
    assert "operand 1 [dp|-] -> [-|-]: all_gather over dp (group of 2): 1,024 B/device, est. 5.0 us" in text
    assert ("why: dim 0 [dp] -> []: its factors decided j->[]; axis dp went to factor i, which also wants it: a "
            "factor of the result beats a contracting one") in text


def test_explain_under_basic_names_the_strategy_and_reshards_are_explained():
    a = nb.ones((8, 8)).shard(MESH, ["dp", None])
    b = nb.ones((8, 8)).shard(MESH, [None, "tp"])
    with nb.strategy("basic"):
        text = nb.explain(lambda a, b: a + b, a, b, show=False)
    assert "strategy basic" in text and text.count("all_gather") >= 2
    assert "strategy basic: a closed operand never gains an axis, so factor i stays []" in text
    text = nb.explain(lambda a, b: a + b, a, b, show=False)
    assert "no communication" in text and "all_gather" not in text
    moved = nb.explain(lambda a: a.with_sharding(MESH, [None, "dp"]).sum(0), a, show=False)
    assert "%1 = with_sharding(a)" in moved and "[dp|-] -> [-|dp]: all_to_all over dp" in moved
    assert "a host value" not in moved


def test_explain_counts_a_pending_sum_once_and_takes_pytrees_and_host_operands():
    x, w1, w2 = _mlp_args()

    def f(p, x):
        y = x @ p["w1"] @ p["w2"]  # partial over tp
        return nb.exp(y) + nb.tanh(y) + np.ones(16, np.float32)  # two non-linear uses: one sum

    with nb.comm_log() as log:
        f({"w1": w1, "w2": w2}, x)
    text = nb.explain(f, {"w1": w1, "w2": w2}, x, show=False)
    assert "= matmul(x, p['w1'])" in text
    assert f"total: {len(log.events)} collective" in text and len(log.events) == 1
    assert "already moved" in text or "made by an earlier use" in text
    assert "is a host value: placed as" in text


def test_explain_formats():
    x, w1, w2 = _mlp_args()
    md = nb.explain(lambda x, w: nb.relu(x @ w), x, w1, format="markdown", show=False)
    assert "#### `%1 = matmul(x, w)`" in md and "`[dp|-]`" in md and "```" not in md
    html = nb.explain(lambda x, w: nb.tanh(x @ w), x.with_sharding(MESH, [None, "tp"]),
                      w1.with_sharding(MESH, ["tp", None]), format="html", show=False)
    assert html.startswith('<div class="nabla-explain">') and "<h4><code>%" in html
    assert "<li class=\"why\"><i>why:</i>" in html and "&quot;tp&quot;" in html and "<pre>" in html
    with pytest.raises(ShardingError, match="format must be"):
        nb.explain(lambda x: x, x, format="pdf")


# ---- the comm log's "during" column names the op the user called ------------------------------------------


def test_during_names_the_users_op_for_methods_and_numpy_calls():
    x = nb.random.normal((8, 16), seed=0).shard(MESH, [None, "tp"])
    with nb.comm_log() as log:
        x.argmax(1)
        np.argmax(x, axis=1)
    assert {e.op for e in log.events} == {"argmax"}
    assert "argmax" in log.summary().splitlines()[2]


def test_during_names_composite_ops():
    x = nb.random.normal((8, 16), seed=0).shard(MESH, [None, "tp"])
    for name, f in (("softmax", lambda: nb.softmax(x, -1)), ("argmax", lambda: nb.argmax(x, -1)),
                    ("layer_norm", lambda: nb.layer_norm(x))):
        with nb.comm_log() as log:
            f()
        assert log.events and {e.op for e in log.events} == {name}, (name, [e.op for e in log.events])


def test_plain_pictures_fit_max_width_and_leave_out_the_middle_of_big_grids(capsys):
    m = nb.DeviceMesh("m", (2, 4), ("dp", "tp"))
    nb.visualize_sharding(nb.ones((16, 64)).shard(m, [None, "tp"]), max_width=60, plain=True)
    lines = capsys.readouterr().out.splitlines()
    assert max(len(x) for x in lines if x.startswith(("+", "|"))) <= 60
    assert "(columns 1-2 of 4)" in lines and "(columns 3-4 of 4)" in lines
    assert "| [0:16, 0:16] dev 0,4  | [0:16, 16:32] dev 1,5 |" in lines
    big = nb.DeviceMesh("b", (16, 16), ("a", "b"))
    nb.visualize_sharding(nb.ones((32, 32)).shard(big, ["a", "b"]), plain=True)
    out = capsys.readouterr().out
    assert "dev 0 " in out and "dev 255 " in out and "dev 119 " not in out  # a middle block is left out
    assert "... marks blocks left out: 16 rows x 16 columns of blocks in all" in out
    assert max(len(x) for x in out.splitlines() if x.startswith(("+", "|"))) <= 80


def test_visualize_sharding_of_something_else_says_what_it_takes():
    with pytest.raises(nb.ShardingError, match="visualize_sharding: expected a nabla Tensor, got ndarray"):
        nb.visualize_sharding(np.ones((3, 3)))


def test_summary_writes_large_numbers_with_separators():
    m = nb.DeviceMesh("m", (2,), ("x",))
    slow = nb.CostModel(latency=1.0)  # one second per ring step
    with nb.cost_model(slow), nb.comm_log() as log:
        nb.tensor(np.ones(4)).shard(m, ["x"]).with_sharding(m, [None])
    assert "1,000,000.0" in log.summary()
