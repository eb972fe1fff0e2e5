"""Op sharding rules: one factor format for every op (Shardy's ``OpShardingRule``, the Nabla sharding README's templates).
Factors have sizes and kinds (``pass``; ``reduce``: sharded gives partial sums; ``replicate``: must be
whole; ``permute``: shards evenly, blocks change devices); every dim maps to factors, major to minor."""

from __future__ import annotations

from .core import Rule, parse
from .attention import attention_rule
from .contraction import einsum_rule, matmul_rule
from .conv import conv_rule, pool_rule
from .elementwise import broadcast_to_rule, elementwise_rule
from .gather import one_hot_rule, scatter_along_rule, scatter_rule, take_along_rule, take_rule
from .reduction import reduce_rule
from .shape import (concatenate_rule, expand_dims_rule, index_rule, pad_rule, reshape_rule, roll_rule, squeeze_rule,
                    transpose_rule)

__all__ = ["Rule", "parse", "elementwise_rule", "broadcast_to_rule", "matmul_rule", "einsum_rule",
           "reduce_rule", "transpose_rule", "reshape_rule", "concatenate_rule", "index_rule",
           "squeeze_rule", "expand_dims_rule", "conv_rule", "pool_rule", "pad_rule", "roll_rule", "take_rule",
           "scatter_rule", "take_along_rule", "scatter_along_rule", "one_hot_rule", "attention_rule"]
