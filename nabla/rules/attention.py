"""Attention (``jax.nn.dot_product_attention``'s layout) and its backward ops, as factors: batch ``b``, kv heads
``k``, query heads per kv head ``g`` (a query head dim is ``(k g)``, k major: head ``n`` reads kv head ``n // G``),
query positions ``t``, key positions ``s`` and the head dim ``h``; ``s`` and ``h`` need replication."""

from __future__ import annotations

from functools import lru_cache

from ..errors import ShardingError
from .core import PASS, REDUCE, REPLICATE, Rule, build

PARTS = ("forward", "dq", "dkv", "dbias")


@lru_cache(maxsize=1024)
def attention_rule(shapes: tuple[tuple[int, ...], ...], has_bias: bool, has_mask: bool, causal: bool,
                   part: str = "forward") -> Rule:
    """The rule of one of the attention ops over its operands ``q, k, v[, out, dout][, bias][, mask][, rows]``.

    ``part``: ``"forward"`` gives the output ``(B, T, N, H)``, ``"dq"`` the query's cotangent (same dims),
    ``"dkv"`` the key's and value's stacked ``(2, B, S, K, H)`` (``t`` and ``g`` are summed there: reduce
    factors, so a cut query sequence leaves partial sums), ``"dbias"`` the bias's cotangent in the bias's shape
    (the factors a broadcast bias lacks are summed). ``rows`` (with ``causal``) are the global query positions,
    ``(T,)``: a cut query sequence cuts them too. Shapes are checked by ``dot_product_attention``; a mismatch
    here is an internal error."""
    if part not in PARTS:
        raise ShardingError(f"dot_product_attention: unknown part {part!r} (parts: {PARTS})")
    q, k = shapes[0], shapes[1]
    B, T, N, H = q
    S, K = k[1], k[2]
    G = N // K if K else 0
    sizes: list[int] = []
    kinds: list = []

    def new(n: int, kind=PASS) -> tuple[int, ...]:
        sizes.append(n)
        kinds.append(kind)
        return (len(sizes) - 1,)

    # pass-through in every part (a factor of size 1 is never cut, as a dim of size 1 has none)
    fb, fk, fg = new(B), new(K), new(G)
    ft, fs, fh = new(T), new(S, REPLICATE), new(H, REPLICATE)
    heads = tuple(f for f, n in ((fk[0], K), (fg[0], G)) if n != 1)  # N = (K G), K major

    def dim(f: tuple[int, ...], n: int) -> tuple[int, ...]:
        return () if n == 1 else f

    qd = [dim(fb, B), dim(ft, T), heads, dim(fh, H)]
    kd = [dim(fb, B), dim(fs, S), dim(fk, K), dim(fh, H)]
    operands = [qd, kd, kd] + ([qd, qd] if part != "forward" else [])
    extra_at = len(operands)

    def broadcast(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """A bias or mask (rank 4, each dim 1 or full): its dims' factors."""
        return [() if n == 1 else f for n, f in zip(shape, (fb, heads, ft, fs))]

    bias_dims = None
    i = extra_at
    if has_bias:
        bias_dims = broadcast(shapes[i])
        operands.append(bias_dims)
        i += 1
    if has_mask:
        operands.append(broadcast(shapes[i]))
        i += 1
    if causal:
        operands.append([dim(ft, T)])
        i += 1
    if i != len(shapes):
        raise ShardingError(f"dot_product_attention: internal: {len(shapes)} operands for part {part!r} with "
                            f"bias={has_bias}, mask={has_mask}, causal={causal}")
    if part in ("forward", "dq"):
        result = qd
    elif part == "dkv":
        result = [new(2, REPLICATE)] + kd
    else:
        if bias_dims is None:
            raise ShardingError("dot_product_attention: internal: part 'dbias' without a bias")
        result = bias_dims
    # what the result lacks is summed over (a reduce factor), except what must be whole anyway
    used = {f for d in result for f in d}
    kinds = [k if k is REPLICATE or f in used else REDUCE for f, k in enumerate(kinds)]
    return build(operands, result, sizes, kinds)
