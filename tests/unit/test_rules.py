import pytest

import nabla as nb
from nabla import ShardingError
from nabla import rules as R
from nabla.rules.core import PASS, REDUCE, REPLICATE


def test_parse_matmul_signature():
    r = R.parse("mk,kn->mn", [(4, 8), (8, 2)])
    assert r.sizes == (4, 8, 2) and r.kinds == (PASS, REDUCE, PASS)
    assert r.result_shape == (4, 2)
    assert str(r) == "ij,jk->ik {i=4 j=8 k=2}"


def test_parse_errors():
    with pytest.raises(ShardingError, match="operand 1, dim 0: size 7 does not match"):
        R.parse("mk,kn->mn", [(4, 8), (7, 2)])
    with pytest.raises(ShardingError, match="2 operands, got 1"):
        R.parse("mk,kn->mn", [(4, 8)])


def test_matmul_template_broadcasts_batch():
    r = R.matmul_rule((3, 1, 4, 5), (2, 5, 6))
    assert r.result_shape == (3, 2, 4, 6)
    assert r.operands[0][1] == ()  # size-1 batch dim: no factor (ONNX broadcast rule)
    assert r.kinds[r.operands[0][3][0]] == REDUCE
    with pytest.raises(ShardingError, match="contracted dims differ"):
        R.matmul_rule((4, 5), (6, 2))


def test_elementwise_broadcast_dims_get_no_factor():
    r = R.elementwise_rule(((5, 1), (1, 7)))
    assert r.operands == (((0,), ()), ((), (1,)))
    assert r.result_shape == (5, 7)
    with pytest.raises(ShardingError, match="do not broadcast"):
        R.elementwise_rule(((5, 2), (3, 2)))


def test_elementwise_rules_are_those_of_shardys_elementwise_ops():
    """Shardy's AGGRESSIVE strategy breaks ties by how sharded a factor is only for elementwise ops (add, where,
    a broadcasting add as CHLO's broadcasting ops); a dot, a transpose, a concatenate, a reduction, an index
    or a softmax's whole-axis factor is not elementwise."""
    assert R.elementwise_rule(((4, 6), (4, 6))).elementwise
    assert R.elementwise_rule(((5, 1), (1, 7), (7,))).elementwise
    assert R.elementwise_rule(((3,), (3,), (3,))).elementwise
    assert not R.matmul_rule((4, 5), (5, 6)).elementwise
    assert not R.einsum_rule("ij,ji->ij", ((3, 3), (3, 3))).elementwise
    assert not R.transpose_rule((2, 3), (1, 0)).elementwise
    assert not R.concatenate_rule(((2, 3), (2, 5)), 1).elementwise
    assert not R.reduce_rule((3, 4), (1,), False).elementwise
    assert not R.index_rule((8, 4), (("reverse",), ("full",))).elementwise
    assert not R.elementwise_rule(((4, 6),), replicate_dims=(1,)).elementwise


def test_reduce_template():
    r = R.reduce_rule((3, 4, 5), (1,), False)
    assert r.result_shape == (3, 5) and r.kinds[1] == REDUCE
    assert R.reduce_rule((3, 4, 5), (1,), True).result_shape == (3, 1, 5)
    assert R.reduce_rule((3, 4), (0,), False, replicate=True).kinds[0] == REPLICATE


def test_reshape_factors_split_and_merge():
    r = R.reshape_rule((8, 4), (2, 16))
    assert str(r).startswith("(ij)k->i(jk)")
    assert r.sizes == (2, 4, 4)
    assert str(R.reshape_rule((8, 16), (128,))).startswith("ij->(ij)")
    assert str(R.reshape_rule((128,), (2, 64))).startswith("(ij)->ij")


def test_reshape_keeps_common_factors_from_both_ends():
    """(6,4)->(4,6): the major factor 2 is shared, the rest (3x2 against 2x3) needs replication (Shardy's
    op_sharding_rule_registry.mlir, @reshape_swap_dims_with_common_divisor); (3,4,4)->(2,3,8) shares the
    minor factors 2 and 4 (@reshape_split_and_swap); coprime (3,2)->(2,3) shares nothing."""
    r = R.reshape_rule((6, 4), (4, 6))
    shared = [f for f in r.operands[0][0] if f in r.result[0]]
    assert [r.sizes[f] for f in shared] == [2] and r.kinds[shared[0]] == PASS
    r = R.reshape_rule((3, 4, 4), (2, 3, 8))
    assert [r.sizes[f] for f in r.result[2]] == [2, 4] and all(r.kinds[f] == PASS for f in r.result[2])
    assert set(R.reshape_rule((3, 2), (2, 3)).kinds) == {REPLICATE}
    with pytest.raises(ShardingError, match="cannot reshape size 24"):
        R.reshape_rule((6, 4), (5, 5))


def test_transpose_einsum_concat_index_squeeze_expand():
    assert R.transpose_rule((2, 3, 4), (2, 0, 1)).result_shape == (4, 2, 3)
    e = R.einsum_rule("bij,bjk->bik", ((2, 3, 4), (2, 4, 5)))
    assert e.result_shape == (2, 3, 5) and e.kinds.count(REDUCE) == 1
    c = R.concatenate_rule(((2, 3), (2, 5)), 1)
    from nabla.factors import Window, WindowSpec
    joined = c.kinds[c.result[1][0]]  # one window factor: result row r reads row r - offset of its operand
    assert c.result_shape == (2, 8) and joined == Window(8, (WindowSpec(3, pad_lo=0), WindowSpec(5, pad_lo=3)))
    assert c.operands[0][1] == c.operands[1][1] == c.result[1]
    ix = R.index_rule((4, 5, 6), (("full",), ("slice", 1, 3, 1), ("int", 2), ("new",)))
    assert ix.result_shape == (4, 2, 1)
    assert R.squeeze_rule((3, 1, 4), (1,)).result_shape == (3, 4)
    assert R.expand_dims_rule((3, 4), (0, 2)).result_shape == (1, 3, 1, 4)
    with pytest.raises(ShardingError, match="diagonals"):
        R.einsum_rule("ii->i", ((3, 3),))


def test_reversing_a_dim_is_a_permutation_factor():
    from nabla.rules.core import PERMUTE
    r = R.index_rule((8, 4), (("reverse",), ("full",)))
    assert r.kinds[r.operands[0][0][0]] == PERMUTE and r.result == r.operands[0]


def test_matmul_batch_dims_that_do_not_broadcast_show_both_shapes():
    with pytest.raises(ShardingError, match=r"matmul of shapes \(2, 3, 4\) and \(3, 4, 5\): the batch dims .* "
                                            r"\(2,\) and \(3,\) do not broadcast"):
        nb.ones((2, 3, 4)) @ nb.ones((3, 4, 5))


def test_attention_rule_cuts_query_heads_as_kv_head_then_group():
    # q (B, T, N = K·G, H), k and v (B, S, K, H); a (1, N, T, S) bias, causal rows (T,)
    shapes = ((2, 8, 6, 4), (2, 5, 2, 4), (2, 5, 2, 4), (1, 6, 8, 5), (8,))
    r = R.attention_rule(shapes, True, False, True)
    assert str(r) == "il(jk)n,imjn,imjn,1(jk)lm,l->il(jk)n {i=2 j=2 k=3 l=8 m=5 n=4; replicate mn}"
    dkv = R.attention_rule(shapes[:3] + ((2, 8, 6, 4),) * 2 + shapes[3:], True, False, True, "dkv")
    assert dkv.result_shape == (2, 2, 5, 2, 4)
    kinds = {f: str(k) for f, k in zip("ijklmno", dkv.kinds)}
    assert kinds == {"i": "pass", "j": "pass", "k": "reduce", "l": "reduce", "m": "replicate", "n": "replicate",
                     "o": "replicate"}  # the group and the queries are summed into dk, dv
    dbias = R.attention_rule(shapes[:3] + ((2, 8, 6, 4),) * 2 + shapes[3:], True, False, True, "dbias")
    assert dbias.result_shape == (1, 6, 8, 5) and str(dbias.kinds[0]) == "reduce"  # the bias has no batch
