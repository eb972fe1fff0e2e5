"""Op sharding rules: one factor format for every op (Shardy's ``OpShardingRule``, seed 002's templates).

A rule names factors with sizes; every operand and result dim maps to a list of factors, major to
minor (reshape maps one dim to several). A factor's kind says how sharding it behaves:
``pass`` (in the result: shard freely), ``reduce`` (contracted: sharded operands give partial sums),
``replicate`` (the op needs the whole factor on each device, e.g. the dim a softmax or concat runs along).
Rules are pure data, hashable, and built by the templates in this package from shapes.
"""

from __future__ import annotations

from .core import Rule, parse
from .contraction import einsum_rule, matmul_rule
from .elementwise import broadcast_to_rule, elementwise_rule
from .reduction import reduce_rule
from .shape import (concatenate_rule, expand_dims_rule, index_rule, reshape_rule, squeeze_rule,
                    transpose_rule)

__all__ = ["Rule", "parse", "elementwise_rule", "broadcast_to_rule", "matmul_rule", "einsum_rule",
           "reduce_rule", "transpose_rule", "reshape_rule", "concatenate_rule", "index_rule",
           "squeeze_rule", "expand_dims_rule"]
