"""The ``programs()`` strategy of ``nabla.testing``: random op chains run on nabla and on numpy. Its elementwise
steps are the registered ops with a numpy reference (``nabla.ops.registry``), read when the strategy is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .mesh import DeviceMesh
from .ops import registry
from .opdef import OpDef
from .tensor import Tensor

import nabla as nb  # (nabla.testing is imported after the package, never by it)


@dataclass
class Program:
    """A chain of steps; ``run(nb)`` on the sharded input, ``run(np)`` on its value, then compare."""

    mesh: DeviceMesh
    inputs: list  # [(tensor, value)]
    steps: list = field(default_factory=list)  # (description, fn(lib, x, others) -> x)

    def run(self, lib: Any):
        xs = [t if lib is nb else v for t, v in self.inputs]
        x = xs[0]
        for _, fn in self.steps:
            x = fn(lib, x, xs)
        return x

    def __repr__(self) -> str:
        ins = ", ".join(f"{t.shape}{t.sharding!r}" for t, _ in self.inputs)
        return f"Program(mesh={self.mesh!r}, inputs=[{ins}], steps={[d for d, _ in self.steps]})"


def _softmax_np(x, axis):
    if x.size == 0:
        return np.exp(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def elementwise_ops(arity: int) -> list[OpDef]:
    """The public registered ops of ``arity`` operands with a numpy reference that keeps float32 float32 (the
    programs' values), in registration order: what ``programs`` draws, and what an op sweep parametrizes over."""
    out = []
    for op in list(registry.REGISTRY.values()):
        if op.public is None or op.reference is None or op.arity != arity:
            continue
        x = np.full(2, 0.5 if op.domain is None else sum(op.domain) / 2, np.float32)
        with np.errstate(all="ignore"):
            if np.asarray(op.reference(*[x] * arity)).dtype == np.float32:
                out.append(op)
    return out


def _step(op: OpDef, n: int) -> tuple[str, Callable]:
    """A step applying ``op`` to the value and the program's other input (``n`` = 2), operands clipped into the
    op's domain first (with maximum and minimum, in nabla and in numpy alike)."""
    def fn(lib, x, xs):
        args = [x, xs[1]][:n]
        if op.domain is not None:
            lo, hi = op.domain
            args = [lib.minimum(lib.maximum(a, lo), hi) for a in args]
        return op.reference(*args) if lib is np else op.public(*args)
    where = "" if op.domain is None else f" on [{op.domain[0]}, {op.domain[1]}]"
    return f"{op.name}{' other' if n == 2 else ''}{where}", fn


def programs(mesh: DeviceMesh | None, max_ops: int, meshes: Any, shapes: Any, specs: Any):
    """The strategy (``nabla.testing.programs``), drawing meshes, shapes and specs with the strategies given."""
    import hypothesis.strategies as st


    unary, binary = elementwise_ops(1), elementwise_ops(2)

    @st.composite
    def build(draw):
        m = mesh if mesh is not None else draw(meshes(max_devices=8))
        shape = draw(shapes(max_rank=3, max_dim=6, min_rank=1))
        seed = draw(st.integers(0, 1000))
        rng = np.random.default_rng(seed)
        value = rng.standard_normal(shape).astype(np.float32)
        spec = draw(specs(m, shape))
        t = Tensor._host(value).shard(m, spec.dim_specs, spec.replicated_axes, spec.partial_axes)
        other = rng.standard_normal(shape).astype(np.float32)
        ospec = draw(specs(m, shape, partial=False))
        o = Tensor._host(other).shard(m, ospec.dim_specs)
        prog = Program(m, [(t, value), (o, other)])
        cur = np.zeros(shape, np.float32)  # tracks the shape only

        def add(desc: str, fn: Callable, np_shape_fn: Callable):
            nonlocal cur
            prog.steps.append((desc, fn))
            cur = np_shape_fn(cur)

        for _ in range(draw(st.integers(1, max_ops))):
            r = cur.ndim
            choices = ["unary", "scalar", "with_sharding"]
            if cur.shape == shape:
                choices.append("binary")
            if r >= 1:
                choices += ["reduce", "transpose", "reshape", "matmul", "softmax", "slice", "expand"]
            kind = draw(st.sampled_from(choices))
            if kind == "unary":
                add(*_step(draw(st.sampled_from(unary)), 1), lambda a: a)
            elif kind == "scalar":
                c = draw(st.sampled_from([0.5, 2.0, -1.5]))
                op = draw(st.sampled_from(["add", "mul", "sub"]))
                f = {"add": lambda x, c: x + c, "mul": lambda x, c: x * c, "sub": lambda x, c: c - x}[op]
                add(f"{op} {c}", lambda lib, x, xs, f=f, c=c: f(x, np.float32(c) if lib is np else c), lambda a: a)
            elif kind == "binary":
                add(*_step(draw(st.sampled_from(binary)), 2), lambda a: a)
            elif kind == "with_sharding":
                s = draw(specs(m, cur.shape, partial=False))
                add(f"with_sharding {s!r}",
                    lambda lib, x, xs, s=s: x.with_sharding(m, s.dim_specs) if lib is nb and x.sharding is not None
                    else x, lambda a: a)
            elif kind == "reduce":
                op = draw(st.sampled_from(["sum", "mean", "max", "min"]))
                axis = draw(st.integers(0, r - 1))
                keep = draw(st.booleans())
                if cur.shape[axis] == 0 and op in ("max", "min"):
                    op = "sum"
                add(f"{op}(axis={axis}, keepdims={keep})",
                    lambda lib, x, xs, op=op, axis=axis, keep=keep: getattr(lib, op)(x, axis=axis, keepdims=keep),
                    lambda a, axis=axis, keep=keep: a.sum(axis=axis, keepdims=keep))
            elif kind == "transpose":
                perm = tuple(draw(st.permutations(range(r))))
                add(f"transpose{perm}", lambda lib, x, xs, perm=perm: lib.transpose(x, perm), lambda a, perm=perm: a.transpose(perm))
            elif kind == "reshape":
                n = int(np.prod(cur.shape))
                divisors = [d for d in range(1, n + 1) if n and n % d == 0] or [1]
                d = draw(st.sampled_from(divisors))
                target = (n,) if draw(st.booleans()) or n == 0 else (d, n // d)
                add(f"reshape{target}", lambda lib, x, xs, target=target: lib.reshape(x, target),
                    lambda a, target=target: a.reshape(target))
            elif kind == "matmul":
                k = draw(st.integers(1, 5))
                w = np.random.default_rng(seed + 1).standard_normal((cur.shape[-1], k)).astype(np.float32)
                add(f"matmul W{w.shape}", lambda lib, x, xs, w=w: lib.matmul(x, w), lambda a, w=w: a @ w)
            elif kind == "softmax":
                axis = draw(st.integers(0, r - 1))
                add(f"softmax({axis})", lambda lib, x, xs, axis=axis: nb.softmax(x, axis) if lib is nb
                    else _softmax_np(x, axis), lambda a: a)
            elif kind == "slice":
                n = cur.shape[0]
                if draw(st.booleans()):
                    add("[::-1]", lambda lib, x, xs: x[::-1], lambda a: a[::-1])
                else:
                    lo = draw(st.integers(0, n))
                    hi = draw(st.integers(lo, n))
                    add(f"[{lo}:{hi}]", lambda lib, x, xs, lo=lo, hi=hi: x[lo:hi], lambda a, lo=lo, hi=hi: a[lo:hi])
            elif kind == "expand":
                add("expand_dims(0)", lambda lib, x, xs: lib.expand_dims(x, 0), lambda a: np.expand_dims(a, 0))
        return prog

    return build()
